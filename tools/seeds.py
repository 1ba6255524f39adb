"""Runs over seeds and their statistics: what ``tools.default_run`` and ``tools.preference_table``
share.

- ``run_experiment``: one ``python -m experiments.<name>`` process, skipped when its run
  directory already holds a finished run of the same command (tables resume after a stop);
- ``evals`` / ``per_problem``: a run's eval rows (metrics.jsonl) and per-problem exact match
  (exact_match.jsonl, see ``nnx_posttrain.train.evaluation``);
- ``mean_std``: mean and sample standard deviation (n - 1) over seeds;
- ``paired_bootstrap``: the 95% confidence interval of a paired difference of exact match,
  resampling seeds and, within each seed, held-out problems (the same problems for both sides).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tools import ToolError

ROOT = Path(__file__).resolve().parents[1]


def run_experiment(name: str, run_dir: Path, args: list[str], echo=print) -> float:
    """Run ``experiments.<name>`` into ``run_dir`` (unless it finished with the same arguments
    before); returns its wall time in seconds (the recorded one when skipped)."""
    run_dir = Path(run_dir)
    marker = run_dir / "finished.json"
    command = [sys.executable, "-m", f"experiments.{name}", "--run-dir", str(run_dir), *args]
    if marker.exists():
        done = json.loads(marker.read_text())
        if done["command"] == command[1:]:
            echo(f"  {run_dir}: finished before ({done['seconds']:.0f} s), reused")
            return done["seconds"]
    if run_dir.exists():  # an unfinished or different run: start it again from scratch
        import shutil

        shutil.rmtree(run_dir)
    echo(f"  {' '.join(command[1:])}")
    t0 = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise ToolError(f"{' '.join(command[1:])} failed (exit {out.returncode}):\n"
                         f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    marker.write_text(json.dumps({"command": command[1:], "seconds": seconds}) + "\n")
    return seconds


def run_all(jobs: list[tuple[str, Path, list[str]]], parallel: int = 1) -> list[float]:
    """``run_experiment`` for each (name, run_dir, args), ``parallel`` processes at a time;
    their wall times, in order."""
    if parallel <= 1:
        return [run_experiment(*job) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(lambda job: run_experiment(*job), jobs))


def evals(run_dir: Path) -> list[dict]:
    """The eval rows of a run's metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "eval"]


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def per_problem(run_dir: Path, step: int | None = None) -> dict[str, int]:
    """{held-out prompt key: 1 if answered exactly, else 0} at ``step`` (default: the last
    evaluation). The last line of a step wins (a resumed run may have evaluated it twice)."""
    path = Path(run_dir) / "exact_match.jsonl"
    if not path.exists():
        raise ToolError(f"{path} does not exist: per-problem exact match is written by "
                         "the evaluation of runs with exact-match prompts (--eval.exact-match)")
    by_step = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]] = row
    row = by_step[max(by_step) if step is None else step]
    return dict(zip(row["keys"], row["correct"]))


def prompt_key(segments) -> str:
    """The key of a held-out prompt (its rendered segments) in exact_match.jsonl."""
    from nnx_posttrain.train.evaluation import prompt_key as key

    return key("".join(text for text, _ in segments))


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = np.asarray(list(values), dtype=float)
    if values.size == 0:
        return math.nan, math.nan
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def paired_bootstrap(pairs: list[tuple[dict, dict]], reps: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """Difference in exact match between two sides, paired by seed and by held-out problem.

    ``pairs``: one (side A {key: 0/1}, side B {key: 0/1}) per seed; each seed's difference is
    taken over the problems both sides answered. The statistic is the mean over seeds of the
    mean per-problem difference A - B. Its ``level`` interval resamples seeds with replacement
    and, within each drawn seed, its problems with replacement (a hierarchical bootstrap: both
    the run-to-run and the finite-test-set variation). Returns {"diff", "low", "high",
    "significant"} (significant: the interval excludes 0)."""
    diffs = []
    for a, b in pairs:
        keys = sorted(set(a) & set(b))
        if not keys:
            raise ValueError("paired_bootstrap: the two sides share no held-out problem")
        diffs.append(np.array([a[k] - b[k] for k in keys], dtype=float))
    rng = np.random.default_rng(seed)
    n_seeds = len(diffs)
    estimate = float(np.mean([d.mean() for d in diffs]))
    # A resample of a seed's n problems: its mean difference is (n(+1) - n(-1)) / n with the
    # counts of the values +1, 0, -1 multinomial: exactly a resample, without drawing n indices.
    probs = [[np.mean(d == v) for v in (1, 0, -1)] for d in diffs]
    stats = np.zeros(reps)
    for _ in range(n_seeds):  # each slot of a resample: a seed drawn anew, its problems anew
        drawn = rng.integers(0, n_seeds, size=reps)
        for s, d in enumerate(diffs):
            counts = rng.multinomial(d.size, probs[s], size=reps)
            means = (counts[:, 0] - counts[:, 2]) / d.size
            stats += np.where(drawn == s, means, 0.0)
    stats /= n_seeds
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return {"diff": estimate, "low": float(low), "high": float(high),
            "significant": bool(low > 0 or high < 0)}


def direction(change: dict) -> str:
    """"gain", "loss" or "same" for a ``paired_bootstrap`` result: a gain or a loss only where
    its interval excludes 0."""
    if not change["significant"]:
        return "same"
    return "gain" if change["diff"] > 0 else "loss"


def pct(x: float, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def pm(mean: float, std: float, digits: int = 1) -> str:
    """'mean ± std' in percent."""
    if math.isnan(mean):
        return "n/a"
    return f"{100 * mean:.{digits}f} ± {100 * std:.{digits}f}%"


def ci(result: dict, digits: int = 1) -> str:
    """'+d [low, high]' in points."""
    return (f"{100 * result['diff']:+.{digits}f} [{100 * result['low']:+.{digits}f}, "
            f"{100 * result['high']:+.{digits}f}]")
