"""The distillation table: what a teacher (the method table's online RL run) passes to a student
on the built-in task, by each way of distilling, over seeds, with confidence intervals.

    python -m tools.distill_table --seeds 3 --jobs 2                 # docs/results.md's table
    python -m tools.distill_table --seeds 1 --steps 10 --student-steps 20 --record none  # a check

For each seed s, as ``tools.preference_table`` does: the default SFT run (``sft_start``), and
from it the teacher, ``python -m experiments.grpo`` (TRL's default loss, 95% held-out exact
match in the method table). Then two students:

- (a) the SFT start itself (``--init-from sft_start``, the preference methods' schedule);
- (b) a smaller fresh model, ``gemma_tiny_half`` (2 layers against the teacher's 4, the same
  width and tokenizer), trained from scratch with the SFT recipe's schedule.

and for each, the rows:

- ``sft``: SFT on the demonstrations (continued for (a), from scratch for (b)): the baseline;
- ``seq_kd``: SFT on the teacher's greedy answers to the same prompts (sequence-level KD, Kim &
  Rush 2016): the answers are generated once per seed and written as a data file;
- ``kd``: ``experiments.distill --algo.lmbda 0``: the teacher's token distributions on the
  demonstrations (supervised KD); ``kd_forward``: the same with ``--algo.beta 0`` (forward KL,
  the classic soft-label KD of Hinton et al.);
- ``gkd``: ``--algo.lmbda 0.5``: half the batches on the student's own samples (GKD's mix);
- ``on_policy``: ``--algo.lmbda 1``: the student's samples only (TRL's DistillationTrainer).

Distillation rows use the loss' TRL defaults (beta 1: reverse KL, temperature 1) but
``kd_forward``. Per row:
held-out exact match after training (mean +- std over seeds), its change from the student's
start and its difference to the SFT baseline with 95% paired bootstrap intervals over seeds and
held-out problems (``tools.seeds.paired_bootstrap``), the share of the teacher's gain over the
student's start that it recovers, and its wall time per run. Runs live under ``--out`` (a
finished run with the same command is reused); ``--record`` writes results/<name>.json
(rendered into docs/results.md by ``python -m tools.results``).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # python tools/distill_table.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import exit_status, preference_table as P, results as readme, seeds as S  # noqa: E402

TEACHER = "grpo"
SMALL = "gemma_tiny_half"
# The built-in recipe's settings, passed explicitly where a run reads a data file instead.
BUILTIN_SFT = ["--remat", "none", "--batching.batch-size", "32", "--batching.grad-accum", "1",
               "--batching.max-length", "24", "--eval.exact-match", "500",
               "--eval.max-new-tokens", "8", "--eval-data", "builtin"]
# Student (b): from scratch, the SFT recipe's optimizer (nnx_posttrain/tasks/recipes/sft.yaml).
FRESH = ["--model", SMALL, "--init-from", "", "--optim.learning-rate", "1e-3",
         "--optim.warmup-steps", "30", "--optim.min-lr-ratio", "0.1", "--optim.weight-decay", "1.0"]
LMBDA = {"kd": "0", "kd_forward": "0", "gkd": "0.5", "on_policy": "1"}
BETA = {"kd_forward": "0"}  # the others: TRL's default, 1 (reverse KL)
ROWS = ("sft", "seq_kd", "kd", "kd_forward", "gkd", "on_policy")
LABELS = {"sft": "SFT on the demonstrations (baseline)",
          "seq_kd": "SFT on the teacher's greedy answers (sequence-level KD)",
          "kd": "supervised KD (lmbda 0)", "kd_forward": "supervised KD, forward KL (beta 0)",
          "gkd": "GKD mix (lmbda 0.5)",
          "on_policy": "on-policy distillation (lmbda 1)"}
STUDENTS = {"a": "the SFT start", "b": f"a fresh {SMALL}"}


def row_command(row: str, student: str, answers: Path, teacher: Path, start: Path,
                steps: int) -> tuple[str, list[str]]:
    """(experiment, its arguments) of one row for student ``student`` ('a' or 'b')."""
    who = ["--init-from", str(start)] if student == "a" else FRESH
    schedule = P.SFT_CONTINUED if student == "a" else []
    common = [*who, *schedule, "--steps", str(steps), "--eval.every", "0"]
    if row == "sft":
        return "sft", common
    if row == "seq_kd":
        return "sft", ["--data", str(answers), *BUILTIN_SFT, *common]
    beta = ["--algo.beta", BETA[row]] if row in BETA else []
    return "distill", ["--algo.teacher", str(teacher), "--algo.lmbda", LMBDA[row], *beta, *common]


def teacher_answers(teacher: Path, out: Path) -> Path:
    """The teacher's greedy answers to the demonstrations' prompts, as SFT records (the same
    prompts, as often as the demonstrations hold them): sequence-level KD's data."""
    if out.exists():
        return out
    from nnx_posttrain.cli.sample import answers
    from nnx_posttrain.tasks import arithmetic

    problems = arithmetic.demonstrations()
    unique = sorted(set(problems))
    texts = answers(teacher, [arithmetic.question(a, b) for a, b in unique], max_new_tokens=8)
    answer = {p: t[0].strip() for p, t in zip(unique, texts)}
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for a, b in problems:
            f.write(json.dumps({"messages": [
                {"role": "user", "content": arithmetic.question(a, b)},
                {"role": "assistant", "content": answer[(a, b)]}]}) + "\n")
    tmp.rename(out)
    return out


def summarise(raw: dict, teacher: dict, n_seeds: int, reps: int) -> tuple[list, list, dict]:
    """Columns, rows and statistics of the table from ``preference_table.collect``'s numbers."""
    columns = ["student", "row", "exact match after (mean ± std)",
               "change from the student's start [95% CI]", "vs SFT baseline [95% CI]",
               "significant vs baseline", "teacher's gain recovered", "wall time / run"]
    rows, stats = [], {}
    teacher_em = [teacher[s]["em_after"] for s in range(n_seeds)]
    for student, who in STUDENTS.items():
        base = raw[f"{student}_sft"]
        for row in ROWS:
            seeds = [raw[f"{student}_{row}"][s] for s in range(n_seeds)]
            st = {"em_after": [r["em_after"] for r in seeds],
                  "em_before": [r["em_before"] for r in seeds],
                  "change": S.paired_bootstrap([(r["after"], r["before"]) for r in seeds], reps)}
            gains = [(r["em_after"] - r["em_before"]) / (t - r["em_before"])
                     for r, t in zip(seeds, teacher_em) if t > r["em_before"]]
            st["recovered"] = sum(gains) / len(gains) if gains else None
            cells = [who, LABELS[row], S.pm(*S.mean_std(st["em_after"])), S.ci(st["change"])]
            if row == "sft":
                cells += ["(baseline)", ""]
            else:
                st["vs_baseline"] = S.paired_bootstrap(
                    [(r["after"], base[s]["after"]) for s, r in enumerate(seeds)], reps)
                cells += [S.ci(st["vs_baseline"]),
                          "yes" if st["vs_baseline"]["significant"] else "no"]
            secs = [r["seconds"] for r in seeds if r["seconds"] is not None]
            st["seconds"] = secs
            cells += [S.pct(st["recovered"], 0), f"{sum(secs) / len(secs):.0f} s" if secs else "n/a"]
            rows.append(cells)
            stats[f"{student}_{row}"] = st
    stats["teacher"] = {"em_after": teacher_em,
                        "seconds": [teacher[s]["seconds"] for s in range(n_seeds)]}
    return columns, rows, stats


def reading(stats: dict) -> list[str]:
    """The table in words."""
    t = S.mean_std(stats["teacher"]["em_after"])
    out = [f"Teacher ({TEACHER} from the SFT start): {S.pm(*t)} held-out exact match, "
           f"{sum(stats['teacher']['seconds']) / len(stats['teacher']['seconds']):.0f} s per run."]
    for student, who in STUDENTS.items():
        better, worse, same = [], [], []
        for row in ROWS[1:]:
            r = stats[f"{student}_{row}"]["vs_baseline"]
            label = f"{LABELS[row]} ({100 * r['diff']:+.1f} points)"
            (better if r["significant"] and r["diff"] > 0 else
             worse if r["significant"] else same).append(label)
        parts = [f"{kind}: " + ", ".join(rows) for kind, rows in
                 (("better than its SFT baseline", better), ("worse", worse),
                  ("not distinguishable", same)) if rows]
        out.append(f"Student {who}: " + "; ".join(parts) + ".")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="runs/distill_table")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps of student (a)'s rows (default: the preference methods')")
    parser.add_argument("--student-steps", type=int, default=1500,
                        help="steps of student (b)'s rows (default: the SFT recipe's)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10_000)
    parser.add_argument("--record", default="distill_table")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()

    def start(s):
        return out / f"seed{s}" / "sft_start"

    def teacher(s):
        return out / f"seed{s}" / TEACHER

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda s: S.run_experiment("sft", start(s), ["--seed", str(s)]),
                      range(args.seeds)))
        name, options = P.method_command(TEACHER, None)
        list(pool.map(lambda s: S.run_experiment(
            name, teacher(s), ["--seed", str(s), "--init-from", str(start(s)), *options,
                               "--eval.every", "0"]), range(args.seeds)))
        answers = {s: teacher_answers(teacher(s), out / f"seed{s}" / "teacher_answers.jsonl")
                   for s in range(args.seeds)}
        jobs = []
        for student in STUDENTS:
            steps = args.steps if student == "a" else args.student_steps
            for row in ROWS:
                for s in range(args.seeds):
                    exp, argv_ = row_command(row, student, answers[s], teacher(s), start(s), steps)
                    jobs.append((exp, out / f"seed{s}" / f"{student}_{row}",
                                 ["--seed", str(s), *argv_]))
        list(pool.map(lambda job: S.run_experiment(*job), jobs))
    names = [f"{student}_{row}" for student in STUDENTS for row in ROWS]
    raw = P.collect(out, names + [TEACHER], args.seeds)
    columns, rows, stats = summarise(raw, raw[TEACHER], args.seeds, args.reps)
    notes = reading(stats) + [
        f"{args.seeds} seeds (0 .. {args.seeds - 1}); student (a) rows {args.steps} steps at the "
        f"preference methods' schedule, student (b) rows {args.student_steps} steps at the SFT "
        "recipe's. Intervals: 95% paired bootstrap over seeds and held-out problems "
        f"({args.reps} resamples); teacher's gain recovered: (after - start) / (teacher - start), "
        "mean over seeds. Wall time per run "
        + ("with one run at a time." if args.jobs <= 1 else f"with {args.jobs} runs at a time.")]
    command = "python -m tools.distill_table " + " ".join(argv if argv is not None else sys.argv[1:])
    readme.publish(args.record, command.strip(), columns, rows, notes,
                   data={"stats": stats, "seeds": args.seeds})
    return stats


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
