"""Distillation's memory at a real vocabulary: a gemma_2b-shaped teacher (256,000 tokens) and a
small student with the same tokenizer, both vocabulary projections in chunks of positions (the
default) against both models' logits materialised at once (``--logprob-chunk 0``).

    python -m tools.bench.distill_memory --record distill_memory          # ~6 GB preset, minutes
    python -m tools.bench.distill_memory --teacher-scale 0.02 --student-scale 0.01   # the path, small

Builds the two presets with ``tools.make_preset`` (reused when they exist: the same ``--like``
gives the same tokenizer at any scale), writes prompt/completion records whose completions fill
``--max-length`` (the loss's positions are the completion tokens: the projections' size is
batch x completion x vocabulary), and runs ``python -m experiments.distill --model STUDENT
--algo.teacher TEACHER --algo.lmbda 0`` (the dataset's completions: the step alone, no sampling)
once per ``--chunks`` value, each in its own process, reporting its peak resident memory (polled,
``tools.bench.smoke_real.run_one``) and seconds per step. ``--record NAME`` writes
``results/NAME.json`` for the docs (``python -m tools.results``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from tools import ToolError, exit_status
from tools.bench.smoke_real import ROOT, WORDS, run_one


def write_records(path: Path, n: int, words: int, seed: int = 0) -> Path:
    """``n`` prompt/completion records of plain English, completions of ``words`` words."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            completion = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"prompt": f"Question {i}: tell me a story.",
                                "completion": " " + completion.capitalize() + "."}) + "\n")
    return path


def preset(like: str, scale: float, work: Path) -> tuple[Path, int | None]:
    """The ``like``-shaped preset at ``scale`` under ``work`` (built when missing) and its
    parameter count (None when reused)."""
    from tools import make_preset

    out = work / f"preset_{like}_{scale:g}"
    if (out / "config.json").exists():
        return out, None
    return out, make_preset.build(like, out, scale).parameters


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", default="gemma_2b")
    parser.add_argument("--teacher-scale", type=float, default=1.0)
    parser.add_argument("--student-scale", type=float, default=0.05)
    parser.add_argument("--work", default="runs/distill_memory")
    parser.add_argument("--chunks", default="default,0",
                        help="--logprob-chunk values, comma-separated ('default': the rule's)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--record", default=None, help="write results/NAME.json")
    args = parser.parse_args(argv)
    work = Path(args.work) if Path(args.work).is_absolute() else ROOT / args.work
    teacher, teacher_params = preset(args.like, args.teacher_scale, work)
    student, student_params = preset(args.like, args.student_scale, work)
    data = write_records(work / "data" / "sft.jsonl", 4 * args.batch_size, args.max_length)
    base = ["-m", "experiments.distill", "--model", str(student), "--data", str(data),
            "--algo.teacher", str(teacher), "--algo.lmbda", "0", "--steps", str(args.steps),
            "--log-every", "1", "--batching.batch-size", str(args.batch_size),
            "--batching.grad-accum", "1", "--batching.max-length", str(args.max_length),
            "--checkpoint.every", "0"]
    results = []
    for chunk in args.chunks.split(","):
        run_dir = work / f"run_chunk_{chunk}"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv_ = base + ([] if chunk == "default" else ["--logprob-chunk", chunk])
        try:
            r = run_one(argv_, run_dir, "float32")
        except ToolError as exc:  # refused (the memory check) or killed: what it said
            said = [line for line in str(exc).splitlines() if line.startswith("error:")]
            r = {"refused": (said or [str(exc).splitlines()[0]])[0][:400],
                 "command": " ".join(["python", *argv_])}
        r.update(chunk=chunk)
        results.append(r)
        print(f"--logprob-chunk {chunk}: " + (r["refused"] if "refused" in r else
              f"peak RSS {r['peak_rss_bytes'] / 1e9:6.2f} GB  {r['seconds_per_step']:7.1f} "
              f"s/step  loss {r['loss']}  compiled step {r['compiled_step_gib']} GiB"), flush=True)
    if args.record:
        record(args, results, teacher_params, student_params)
    return results


def record(args, results: list[dict], teacher_params, student_params) -> None:
    from tools import results as readme

    def size(n):
        return f" ({n / 1e9:.2f} B parameters)" if n else ""

    def cells(r):
        if "refused" in r:
            return ["refused before its first step: " + r["refused"], "", "", ""]
        return [f"{r['compiled_step_gib']:.2f}" if r.get("compiled_step_gib") else "n/a",
                f"{r['peak_rss_bytes'] / 1e9:.2f}", f"{r['seconds_per_step']:.1f}",
                f"{r['loss']:.4f}"]

    rows = [["chunks of positions (default)" if r["chunk"] == "default" else
             "both logits at once (--logprob-chunk 0)" if r["chunk"] == "0" else
             f"--logprob-chunk {r['chunk']}", *cells(r)] for r in results]
    logits = args.batch_size * args.max_length * 256_000 * 4 / 1e9
    readme.record(
        args.record, "python -m tools.bench.distill_memory " + (
            f"--record {args.record}" if args.teacher_scale == 1 else
            f"--teacher-scale {args.teacher_scale:g} --student-scale {args.student_scale:g}"),
        ["vocabulary projections", "compiled step GiB (XLA, beyond its inputs)", "peak RSS GB",
         "s/step", "loss (step 1)"], rows,
        notes=[f"Teacher: a {args.like}-shaped preset{size(teacher_params)} held in bfloat16; "
               f"student: the same shape at scale {args.student_scale:g}{size(student_params)}, "
               f"float32, full fine-tuning; the same synthetic tokenizer (256,000 tokens). "
               f"{args.steps} steps of {args.batch_size} records of {args.max_length} tokens "
               "(completions fill them), --algo.lmbda 0 (no sampling), each run in its own "
               "process, peak resident memory polled; compiled step: what XLA's memory analysis "
               "of the compiled step adds to its inputs (temporaries, outputs), checked against "
               "the memory available before the first step runs. One model's float32 logits "
               f"for such a batch: {logits:.2f} GB. E.g. " + results[0]["command"]],
        data={"results": results, "teacher_parameters": teacher_params,
              "student_parameters": student_params, "like": args.like,
              "teacher_scale": args.teacher_scale, "student_scale": args.student_scale})


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
