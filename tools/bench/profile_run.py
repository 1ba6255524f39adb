"""Where a real run's training step spends its time, by XLA operation.

    python -m tools.bench.profile_run simpo --model DIR --data pairs.jsonl --lora.rank 8 \\
        --quantize int8 --steps 3 --batching.batch-size 2 --batching.grad-accum 1 \\
        --batching.max-length 64 --run-dir /tmp/profiled

runs the experiment in this process, parsed as the command parses it (a user's-data run: the
algorithm's own defaults), with ``jax.profiler`` tracing its steps, and prints the XLA
operations' time per step by kind of operation, by model component (forward / backward) and by
operation, all blocks together (``tools.bench.profile_breakdown``). The first step's execution is
counted with the others; only the step program's own operations are (not its compilation). ``--json FILE`` also writes
the breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tools import ToolError, exit_status


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algorithm")
    parser.add_argument("--json", default=None, help="also write the breakdown here")
    parser.add_argument("--record", default=None,
                        help="write results/NAME.json (the README's tables: python -m tools.results)")
    args, rest = parser.parse_known_args(argv)
    if "jax" in sys.modules:
        raise ToolError("run it in a fresh process (python -m tools.bench.profile_run): XLA's "
                        "flags are read when JAX starts")
    # XLA:CPU records each operation in the profiler's trace only when asked
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_enable_xprof_traceme=true").strip()
    import nnx_posttrain  # noqa: F401  (the Keras backend first)
    import jax

    from nnx_posttrain import api, errors, train
    from nnx_posttrain.cli import train_command
    from nnx_posttrain.train import loop
    from tools.bench import profile_breakdown

    made = []
    original = loop.compile_step

    def keeping(run):  # the run's compiled step, for its HLO's operation names
        made.append(original(run))
        return made[-1]

    loop.compile_step = keeping
    try:
        cfg = train_command.parse(api.defaults(args.algorithm, data="own data"), rest)
        with tempfile.TemporaryDirectory() as trace_dir:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # the loop's Python calls would crowd XLA's out
            with train.prepare(cfg, api.build(cfg)) as run, \
                    jax.profiler.trace(trace_dir, profiler_options=options):
                result = train.train(run)
            steps = result.step - (run.start_step or 0)
            if not made or made[0].compiled is None or steps < 1:
                raise ToolError("no training step ran: nothing to profile")
            out = profile_breakdown.breakdown(trace_dir, made[0].compiled.as_text(), steps,
                                              program_only=True)
    except errors.UserError as exc:
        raise ToolError(str(exc)) from None
    finally:
        loop.compile_step = original
    profile_breakdown.print_breakdown(out)
    if args.record:
        record(args.record, " ".join(["python -m tools.bench.profile_run", *(argv or sys.argv[1:])]),
               out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def record(name: str, command_line: str, out: dict) -> None:
    """results/NAME.json: the step's operation time by kind and by model component."""
    from tools import results

    total = out["ops_ms_per_step"]
    rows = [[kind, f"{ms / 1000:.2f}", f"{100 * ms / total:.1f}%"]
            for kind, ms in list(out["by_kind_ms"].items())[:8]]
    rows += [[f"component: {c}", f"{ms / 1000:.2f}", f"{100 * ms / total:.1f}%"]
             for c, ms in out["by_component_ms"].items() if ms >= 0.005 * total]
    results.record(name, command_line, ["XLA operations (kind, or model component)",
                                        "s per step", "share"], rows,
                   notes=[f"{total / 1000:.2f} s of XLA operations per step (summed over the "
                          "threads that run them), from a jax.profiler trace of the run's steps "
                          "(the step program's own operations). ynn_fusion: XNNPACK / YNNPACK "
                          "kernels (the matmuls); convert_*: dtype conversions (int8 weights to "
                          "float); copy_*: layout copies."],
                   data=out)


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
