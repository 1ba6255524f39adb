"""Win rates on the built-in task: the method table's best preference-family run (CPO) and best
online run (PPO) against their SFT start, judged by the exact checker and by a reward-model run,
over seeds, with confidence intervals (``nnx-posttrain judge``).

    python -m tools.judge_table --seeds 3 --jobs 2           # docs/results.md's table
    python -m tools.judge_table --seeds 1 --steps 10 --record none              # a check

For each seed s, as ``tools.preference_table``: the default SFT run, and from it ``cpo``,
``ppo`` and ``reward`` (the built-in recipes). Then on the 500 held-out problems, greedy, 8 new
tokens, both judges for each of CPO and PPO against the SFT start. Rows: the win rate (ties
counted half) pooled over seeds with a 95% interval resampling seeds and, within each, problems
(``tools.seeds.paired_bootstrap`` on the verdicts); wins / losses / ties per seed. Notes: where the
reward model disagrees with the checker (pairs the checker decides that the reward model calls the
other way or a tie; pairs the checker calls a tie that the reward model decides). ``--record``
writes results/<name>.json (``python -m tools.results`` renders it into docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # python tools/judge_table.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import exit_status, preference_table as P, results as readme, seeds as S  # noqa: E402

RUNS = ("cpo", "ppo")
LABELS = {"cpo": "CPO (the best preference-family run)", "ppo": "PPO (the best online run)"}


def prompts_file(path: Path) -> Path:
    """The built-in task's held-out problems as a prompts file (prompt, answer)."""
    from nnx_posttrain import data, tasks

    tasks.register()

    src = data.source("builtin", "eval", builtin="prompt_only")
    path.write_text("".join(json.dumps({"prompt": src[i]["prompt"], "answer": src[i]["answer"]})
                            + "\n" for i in range(len(src))))
    return path


def summarise(verdicts: dict, n_seeds: int, reps: int) -> tuple[list, list, dict]:
    """``verdicts[(run, judge)][seed]``: +1 / 0 / -1 per held-out problem."""
    columns = ["run (against its SFT start)", "judge", "win rate, ties half [95% CI]",
               "wins / losses / ties per seed"]
    rows, stats = [], {}
    for run in RUNS:
        for judge in ("exact", "reward"):
            per_seed = [verdicts[(run, judge)][s] for s in range(n_seeds)]
            side = lambda value, v: {str(k): int(x == value) for k, x in enumerate(v)}  # noqa
            boot = S.paired_bootstrap([(side(1, v), side(-1, v)) for v in per_seed], reps)
            rate = {k: 0.5 + boot[k] / 2 for k in ("diff", "low", "high")}
            counts = [(sum(x == 1 for x in v), sum(x == -1 for x in v), sum(x == 0 for x in v))
                      for v in per_seed]
            rows.append([LABELS[run], "exact checker" if judge == "exact" else "reward model",
                         f"{100 * rate['diff']:.1f}% [{100 * rate['low']:.1f}, "
                         f"{100 * rate['high']:.1f}]",
                         ", ".join(f"{w} / {l} / {t}" for w, l, t in counts)])
            stats[f"{run}/{judge}"] = {"win_rate": rate, "counts": counts}
    return columns, rows, stats


def disagreement(verdicts: dict, n_seeds: int) -> list[str]:
    """Where the reward model's verdicts differ from the checker's, in words."""
    out = []
    for run in RUNS:
        decided = against = tie_called = ties = 0
        for s in range(n_seeds):
            for e, r in zip(verdicts[(run, "exact")][s], verdicts[(run, "reward")][s]):
                if e:
                    decided += 1
                    against += r != e
                else:
                    ties += 1
                    tie_called += r != 0
        out.append(f"{run}: the reward model differs from the checker on {against} of the "
                   f"{decided} pairs the checker decides ({100 * against / max(decided, 1):.1f}%) "
                   f"and decides {tie_called} of the {ties} it calls a tie "
                   f"({100 * tie_called / max(ties, 1):.1f}%; both right or both wrong, the "
                   "reward model still prefers one).")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="runs/judge_table")
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default: "
                        "the recipes')")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10_000)
    parser.add_argument("--record", default="judge_table")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    steps = ["--steps", str(args.steps)] if args.steps else []
    start = lambda s: out / f"seed{s}" / "sft_start"  # noqa: E731
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda s: S.run_experiment("sft", start(s), ["--seed", str(s), *steps,
                                                                   "--eval.every", "0"]),
                      range(args.seeds)))
        jobs = []
        for name in (*RUNS, "reward"):
            experiment, options = P.method_command(name, args.steps)
            jobs += [(experiment, out / f"seed{s}" / name,
                      ["--seed", str(s), "--init-from", str(start(s)), *options,
                       "--eval.every", "0"]) for s in range(args.seeds)]
        list(pool.map(lambda job: S.run_experiment(*job), jobs))
    from nnx_posttrain.harness import judge

    prompts = prompts_file(out / "prompts.jsonl")
    verdicts = {}
    for run in RUNS:
        for kind in ("exact", "reward"):
            verdicts[(run, kind)] = {}
            for s in range(args.seeds):
                spec = "exact" if kind == "exact" else str(out / f"seed{s}" / "reward")
                result = judge.judge_runs(out / f"seed{s}" / run, start(s), prompts,
                                          judge.Judging(spec, max_new_tokens=8, reps=200),
                                          echo=lambda _: None)
                verdicts[(run, kind)][s] = result["verdicts"]
    columns, rows, stats = summarise(verdicts, args.seeds, args.reps)
    notes = disagreement(verdicts, args.seeds) + [
        f"{args.seeds} seeds (0 .. {args.seeds - 1}); every run the built-in recipe's"
        + (f" at {args.steps} steps" if args.steps else "") + "; the reward model of the same "
        "seed; 500 held-out problems, greedy, 8 new tokens (nnx-posttrain judge). Intervals: 95% "
        f"bootstrap over seeds and problems ({args.reps} resamples)."]
    line = "python -m tools.judge_table " + " ".join(argv if argv is not None else sys.argv[1:])
    readme.publish(args.record, line.strip(), columns, rows, notes,
                   data={"stats": stats, "seeds": args.seeds})
    return stats


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
