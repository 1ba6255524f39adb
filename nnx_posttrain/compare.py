"""Compare runs: final and best eval metrics, config differences, and metric curves
(``nnx-posttrain compare``, ``compare.compare``).

    nnx-posttrain compare RUN_DIR [RUN_DIR ...] [--metrics loss,exact_match] [--out DIR]

Reads each run's ``config.json`` and ``metrics.jsonl`` and prints
(a) a Markdown table, one row per run: for each eval metric its final value and its best value
    with the step (the minimum for metrics whose name contains 'loss', 'perplexity' or 'kl', the
    maximum otherwise; NaN values are ignored for the best);
(b) the scores of ``--eval-only`` commands, apart: one row per record with the checkpoint, the
    data and the settings it scored (never a run's own final or best: they may be other data);
(c) the config keys (flattened, dotted) whose values differ between runs, as a table key x run
    (``run_dir`` is left out: it always differs and names the column already);
(d) the lm-evaluation-harness scores (``nnx-posttrain eval``) and win rates (``nnx-posttrain
    judge``) written into the runs, where there are any.
Writes one PNG per chosen metric (one colour per run; train solid, eval dashed with markers) into
``--out`` (default: ``compare/`` in the runs' common parent directory) and prints the paths.
``--metrics`` chooses the metrics of the table and the plots; by default the table has every eval
metric and the plots ``loss`` and ``exact_match`` (those present).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from nnx_posttrain import errors

MIN_MARKERS = ("loss", "perplexity", "kl", "rejected")  # TRL's rewards/ logps/rejected: lower
DEFAULT_PLOTS = ("loss", "exact_match")
_MISSING = object()


@dataclass
class Run:
    path: Path
    config: dict
    records: list[dict]
    label: str = ""
    flat_config: dict = field(default_factory=dict)

    def series(self, split: str, metric: str) -> list[tuple[int, float]]:
        """(step, value) of ``metric`` in ``split``'s records, in log order ("nan" -> NaN)."""
        return [(int(r["step"]), _num(r[metric])) for r in self.records
                if r.get("split") == split and metric in r]

    def metrics(self, split: str) -> list[str]:
        names: dict[str, None] = {}
        for r in self.records:
            if r.get("split") == split:
                names.update((k, None) for k in r if k not in ("step", "split", *EVAL_ONLY_FIELDS))
        return list(names)


def _num(value) -> float:
    try:
        return float(value)  # float("nan"), float("inf") parse the logged strings too
    except (TypeError, ValueError):
        return math.nan


def load_run(path: str | Path) -> Run:
    """A run directory -> Run; ``RunDirError`` naming the path if it has no metrics.jsonl."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise errors.RunDirError(f"{path} is not a run directory: no {metrics}")
    records = []
    lines = metrics.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # cut by a killed process: the run drops it on resume too
                continue
            raise errors.RunDirError(f"{metrics}:{n}: not JSON ({exc.msg})") from None
        if record.get("eval_only") and record.get("split") == "eval":  # as older runs logged it
            record["split"] = "eval_only"
        records.append(record)
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except ValueError as exc:
        raise errors.RunDirError(f"{config_path}: not JSON ({exc})") from None
    return Run(path=path, config=config, records=records, label=path.name or str(path),
               flat_config=flatten(config))


def load_runs(paths) -> list[Run]:
    runs = [load_run(p) for p in paths]
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):  # same basename: label by the path from the common parent
        parent = common_parent([r.path for r in runs])
        for r in runs:
            r.label = os.path.relpath(r.path.resolve(), parent)
    return runs


def flatten(d: dict, prefix: str = "") -> dict:
    """{"optim": {"learning_rate": 1e-3}} -> {"optim.learning_rate": 1e-3}; empty dicts are kept as {}."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def lower_is_better(metric: str) -> bool:
    name = metric.lower()
    return any(m in name for m in MIN_MARKERS)


def summarize(run: Run, metric: str, split: str = "eval") -> dict | None:
    """{"final", "best", "best_step"} of one metric in one split; None if the run never logged it.
    The best ignores NaN (best and best_step are None if every value is NaN); ties go to the
    earliest step."""
    series = run.series(split, metric)
    if not series:
        return None
    finite = [(s, v) for s, v in series if not math.isnan(v)]
    best_step = best = None
    if finite:
        pick = min if lower_is_better(metric) else max
        best = pick(v for _, v in finite)
        best_step = next(s for s, v in finite if v == best)
    return {"final": series[-1][1], "final_step": series[-1][0], "best": best, "best_step": best_step}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def eval_metrics(runs: list[Run]) -> list[str]:
    names: dict[str, None] = {}
    for r in runs:
        names.update((m, None) for m in r.metrics("eval"))
    return list(names)


def summary_table(runs: list[Run], metrics: list[str] | None = None) -> str:
    """Markdown: one row per run; per eval metric its final value and best value @ step."""
    metrics = metrics or eval_metrics(runs)
    head = ["run"]
    for m in metrics:
        head += [f"{m} final", f"{m} best ({'min' if lower_is_better(m) else 'max'}) @ step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        row = [r.label]
        for m in metrics:
            s = summarize(r, m)
            if s is None:
                row += ["-", "-"]
            else:
                best = "-" if s["best"] is None else f"{_fmt(s['best'])} @ {s['best_step']}"
                row += [_fmt(s["final"]), best]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


EVAL_ONLY_FIELDS = ("eval_only", "eval_data", "eval_data_signature", "eval_settings")


def eval_only_table(runs: list[Run], metrics: list[str] | None = None) -> str:
    """Markdown: one row per ``--eval-only`` record: the run, the step and checkpoint, the data
    (and the digest of their content) and settings it scored, its metrics; '' if there is none."""
    rows = [(r, rec) for r in runs for rec in r.records if rec.get("split") == "eval_only"]
    if not rows:
        return ""
    names = metrics or list(dict.fromkeys(
        k for _, rec in rows for k in rec if k not in ("step", "split", *EVAL_ONLY_FIELDS)))
    head = ["run", "step", "scored", "data", "data signature", "settings", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, rec in rows:
        cells = [r.label, str(rec["step"]), *(str(rec.get(k) or "?") for k in EVAL_ONLY_FIELDS)]
        lines.append("| " + " | ".join(cells + [_fmt(_num(rec[m])) if m in rec else "-"
                                                for m in names]) + " |")
    return "\n".join(lines)


def benchmark_table(runs: list[Run]) -> str:
    """Markdown: the lm-evaluation-harness scores written into the runs (``nnx-posttrain eval``:
    RUN/lm_eval/step_<S>.json), one row per run, step, task and metric; '' if there is none."""
    from nnx_posttrain.harness.evaluate import scores

    lines = []
    for r in runs:
        for path in sorted((r.path / "lm_eval").glob("step_*.json"),
                           key=lambda p: int(p.stem.split("_")[1])):
            for task, metric, value, stderr in scores(json.loads(path.read_text())):
                lines.append(f"| {r.label} | {path.stem.split('_')[1]} | {task} | {metric} | "
                             f"{_fmt(value)}" + (f" ± {_fmt(stderr)}" if stderr else "") + " |")
    if not lines:
        return ""
    return "\n".join(["| run | step | task | metric | value |", "|---|---|---|---|---|", *lines])


def win_rate_table(runs: list[Run]) -> str:
    """Markdown: the win rates written into the runs (``nnx-posttrain judge``: RUN/judge/*.json),
    one row per run and opponent; '' if there is none."""
    lines = []
    for r in runs:
        for path in sorted((r.path / "judge").glob("*.json")):
            j = json.loads(path.read_text())
            lines.append(f"| {r.label} | {j['run_b']} | {j['judge']} | "
                         f"{100 * j['win_rate']:.1f}% [{100 * j['low']:.1f}, "
                         f"{100 * j['high']:.1f}] | {j['wins']} / {j['losses']} / {j['ties']} |")
    if not lines:
        return ""
    return "\n".join(["| run | against | judge | win rate (ties half) [95% CI] | "
                      "wins / losses / ties |", "|---|---|---|---|---|", *lines])


def config_diff(runs: list[Run], ignore=("run_dir", "resume_changed", "resolved_from")
                ) -> dict[str, list]:
    """{dotted key: [value per run]} for the keys whose values differ (a key a run lacks counts as
    different and shows as '-'). Left out: where a run writes (``run_dir``), what a resume of it
    was allowed to change (``resume_changed``), the layers its values came from
    (``resolved_from``: the data and the config file, which are listed), and an empty group (SFT's ``algo: {}``) whose keys
    other runs have (they are listed one by one)."""
    keys: dict[str, None] = {}
    for r in runs:
        keys.update((k, None) for k in r.flat_config)
    diff = {}
    for key in sorted(keys):
        if key in ignore or any(k.startswith(key + ".") for k in keys):
            continue
        values = [r.flat_config.get(key, _MISSING) for r in runs]
        canon = {"\0missing" if v is _MISSING else json.dumps(v, sort_keys=True, default=str)
                 for v in values}
        if len(canon) > 1:
            diff[key] = ["-" if v is _MISSING else v for v in values]
    return diff


def config_diff_table(runs: list[Run], diff: dict | None = None) -> str:
    diff = config_diff(runs) if diff is None else diff
    if not diff:
        return "(no config differences)"
    lines = ["| key | " + " | ".join(r.label for r in runs) + " |", "|" + "---|" * (len(runs) + 1)]
    for key, values in diff.items():
        lines.append(f"| {key} | " + " | ".join(json.dumps(v) if isinstance(v, (dict, list)) else str(v)
                                               for v in values) + " |")
    return "\n".join(lines)


def common_parent(paths) -> Path:
    parents = [str(Path(p).resolve().parent) for p in paths]
    return Path(os.path.commonpath(parents))


def _safe(metric: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in metric)


def plot(runs: list[Run], metrics: list[str], out: str | Path) -> list[Path]:
    """One PNG per metric in ``out``: a line per run over steps, train solid, eval dashed.
    Drawn on matplotlib ``Figure`` objects: pyplot's global state and backend stay as they were."""
    import matplotlib
    from matplotlib.figure import Figure

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for metric in metrics:
        fig = Figure(figsize=(7, 4.5))
        ax = fig.subplots()
        drawn = False
        for i, r in enumerate(runs):
            color = colors[i % len(colors)]
            for split, style in (("train", dict(linestyle="-")), ("eval", dict(linestyle="--", marker="o"))):
                series = r.series(split, metric)
                if series:
                    steps, values = zip(*series)
                    if len(steps) == 1:  # a lone point is invisible as a line
                        style = {**style, "marker": style.get("marker", "s")}
                    ax.plot(steps, values, color=color, label=f"{r.label} ({split})", **style)
                    drawn = True
        if not drawn:
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{_safe(metric)}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def default_plot_metrics(runs: list[Run]) -> list[str]:
    present = {m for r in runs for split in ("train", "eval") for m in r.metrics(split)}
    chosen = [m for m in DEFAULT_PLOTS if m in present]
    return chosen or eval_metrics(runs)


def compare(paths, metrics: list[str] | None = None, out: str | Path | None = None, echo=print) -> dict:
    """Everything the command does; returns {"summary", "config_diff", "plots"}."""
    if not paths:
        raise errors.ConfigError("give at least one run directory")
    runs = load_runs(paths)
    logged = {m for r in runs for split in ("train", "eval", "eval_only") for m in r.metrics(split)}
    unknown = [m for m in metrics or [] if m not in logged]
    if unknown:
        raise errors.ConfigError(f"--metrics {','.join(unknown)}: not logged by these runs; they "
                                 f"log {', '.join(sorted(logged)) or 'nothing yet'}")
    out = Path(out) if out is not None else common_parent([r.path for r in runs]) / "compare"
    summary = summary_table(runs, metrics)
    apart = eval_only_table(runs, metrics)
    diff = config_diff_table(runs)
    benchmarks, wins = benchmark_table(runs), win_rate_table(runs)
    plots = plot(runs, metrics or default_plot_metrics(runs), out)
    echo("## Eval metrics\n\n" + summary + "\n")
    if apart:
        echo("## Eval-only scores\n\n--eval-only commands, not the runs' own evaluations: each "
             "names the data and settings it scored.\n\n" + apart + "\n")
    if benchmarks:
        echo("## Benchmarks (lm-evaluation-harness: nnx-posttrain eval)\n\n" + benchmarks + "\n")
    if wins:
        echo("## Win rates (nnx-posttrain judge)\n\n" + wins + "\n")
    echo("## Config differences\n\n" + diff + "\n")
    echo("plots:" + "".join(f"\n  {p}" for p in plots) if plots else "plots: none (metrics not logged)")
    return {"summary": summary, "eval_only": apart, "config_diff": diff, "plots": plots,
            "benchmarks": benchmarks, "win_rates": wins}
