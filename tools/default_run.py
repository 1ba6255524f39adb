"""The README's default-run table: ``python -m experiments.sft`` (the first command a user runs) over
seeds, and under a rounding-level perturbation, with the spread a fresh clone should land in.

    python -m tools.default_run                 # 5 seeds + the perturbation at each: the README's table
    python -m tools.default_run --seeds 2 --record none

Each run is its own process under ``--out`` (runs/default_run/seed<s>[_perturbed]; a finished run
with the same command is reused). The perturbation (``--perturb``, default ``--logprob-chunk 2``:
log-probs over chunks of 2 positions, which changes only the floating-point rounding of the loss
and its gradient) must not move the result: a recipe whose outcome rounding decides is on a cliff
of its learning curve, and its numbers cannot be reproduced on another machine.

Recorded in results/<--record>.json (``tools.results.record``): per eval step the eval loss and
exact match, mean +- std over seeds, each seed's final exact match, the perturbation's effect,
wall times, and ``data["range"]``: the interval of final exact match a run of the recipe is
expected in (every measured run, seeds and perturbed, widened by ``--margin``). The README states
it and ``tests/test_default_run.py`` checks a fresh run against it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import ToolError, exit_status, results as readme, seeds as S  # noqa: E402


def _finals(runs: dict) -> dict[int, float]:
    return {s: ev[-1]["exact_match"] for s, ev in runs.items()}


def carry_split(run_dir: Path) -> dict | None:
    """Final exact match on the held-out problems without and with a carry (the built-in task's
    two halves: the teacher is right on the first), and the carry-free share; None when the
    run's held-out prompts are not the built-in task's."""
    from nnx_posttrain import chat
    from nnx_posttrain.tasks import arithmetic

    correct = S.per_problem(run_dir)
    kinds = {}
    for a, b in arithmetic.problems("eval"):
        segs = chat.render([{"role": "user", "content": arithmetic.question(a, b)}], "gemma",
                           add_generation_prompt=True)
        kinds[S.prompt_key(segs)] = arithmetic.carries(a, b)
    if not set(correct) <= set(kinds):
        return None
    free = [c for k, c in correct.items() if not kinds[k]]
    carry = [c for k, c in correct.items() if kinds[k]]
    return {"carry_free": sum(free) / len(free), "carry": sum(carry) / len(carry),
            "carry_free_share": len(free) / len(correct)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 (default 5)")
    parser.add_argument("--perturb", default="--logprob-chunk 2",
                        help="options of the perturbed runs (rounding only)")
    parser.add_argument("--out", default="runs/default_run")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="the stated range: measured min / max widened by this (default 3 points)")
    parser.add_argument("--record", default="default_run",
                        help="results/<name>.json to write ('none': only print)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (wall times then include the contention)")
    parser.add_argument("extra", nargs="*", help="overrides passed to every run, after --")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        raise ToolError("--seeds must be >= 2 (a spread needs two runs)")
    out, perturb = Path(args.out), shlex.split(args.perturb)
    jobs = [(s, tag, extra) for s in range(args.seeds)
            for tag, extra in (("", []), ("_perturbed", perturb))]
    seconds = S.run_all([("sft", out / f"seed{s}{tag}", ["--seed", str(s), *extra, *args.extra])
                         for s, tag, extra in jobs], args.jobs)
    runs = {s: S.evals(out / f"seed{s}") for s in range(args.seeds)}
    perturbed = {s: S.evals(out / f"seed{s}_perturbed") for s in range(args.seeds)}
    steps = [r["step"] for r in runs[0]]
    final, final_p = _finals(runs), _finals(perturbed)
    deltas = {s: final_p[s] - final[s] for s in final}
    split = {s: carry_split(out / f"seed{s}") for s in range(args.seeds)}
    m, sd = S.mean_std(final.values())
    mp, sdp = S.mean_std(final_p.values())
    every = list(final.values()) + list(final_p.values())
    lo, hi = max(0.0, min(every) - args.margin), min(1.0, max(every) + args.margin)

    def row(name, runs_, key, fmt):
        cells = [name]
        for i in range(len(steps)):
            mean, std = S.mean_std(ev[i][key] for ev in runs_.values())
            cells.append(fmt(mean, std))
        return cells

    loss_fmt = lambda mean, std: f"{mean:.3f} ± {std:.3f}"  # noqa: E731
    columns = ["held-out split (500 problems never seen in training)", *[f"step {s}" for s in steps]]
    rows = [row("eval loss, nats / answer token (correct answers)", runs, "loss", loss_fmt),
            row("exact match (greedy answer == sum)", runs, "exact_match", S.pm),
            row(f"exact match, perturbed ({args.perturb})", perturbed, "exact_match", S.pm)]
    per_seed = ", ".join(f"{100 * v:.1f}%" for v in final.values())
    per_seed_p = ", ".join(f"{100 * v:.1f}%" for v in final_p.values())
    notes = [
        f"Mean ± sample std over seeds 0-{args.seeds - 1}. Final exact match per seed: {per_seed}; "
        f"perturbed: {per_seed_p}; perturbed - plain, mean {100 * sum(deltas.values()) / len(deltas):+.1f} "
        f"points, largest |difference| {100 * max(abs(d) for d in deltas.values()):.1f} points.",
        f"Expected range of a run's final exact match: {100 * lo:.1f}% - {100 * hi:.1f}% (every "
        f"run above, widened by {100 * args.margin:.0f} points; checked by tests/test_default_run.py).",
        *([f"The plateau: {100 * split[0]['carry_free_share']:.1f}% of the held-out problems have no "
           "carry (the teacher is always right on them); at the end the runs answer "
           f"{S.pm(*S.mean_std(v['carry_free'] for v in split.values()))} of those and "
           f"{S.pm(*S.mean_std(v['carry'] for v in split.values()))} of the problems with a carry."]
          if all(split.values()) else []),
        f"Wall time per run {min(seconds):.0f}-{max(seconds):.0f} s (model build, data, "
        "compilation, training, every evaluation; "
        + ("one run at a time)." if args.jobs == 1 else f"{args.jobs} runs at a time)."),
    ]
    data = {"carry_split": split, "final": final, "final_perturbed": final_p, "mean": m, "std": sd,
            "mean_perturbed": mp, "std_perturbed": sdp, "deltas": deltas, "range": [lo, hi],
            "perturb": args.perturb, "seconds": seconds,
            "curves": {s: [[r["step"], r["loss"], r["exact_match"]] for r in ev]
                       for s, ev in runs.items()}}
    command = "python -m tools.default_run " + " ".join(argv if argv is not None else sys.argv[1:])
    print(readme.render({"name": args.record, "command": command.strip(), "commit": "", "date": "",
                         "machine": "", "columns": columns, "rows": rows, "notes": notes}))
    if args.record != "none":
        path = readme.record(args.record, command.strip(), columns, rows, notes, data=data)
        print(f"written {path}; render it into the README with python -m tools.results")
    return data


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
