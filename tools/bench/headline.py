"""The README's headline command on a real-size preset, as a user runs it: start-up cold, then
warm from the compile cache, the step after each checkpoint save, and the device's peak memory.

    python -m tools.bench.headline --like gemma_2b --out runs/headline        # a TPU VM, minutes
    python -m tools.bench.headline --like gemma_2b --scale 0.02 --out DIR     # the same path, small

Builds a LIKE-shaped preset with random weights (``tools.make_preset``; reused when
``WORK/preset_LIKE`` exists) and smoke_real's preference pairs, then runs ``python -m
experiments.simpo --model PRESET --data pairs.jsonl --lora.rank 8`` (the user-data defaults; only
``--steps``, ``--log-every`` (1 unless given) and ``--checkpoint.every`` set) twice, each in its own process, over
one new compile cache: 'cold' (the cache empty), then 'warm' (another run directory beside the
first: a run's cache is its directory's parent's, so a second run of the same shapes reads its
step back). Writes ``OUT/headline_LIKE.json``: per run the load seconds, the first step's seconds
(tracing, compiling and running it: ``compile_seconds``), each later log's seconds per step (its
tokens over its ``tokens_per_second``: with ``--log-every 1`` each log covers one step), the
windows after a checkpoint save against the median of the others and each save's cost in steps,
and the peak memory the run reported.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import ToolError, exit_status
from tools.bench.smoke_real import ROOT, write_data


def step_seconds(records: list[dict]) -> dict[int, float]:
    """{step: seconds per step} of the train records after the first (which compiles): the
    tokens its log added over the throughput logged with it, per step of its window (with
    ``--log-every 1`` each log covers one step)."""
    train = [r for r in records if r.get("split") == "train"]
    out = {}
    for before, r in zip(train, train[1:]):
        tokens = r.get("num_tokens", 0) - before.get("num_tokens", 0)
        if r.get("tokens_per_second") and tokens > 0:
            out[r["step"]] = tokens / r["tokens_per_second"] / (r["step"] - before["step"])
    return out


def after_saves(seconds: dict[int, float], every: int) -> dict:
    """The logs whose window follows a checkpoint save (a save at step k * every, the window's
    steps from k * every + 1; with one step a log, the step right after the save) against the
    median of the other windows: their seconds per step, their ratios, and each save's cost
    beyond those windows' steps at the median pace (``save_cost_steps``: in steps)."""
    logged = sorted(seconds)
    starts = dict(zip(logged, [1, *logged]))  # each window's first step - 1
    after = {s: seconds[s] for s in logged if every and s > 1 and any(
        k % every == 0 for k in range(max(starts[s], 1), s))}
    others = [t for s, t in seconds.items() if s not in after]
    median = statistics.median(others) if others else float("nan")
    return {"median_s": median, "after_save_s": after,
            "after_save_ratio": {s: t / median for s, t in after.items()},
            "save_cost_steps": {s: (t - median) * (s - starts[s]) / median
                                for s, t in after.items()}}
def run_once(argv: list[str], run_dir: Path, log: Path) -> dict:
    """One run of the headline command in its own process; what it printed and logged."""
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run([sys.executable, *argv, "--run-dir", str(run_dir)], cwd=ROOT,
                              stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    if code != 0:
        raise ToolError(f"{' '.join(argv)} failed ({code}); its output: {log}\n{text[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("split") == "train")
    loaded = re.search(r"loaded \S+ in ([\d.]+) s", text)
    peak = re.search(r"peak memory ([\d.]+) GiB \(([^)]+)\)", text)
    return {"wall_s": time.perf_counter() - start,
            "load_s": float(loaded.group(1)) if loaded else None,
            "first_step_s": first.get("compile_seconds"),
            "step_s": step_seconds(records),
            "tokens_per_step": first.get("num_tokens"),
            "peak_gib": float(peak.group(1)) if peak else None,
            "peak_where": peak.group(2) if peak else None,
            "losses": [r["loss"] for r in records if r.get("split") == "train"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", default="gemma_2b")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", required=True, help="the logs and the JSON go here")
    parser.add_argument("--work", default=None,
                        help="the preset, data and run directories (default: --out)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--log-every", type=int, default=1,
                        help="1: each step's seconds; the default run's 10: a save's cost over "
                             "a window's steps, the loop running ahead of the device as a "
                             "user's run does (take --save-every a multiple of it)")
    parser.add_argument("--cold-only", action="store_true", help="no second (warm) run")
    parser.add_argument("--extra", default="", help="more flags for both runs, space-separated")
    parser.add_argument("--timeline", action="store_true",
                        help="time the loop's pieces per step (tools.bench.loop_timeline): "
                             "OUT/timeline_LIKE_WHEN.json")
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    work = Path(args.work).absolute() if args.work else out
    out.mkdir(parents=True, exist_ok=True)
    preset = work / f"preset_{args.like}"
    if not (preset / "config.json").exists():  # in its own process: this one leaves the
        subprocess.run([sys.executable, "-m", "tools.make_preset", "--like", args.like,  # chip
                        "--out", str(preset), "--scale", str(args.scale)], cwd=ROOT, check=True)
    pairs, _ = write_data(work / "data")
    argv = ["-m", "experiments.simpo", "--model", str(preset), "--data", str(pairs),
            "--lora.rank", "8", "--steps", str(args.steps), "--log-every", str(args.log_every),
            "--checkpoint.every", str(args.save_every), *args.extra.split()]
    runs = work / f"runs_{args.like}_{time.strftime('%H%M%S')}"  # a new cache: runs/.compile_cache
    result = {"like": args.like, "scale": args.scale,
              "command": " ".join(["python", *argv]), "save_every": args.save_every}
    for when in ("cold",) if args.cold_only else ("cold", "warm"):
        timeline = out / f"timeline_{args.like}_{when}.json"
        r = run_once(["-m", "tools.bench.loop_timeline", "--out", str(timeline), "--", "simpo",
                      *argv[2:]] if args.timeline else argv,
                     runs / when, out / f"headline_{args.like}_{when}.log")
        r.update(after_saves(r["step_s"], args.save_every))
        result[when] = r
        print(f"{args.like} {when}: load {r['load_s']} s, first step {r['first_step_s']:.1f} s, "
              f"median step {r['median_s']:.3f} s, after saves {r['after_save_ratio']} (cost in "
              f"steps {r['save_cost_steps']}), peak "
              f"{r['peak_gib']} GiB ({r['peak_where']})", flush=True)
        (out / f"headline_{args.like}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
