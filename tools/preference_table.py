"""The README's method table: every preference and online RL method over seeds, each from the SFT
run of the same seed, on the built-in task, with confidence intervals.

    python -m tools.preference_table --seeds 3                  # the README's table
    python -m tools.preference_table --seeds 2 --methods sft,dpo,dpo_lr0 --sft-steps 100 \\
        --steps 20 --record none                                # a quick check of the machinery

For each seed s: ``python -m experiments.sft --seed s`` (the default SFT run), then every method
``python -m experiments.<method> --seed s --init-from <that run>`` with its own defaults, each in
its own process under ``--out`` (default runs/table/seed<s>/<method>; a finished run with the same
command is reused, so a stopped table resumes). Rows:

- ``sft``: the baseline, SFT continued for as many steps as the preference methods, with their
  schedule, on the same demonstrations;
- ``dpo_lr0``: the control, DPO at learning rate 0: its weights never change, so it must show no
  effect (a nonzero one would mean the comparison itself is broken: evaluation, pairing, seeds);
- every other method with its experiment's defaults; ``VARIANTS`` are rows of a method with other
  settings (a DPO loss, Dr. GRPO, GSPO; the ``grpo`` row is DAPO, TRL's default loss).

Per method: held-out exact match after training, mean +- std over seeds; its change from the SFT
start and its difference to the continued-SFT baseline, each paired by seed and held-out problem
with a 95% bootstrap interval over seeds and problems (``tools.seeds.paired_bootstrap``) and
marked significant when the interval excludes 0; preference accuracy on held-out pairs
(rewards/accuracies, or the reward model's accuracy), mean +- std; the online methods' training
reward (mean of the first and of the last three logged steps); wall time per run. KTO's exact
match is on its held-out desirable examples (the problems it shares with the other side are
paired). Written to results/<--record>.json (``tools.results.record``; rendered into the README by
``python -m tools.results``) and printed.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # python tools/preference_table.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import ToolError, exit_status, results as readme, seeds as S  # noqa: E402

# Rows that are a method with other settings: (experiment, its options).
VARIANTS = {
    "dpo_discopop": ("dpo", ["--algo.loss-type", "discopop"]),
    "dr_grpo": ("grpo", ["--algo.loss-type", "dr_grpo"]),
    "gspo": ("grpo", ["--algo.importance-sampling-level", "sequence"]),
}
METHODS = ("sft", "dpo_lr0", "dpo", "dpo_discopop", "simpo", "cpo", "orpo", "kto", "reward", "grpo",
           "dr_grpo", "gspo", "rloo", "ppo", "online_dpo")
BASELINE = "sft"
CONTROL = "dpo_lr0"
# The baseline: more SFT steps on the demonstrations, with the preference runs' schedule.
SFT_CONTINUED = ["--optim.learning-rate", "1e-4", "--optim.warmup-steps", "10",
                 "--optim.min-lr-ratio", "0.1", "--optim.weight-decay", "0", "--eval.every", "50"]
LABELS = {"sft": "sft continued (baseline)", "dpo_lr0": "dpo, learning rate 0 (control)",
          "dpo_discopop": "dpo, loss discopop", "grpo": "grpo (loss dapo, TRL's default: DAPO)",
          "dr_grpo": "grpo, loss dr_grpo (Dr. GRPO)",
          "gspo": "grpo, sequence-level ratio (GSPO)"}


def method_command(method: str, steps: int | None) -> tuple[str, list[str]]:
    """(experiment, its arguments) of a row."""
    if method == BASELINE:
        return "sft", [*SFT_CONTINUED, "--steps", str(steps or _preference_steps())]
    if method == CONTROL:
        return "dpo", ["--optim.learning-rate", "0", *(["--steps", str(steps)] if steps else [])]
    name, options = VARIANTS.get(method, (method, []))
    return name, [*options, *(["--steps", str(steps)] if steps else [])]


def _preference_steps() -> int:
    """Steps of the built-in preference recipe (DPO's), which the baseline continues SFT for."""
    from nnx_posttrain import api

    return int(api.defaults("dpo").steps)


def _train_reward(run_dir: Path):
    """Online methods: (mean reward of the first 3 logged steps, of the last 3), or None."""
    rewards = [r["reward"] for r in S.train_rows(run_dir) if "reward" in r]
    if not rewards:
        return None
    return sum(rewards[:3]) / len(rewards[:3]), sum(rewards[-3:]) / len(rewards[-3:])


def collect(out: Path, methods, n_seeds: int) -> dict:
    """The raw numbers of every finished run of a table: {method: {seed: {...}}}."""
    raw = {}
    for method in methods:
        raw[method] = {}
        for s in range(n_seeds):
            run_dir = out / f"seed{s}" / method
            ev = S.evals(run_dir)
            first, last = ev[0], ev[-1]
            pref = last.get("rewards/accuracies", last.get("accuracy"))
            row = {"pref_accuracy": pref, "train_reward": _train_reward(run_dir),
                   "seconds": _seconds(run_dir)}
            if "exact_match" in last:
                row.update(em_before=first["exact_match"], em_after=last["exact_match"],
                           before=S.per_problem(run_dir, first["step"]),
                           after=S.per_problem(run_dir, last["step"]))
            raw[method][s] = row
    return raw


def _seconds(run_dir: Path) -> float | None:
    import json

    marker = run_dir / "finished.json"
    return json.loads(marker.read_text())["seconds"] if marker.exists() else None


def summarise(raw: dict, n_seeds: int, reps: int = 10_000) -> tuple[list[str], list[list[str]], dict]:
    """Table columns, rows and the statistics (for results/*.json) from ``collect``'s numbers."""
    columns = ["method", "exact match after (mean ± std)", "change from the SFT start [95% CI]",
               "vs continued SFT [95% CI]", "significant vs continued SFT",
               "preference accuracy (held-out pairs)", "train reward first -> last", "wall time / run"]
    rows, stats = [], {}
    base = raw.get(BASELINE)
    for method, per_seed in raw.items():
        seeds = [per_seed[s] for s in range(n_seeds)]
        st = {"seeds": n_seeds}
        cells = [LABELS.get(method, method)]
        if "em_after" in seeds[0]:
            st["em_after"] = [r["em_after"] for r in seeds]
            st["em_before"] = [r["em_before"] for r in seeds]
            m, sd = S.mean_std(st["em_after"])
            st["change"] = S.paired_bootstrap([(r["after"], r["before"]) for r in seeds], reps)
            cells += [S.pm(m, sd), S.ci(st["change"])]
            if base is not None and method != BASELINE and "after" in base[0]:
                st["vs_baseline"] = S.paired_bootstrap(
                    [(r["after"], base[s]["after"]) for s, r in enumerate(seeds)], reps)
                cells += [S.ci(st["vs_baseline"]),
                          "yes" if st["vs_baseline"]["significant"] else "no"]
            else:
                cells += ["(baseline)" if method == BASELINE else "n/a", ""]
        else:
            cells += ["n/a (scores answers)", "n/a", "n/a", ""]
        prefs = [r["pref_accuracy"] for r in seeds]
        if all(p is not None for p in prefs):
            st["pref_accuracy"] = prefs
            cells.append(S.pm(*S.mean_std(prefs)))
        else:
            cells.append("n/a")
        rewards = [r["train_reward"] for r in seeds]
        if all(r is not None for r in rewards):
            st["train_reward"] = rewards
            cells.append(f"{sum(r[0] for r in rewards) / n_seeds:.2f} -> "
                         f"{sum(r[1] for r in rewards) / n_seeds:.2f}")
        else:
            cells.append("n/a")
        secs = [r["seconds"] for r in seeds if r["seconds"] is not None]
        st["seconds"] = secs
        cells.append(f"{sum(secs) / len(secs):.0f} s" if secs else "n/a")
        rows.append(cells)
        stats[method] = st
    return columns, rows, stats


def _check_control(stats: dict) -> list[str]:
    """The control row must show no effect; say so in the table's notes, loudly if it fails."""
    st = stats.get(CONTROL)
    if not st or "change" not in st:
        return []
    change = st["change"]
    if change["significant"] or abs(change["diff"]) > 1e-9:
        return [f"CONTROL FAILED: {LABELS[CONTROL]} changed exact match by "
                f"{100 * change['diff']:+.2f} points; the comparison machinery is broken."]
    return [f"Control: {LABELS[CONTROL]} changes no answer ({S.ci(change)}), as it must."]


def _reading(stats: dict) -> list[str]:
    """The table in words: which methods differ significantly from continued SFT, and how."""
    better, worse, same = [], [], []
    for method, st in stats.items():
        if method in (BASELINE, CONTROL) or "vs_baseline" not in st:
            continue
        r = st["vs_baseline"]
        label = f"{LABELS.get(method, method)} ({100 * r['diff']:+.1f} points)"
        {"gain": better, "loss": worse, "same": same}[S.direction(r)].append(label)
    out = []
    if better:
        out.append("Significantly better than continued SFT: " + ", ".join(better) + ".")
    if worse:
        out.append("Significantly worse than continued SFT: " + ", ".join(worse) + ".")
    if same:
        out.append("Not distinguishable from continued SFT at this number of seeds: "
                   + ", ".join(same) + ".")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="runs/table")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="steps of the SFT runs (default: experiments.sft's)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps of every method run (default: each experiment's)")
    parser.add_argument("--record", default="method_table",
                        help="results/<name>.json to write ('none': only print)")
    parser.add_argument("--reps", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (wall times then include the contention)")
    parser.add_argument("extra", nargs="*", help="overrides passed to every method, after --")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        raise ToolError("--seeds must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ToolError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    out = Path(args.out)
    sft_args = ["--steps", str(args.sft_steps)] if args.sft_steps else []

    def start_dir(s):  # the SFT run every method of seed s starts from
        return out / f"seed{s}" / "sft_start"

    def method_run(s, method):
        name, margs = method_command(method, args.steps)
        S.run_experiment(name, out / f"seed{s}" / method,
                         ["--seed", str(s), "--init-from", str(start_dir(s)), *margs, *args.extra])

    # The SFT starts, then every (seed, method) run as one job: with --jobs > 1 no core idles
    # while another seed finishes; a failed run cancels the ones not started.
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda s: S.run_experiment("sft", start_dir(s), ["--seed", str(s), *sft_args]),
                      range(args.seeds)))
        list(pool.map(lambda run: method_run(*run),
                      [(s, m) for m in methods for s in range(args.seeds)]))
    raw = collect(out, methods, args.seeds)
    columns, rows, stats = summarise(raw, args.seeds, args.reps)
    notes = _reading(stats) + _check_control(stats) + [
        f"{args.seeds} seeds (0 .. {args.seeds - 1}); each method starts from the SFT run of its "
        "seed. Intervals: 95% paired bootstrap over seeds and held-out problems "
        f"({args.reps} resamples); significant = the interval excludes 0. Wall time per run "
        + ("with one run at a time." if args.jobs <= 1 else f"with {args.jobs} runs at a time."),
    ]
    command = "python -m tools.preference_table " + " ".join(argv if argv is not None else sys.argv[1:])
    table = readme.render({"name": args.record, "command": command.strip(), "commit": "",
                           "date": "", "machine": "", "columns": columns, "rows": rows,
                           "notes": notes})
    print(table)
    if args.record != "none":
        path = readme.record(args.record, command.strip(), columns, rows, notes,
                             data={"stats": stats, "methods": methods, "seeds": args.seeds})
        print(f"written {path}; render it into the README with python -m tools.results")
    return stats


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
