"""The README's headline command (and DPO / GRPO) on a real-size model, offline.

    python -m tools.bench.smoke_real --like gemma_2b                 # ~15 GB, minutes: not in CI
    python -m tools.bench.smoke_real --like gemma_2b --scale 0.02    # the same path, small (a test)

Builds a preset of the real dimensions with random weights (``tools.make_preset``; reused when
``--preset DIR`` exists), writes a small preference file and a prompt file of ordinary English,
and runs, each in its own process, for ``--steps`` steps:

- ``simpo``: ``python -m experiments.simpo --model PRESET --data pairs.jsonl --lora.rank 8``
  (the README's headline command, the user-data defaults) with ``--steps N`` and a short
  sequence and batch so that a CPU finishes;
- ``dpo``: the same with DPO (the reference is the LoRA-off base model: no second copy);
- ``grpo``: prompts, the built-in ``length`` reward, 2 completions per prompt;

under each ``--dtypes`` value (``DTYPE+int8`` adds ``--quantize int8``). Reported per run: seconds per step after the first (which
compiles), the first step's seconds, the model's loading seconds, the peak resident memory of the
process, and the size of the last checkpoint. ``--record NAME`` writes ``results/NAME.json`` for
the README (``python -m tools.results``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from tools import ToolError, exit_status

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the a model learns from data and answers questions about science history music art "
         "code small large quickly slowly because when which river city book garden").split()


def write_data(directory: Path, n: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """pairs.jsonl (prompt, chosen, rejected) and prompts.jsonl (prompt) of plain sentences."""
    rng = random.Random(seed)

    def sentence(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."

    directory.mkdir(parents=True, exist_ok=True)
    pairs, prompts = directory / "pairs.jsonl", directory / "prompts.jsonl"
    with pairs.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Question {i}: {sentence(6, 14)}",
                                "chosen": " " + sentence(6, 16),
                                "rejected": " " + sentence(6, 16)}) + "\n")
    with prompts.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Question {i}: {sentence(6, 14)}"}) + "\n")
    return pairs, prompts


def commands(preset: str, pairs: Path, prompts: Path, steps: int, max_length: int,
             completion: int, defaults: bool = False) -> dict[str, list[str]]:
    """Each method's command; ``defaults``: the user-data batch and length (only the steps
    shortened), else 2 examples of at most ``max_length`` tokens."""
    short = ["--steps", str(steps), "--log-every", "1"] + ([] if defaults else [
        "--batching.batch-size", "2", "--batching.grad-accum", "1",
        "--batching.max-length", str(max_length)])
    headline = ["--model", preset, "--data", str(pairs), "--lora.rank", "8"]
    return {
        "simpo": ["-m", "experiments.simpo", *headline, *short],
        "dpo": ["-m", "experiments.dpo", *headline, *short],
        "grpo": ["-m", "experiments.grpo", "--model", preset, "--data", str(prompts),
                 "--lora.rank", "8", "--algo.rewards", "length", "--algo.num-generations", "2",
                 "--algo.max-completion-length", str(completion), *short],
    }


def run_one(argv: list[str], run_dir: Path, dtype: str) -> dict:
    """Run one experiment process; its peak RSS (polled), timings and checkpoint size."""
    import psutil

    dtype, _, quantize = dtype.partition("+")  # 'auto+int8': --dtype auto --quantize int8
    extra = ["--quantize", quantize] if quantize else []
    cmd = [sys.executable, *argv, "--dtype", dtype, *extra, "--run-dir", str(run_dir)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ps, peak, arrivals, seen = psutil.Process(proc.pid), 0, {}, 0
    out = []
    import threading

    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss + sum(c.memory_info().rss
                                                          for c in ps.children(recursive=True)))
        except psutil.Error:
            pass
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            for line in lines[seen:]:
                record = json.loads(line)
                if record.get("split") == "train":
                    arrivals[record["step"]] = time.perf_counter()
            seen = len(lines)
        time.sleep(0.1)
    reader.join(timeout=5)
    text = "".join(out)
    if proc.returncode != 0:
        raise ToolError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    steps = sorted(arrivals)
    per_step = ((arrivals[steps[-1]] - arrivals[steps[0]]) / (len(steps) - 1)
                if len(steps) > 1 else float("nan"))
    loaded = re.search(r"loaded \S+ in ([\d.]+) s", text)
    compiled = re.search(r"compiled step: ([\d.,]+) GiB per device", text)
    flops = re.search(r"([\d.]+e[+-]?\d+) FLOPs per device", text)
    estimate = re.search(r"estimated peak: ([\d.,]+) GiB", text)
    train = [json.loads(l) for l in metrics.read_text().splitlines()]
    first = next((r for r in train if r.get("split") == "train"), {})
    ckpts = sorted((p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()),
                   key=lambda p: int(p.name))
    size = sum(p.stat().st_size for p in ckpts[-1].rglob("*") if p.is_file()) if ckpts else 0
    return {"seconds_per_step": per_step, "first_step_seconds": first.get("compile_seconds"),
            "load_seconds": float(loaded.group(1)) if loaded else None,
            "peak_rss_bytes": peak, "checkpoint_bytes": size,
            "wall_seconds": time.perf_counter() - start, "loss": first.get("loss"),
            "losses": [r["loss"] for r in train if r.get("split") == "train"],
            "compiled_step_gib": float(compiled.group(1).replace(",", "")) if compiled else None,
            "step_flops": float(flops.group(1)) if flops else None,
            "estimated_peak_bytes": (float(estimate.group(1).replace(",", "")) * 2**30
                                     if estimate else None),
            "command": " ".join(["python", *argv, "--dtype", dtype, *extra])}


DEFAULTS_BATCH = "16 pairs in 4 micro-batches, <= 1024 tokens (defaults)"


def bound_percent(result: dict, peak_gflops: float | None) -> str:
    """The step's FLOPs (XLA's count of the compiled step) at this machine's best matmul
    throughput, as a % of the measured seconds per step: how close to the matmul bound it runs."""
    flops, seconds = result.get("step_flops"), result.get("seconds_per_step")
    if not (flops and seconds and peak_gflops) or seconds != seconds:
        return "n/a"
    return f"{100 * flops / (peak_gflops * 1e9) / seconds:.0f}%"


def estimated(result: dict) -> str:
    """The run's own estimate of its peak, GB, and its error against the measured peak."""
    guess, peak = result.get("estimated_peak_bytes"), result.get("peak_rss_bytes")
    if not guess or not peak:
        return "n/a"
    return f"{guess / 1e9:.2f} ({100 * (guess - peak) / peak:+.0f}%)"


def record(name: str, like: str, scale: float, steps: int, max_length: int, results: list[dict],
           params: int | None = None, peak: dict | None = None) -> None:
    """results/NAME.json for the README (``python -m tools.results``)."""
    from tools import results as readme

    size = f"{params / 1e9:.2f} B parameters, " if params else ""
    best = (peak or {}).get("peak_gflops")
    rows = [[r["method"], r.get("batch", f"2 pairs, <= {max_length} tokens"), r["dtype"],
             f"{r['seconds_per_step']:.2f}", bound_percent(r, best),
             f"{r['first_step_seconds']:.1f}", f"{r['load_seconds']:.1f}",
             f"{r['peak_rss_bytes'] / 1e9:.2f}", estimated(r), f"{r['checkpoint_bytes'] / 1e6:.1f}",
             ", ".join(f"{x:.4f}" for x in r.get("losses", [])) or "n/a"]
            for r in results]
    readme.record(
        name, f"python -m tools.bench.smoke_real --like {like}" + (f" --scale {scale:g}" if scale != 1 else ""),
        ["method", "batch", "--dtype", "s/step", "of the matmul bound", "first step s", "load s",
         "peak RSS GB", "estimated peak GB", "checkpoint MB", "loss per step"],
        rows,
        notes=[f"A {like}-shaped KerasHub preset with random weights ({size}bfloat16, written by "
               f"`python -m tools.make_preset --like {like}`), LoRA rank 8, {steps} steps, each run "
               "in its own process, one at a time, on a machine shared with other jobs; 'defaults': "
               "the headline command as a user runs it (the user-data batch of 16 pairs in 4 "
               "micro-batches, sequences up to 1,024 tokens: these pairs are ~40 tokens), only the "
               f"steps shortened; else 2 examples of at most {max_length} tokens. s/step: mean "
               "after the first step (which compiles: 'first step s'); of the matmul bound: the "
               "step's FLOPs (XLA's count of the compiled step, remat's recomputation included) at "
               "this machine's best float32 matmul throughput "
               + (f"({best:.0f} GFLOP/s, the better of two measures, before and after the runs) "
                  if best else "")
               + "over the measured s/step; peak RSS: the process's resident memory, polled; "
               "estimated peak: what the run printed before its first step (the memory it held "
               "then plus XLA's figures for the compiled step), and its error against the peak; "
               "checkpoint: the last checkpoint (LoRA factors and their AdamW state). E.g. "
               + (results[0]["command"] if results else "")],
        data={"results": results, "like": like, "scale": scale, "parameters": params,
              "matmul_peak": peak})


def rerecord(name: str) -> None:
    """Rewrite results/NAME.json's table from its own raw data (after a change of layout)."""
    from tools import results as readme

    saved = readme.load(name)
    d = saved["data"]
    notes = saved["notes"][0]
    steps = int(notes.split(" steps of")[0].split()[-1]) if " steps of" in notes else 2
    max_length = int(notes.split("at most ")[1].split()[0]) if "at most " in notes else 64
    record(name, d["like"], d["scale"], steps, max_length, d["results"], d.get("parameters"),
           d.get("matmul_peak"))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", default="gemma_2b")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--preset", default=None, help="preset directory (built if missing)")
    parser.add_argument("--work", default="runs/smoke_real", help="data and run directories")
    parser.add_argument("--dtypes", default="float32,bfloat16,bfloat16-params")
    parser.add_argument("--methods", default="simpo,dpo,grpo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--record", default=None, help="write results/NAME.json")
    parser.add_argument("--update", action="store_true",
                        help="with --record: keep the record's other rows, replace those run again")
    parser.add_argument("--min-free-gb", type=float, default=0.0,
                        help="before each run, stop unless this much memory is available")
    parser.add_argument("--parameters", type=int, default=None,
                        help="the preset's parameter count, for the record (when --preset exists)")
    parser.add_argument("--runs", default=None,
                        help="only these METHOD:DTYPE[:defaults] runs, comma-separated (default: "
                             "all; ':defaults': the user-data batch and length, see commands)")
    args = parser.parse_args(argv)
    from tools import make_preset

    work = (ROOT / args.work) if not Path(args.work).is_absolute() else Path(args.work)
    preset = Path(args.preset) if args.preset else work / f"preset_{args.like}_{args.scale:g}"
    if not (preset / "config.json").exists():
        built = make_preset.build(args.like, preset, args.scale)
        params = built.parameters
    else:
        params = args.parameters
    pairs, prompts = write_data(work / "data")
    cmds = {defaults: commands(str(preset), pairs, prompts, args.steps, args.max_length,
                               args.completion_length, defaults) for defaults in (False, True)}
    results = []
    wanted = [(x.split(":") + [""])[:3] for x in args.runs.split(",")] if args.runs else [
        (m, d, "") for d in args.dtypes.split(",") for m in args.methods.split(",")]
    peak = matmul_peak(preset)
    print(f"matmul peak {peak['peak_gflops']:.1f} GFLOP/s {peak['matmul_gflops']}", flush=True)
    import psutil

    for method, dtype, defaults in wanted:
        free = psutil.virtual_memory().available / 2**30
        if free < args.min_free_gb:
            print(f"stopping before {method} {dtype}: {free:.1f} GiB available, "
                  f"--min-free-gb {args.min_free_gb}", flush=True)
            break
        run_dir = work / f"{method}_{dtype}{'_defaults' if defaults else ''}"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        r = run_one(cmds[bool(defaults)][method], run_dir, dtype)
        r.update(method=method, dtype=dtype, batch=(DEFAULTS_BATCH if defaults else
                                                    f"2 pairs, <= {args.max_length} tokens"))
        results.append(r)
        print(f"{method:6s} {dtype:16s} {r['batch']} {r['seconds_per_step']:8.2f} s/step "
              f"({bound_percent(r, peak['peak_gflops'])} of the matmul bound)  first step "
              f"{r['first_step_seconds'] or float('nan'):7.1f} s  load {r['load_seconds']} s  "
              f"peak RSS {r['peak_rss_bytes'] / 1e9:6.2f} GB  checkpoint "
              f"{r['checkpoint_bytes'] / 1e6:8.1f} MB", flush=True)
    # measured again after the runs (a shared machine's throughput varies): the best of the two
    after = matmul_peak(preset)
    print(f"matmul peak after the runs {after['peak_gflops']:.1f} GFLOP/s", flush=True)
    peak = max(peak, after, key=lambda p: p["peak_gflops"]) | {
        "measured_gflops": [peak["peak_gflops"], after["peak_gflops"]]}
    if args.record:
        rows = updated(args.record, results) if args.update else results
        record(args.record, args.like, args.scale, args.steps, args.max_length, rows, params,
               peak)
    return results


def updated(name: str, results: list[dict]) -> list[dict]:
    """results/NAME.json's rows with those of ``results`` (same method, dtype and batch) replaced,
    in the record's order; new rows after them."""
    from tools import results as readme

    def key(r):
        return r["method"], r["dtype"], r.get("batch")

    fresh = {key(r): r for r in results}
    old = readme.load(name)["data"]["results"]
    return [fresh.pop(key(r), r) for r in old] + list(fresh.values())


def matmul_peak(preset: Path) -> dict:
    """This machine's best float32 matmul throughput on the preset's own projection shapes
    (``tools.bench.ours.matmul_peak``, in a fresh process like the runs)."""
    config = json.loads((preset / "config.json").read_text())["config"]
    spec = {"batch": 4, "seq": 64, "hidden_dim": config["hidden_dim"],
            "intermediate_dim": config["intermediate_dim"], "vocab": 2048}
    code = ("import json, sys; from tools.bench.ours import matmul_peak; "
            f"print(json.dumps(matmul_peak({spec!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode != 0:
        raise ToolError(f"measuring the matmul peak failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
