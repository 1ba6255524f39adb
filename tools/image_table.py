"""The image table: the built-in image task (``--data builtin:shapes``, count the coloured shapes in
a picture drawn in code; ``nnx_posttrain.tasks.shapes``) learnt by the tiny vision model
``gemma3_vision_tiny``, SFT then GRPO, over seeds, with confidence intervals.

    python -m tools.image_table --seeds 3                       # docs/results.md's table
    python -m tools.image_table --seeds 1 --sft-steps 4 --grpo-steps 2 --record none  # a check

For each seed s, each run its own process under ``--out`` (a finished run with the same command
is reused, so a stopped table resumes):

- ``sft``: ``python -m experiments.sft --config nnx_posttrain/tasks/recipes/shapes/sft.yaml
  --seed s`` from the untrained model (its step-0 evaluation is the *untrained* row);
- ``grpo``: ``python -m experiments.grpo --config .../shapes/grpo.yaml --seed s --init-from``
  that SFT run, rewarded by ``exact_match`` (its step-0 evaluation is the SFT weights again);
- ``sft_more``: the control, SFT continued from that SFT run on as many training pictures as
  GRPO samples prompts for, with GRPO's optimizer settings.

Rows: held-out exact match (the 200 held-out pictures; the greedy answer equals the count) of
the untrained model, of SFT, of GRPO and of the continued SFT, mean ± std over seeds; SFT against
the untrained model, GRPO and the continued SFT against SFT (and, in the notes, GRPO against the
continued SFT), each paired by seed and held-out problem with a 95% bootstrap interval
(``tools.seeds.paired_bootstrap``); GRPO's sampled reward (first and last three logged steps).
A note gives the answer that needs no picture: the most frequent training count, and how often
it is right on the held-out problems; another splits each row's held-out exact match between the
problems where the task's sloppy teacher may slip (``shapes.confused``: asked for green shapes,
a blue one drawn) and the others. ``--record`` writes results/<name>.json (rendered into
docs/results.md by ``python -m tools.results``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

if __package__ in (None, ""):  # python tools/image_table.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import ToolError, exit_status, preference_table as P, results as readme, seeds as S  # noqa: E402

RECIPES = "nnx_posttrain/tasks/recipes/shapes"
# (row, run, evaluation of that run: its first or its last)
ROWS = (("untrained", "sft", "before"), ("sft", "sft", "after"), ("grpo", "grpo", "after"),
        ("sft_more", "sft_more", "after"))
LABELS = {"untrained": "untrained model (random weights)", "sft": "SFT from it",
          "grpo": "GRPO from the SFT run (exact-match reward)",
          "sft_more": "SFT continued instead (as many pictures as GRPO's prompts; control)"}
VERSUS = {"sft": "untrained", "grpo": "sft", "sft_more": "sft"}  # each row's comparison
SHORT = {"sft": "SFT", "grpo": "GRPO", "sft_more": "the continued SFT"}


def jobs(out: Path, seed: int, sft_steps: int | None, grpo_steps: int | None) -> list[tuple]:
    """[(experiment, run dir, arguments)] of one seed: the SFT run, GRPO from it, and the
    control (SFT continued from it)."""
    where = out / f"seed{seed}"
    sft = ["--config", f"{RECIPES}/sft.yaml", "--seed", str(seed)]
    if sft_steps:
        sft += ["--steps", str(sft_steps), "--eval.every", str(sft_steps)]
    grpo = ["--config", f"{RECIPES}/grpo.yaml", "--seed", str(seed),
            "--init-from", str(where / "sft")]
    if grpo_steps:
        grpo += ["--steps", str(grpo_steps), "--eval.every", str(grpo_steps)]
    return [("sft", where / "sft", sft), ("grpo", where / "grpo", grpo),
            ("sft", where / "sft_more", continued_sft(where / "sft", seed, grpo_steps))]


def continued_sft(start: Path, seed: int, grpo_steps: int | None) -> list[str]:
    """The control: SFT from the SFT run on as many training pictures as GRPO's run samples
    prompts for, with GRPO's optimizer (its learning rate, warmup and schedule)."""
    from nnx_posttrain import config_files

    grpo = config_files.read(S.ROOT / RECIPES / "grpo.yaml")
    sft = config_files.read(S.ROOT / RECIPES / "sft.yaml")
    prompts = grpo["batching"]["batch_size"] // grpo["algo"]["num_generations"]
    steps = -(-(grpo_steps or grpo["steps"]) * prompts // sft["batching"]["batch_size"])
    optim = grpo["optim"]
    return ["--config", f"{RECIPES}/sft.yaml", "--seed", str(seed), "--init-from", str(start),
            "--steps", str(steps), "--eval.every", str(steps),
            "--optim.learning-rate", str(optim["learning_rate"]),
            "--optim.warmup-steps", str(optim["warmup_steps"]),
            "--optim.min-lr-ratio", str(optim["min_lr_ratio"])]


def side(raw: dict, row: str, seed: int) -> dict:
    """{held-out key: 0/1} of a row at one seed (``preference_table.collect``'s numbers)."""
    _, run, when = next(r for r in ROWS if r[0] == row)
    return raw[run][seed][when]


def summarise(raw: dict, n_seeds: int, reps: int = 10_000) -> tuple[list, list, dict]:
    """Table columns, rows and statistics from ``preference_table.collect``'s numbers of the
    ``sft``, ``grpo`` and ``sft_more`` runs."""
    columns = ["row", "held-out exact match (mean ± std)", "change [95% CI]", "against",
               "significant", "sampled reward (first → last)"]
    rows, stats = [], {}
    for name, run, when in ROWS:
        seeds = [raw[run][s] for s in range(n_seeds)]
        st = {"em": [r[f"em_{when}"] for r in seeds]}
        cells = [LABELS[name], S.pm(*S.mean_std(st["em"]))]
        if name in VERSUS:
            st["change"] = S.paired_bootstrap(
                [(side(raw, name, s), side(raw, VERSUS[name], s)) for s in range(n_seeds)], reps)
            cells += [S.ci(st["change"]), LABELS[VERSUS[name]],
                      "yes" if st["change"]["significant"] else "no"]
        else:
            cells += ["", "", ""]
        reward = [r["train_reward"] for r in seeds] if name == "grpo" else []
        if reward and all(r is not None for r in reward):
            st["train_reward"] = reward
            cells.append(" → ".join(f"{sum(r[i] for r in reward) / n_seeds:.2f}" for i in (0, 1)))
        else:
            cells.append("")
        rows.append(cells)
        stats[name] = st
    stats["grpo_vs_sft_more"] = S.paired_bootstrap(  # GRPO against the control
        [(side(raw, "grpo", s), side(raw, "sft_more", s)) for s in range(n_seeds)], reps)
    return columns, rows, stats


def blind_answer() -> dict:
    """The answer that needs no picture: the most frequent count of the training problems, and
    the share of held-out problems it answers."""
    from nnx_posttrain.tasks import shapes

    counts = collections.Counter(shapes.problem(i)[2] for i in range(shapes.SIZES["train"]))
    answer = counts.most_common(1)[0][0]
    held_out = [record["answer"] for record in shapes.records("prompt_only", "eval")]
    right = sum(a == str(answer) for a in held_out)
    return {"answer": answer, "exact_match": right / len(held_out)}


def teacher_split(raw: dict, n_seeds: int) -> dict | None:
    """Held-out exact match of the SFT, GRPO and continued SFT rows, per seed, on the problems
    where the sloppy teacher may slip (``shapes.confused``) and on the others, and the confused
    share; None when the runs' held-out problems are not the task's 200 (exact_match.jsonl
    lists them in the held-out records' order)."""
    from nnx_posttrain.tasks import shapes

    confused = [shapes.confused(i) for i in shapes.indices("eval")]
    split = {"confused_share": sum(confused) / len(confused), "slip_rate": shapes.SLIP_RATE}
    for name in VERSUS:
        split[name] = {"confused": [], "other": []}
        for s in range(n_seeds):
            correct = list(side(raw, name, s).values())
            if len(correct) != len(confused):
                return None
            for part, wanted in (("confused", True), ("other", False)):
                hits = [c for c, f in zip(correct, confused) if f == wanted]
                split[name][part].append(sum(hits) / len(hits))
    return split


def reading(stats: dict, blind: dict) -> list[str]:
    """The table in words."""
    def verdict(change):
        return {"gain": "a significant gain", "loss": "a significant loss",
                "same": "inside the noise"}[S.direction(change)]

    out = [f"{LABELS[name]} against {LABELS[VERSUS[name]]}: {S.ci(stats[name]['change'])} "
           f"points, {verdict(stats[name]['change'])}." for name in VERSUS]
    change = stats["grpo_vs_sft_more"]
    out.append(f"GRPO against the continued SFT: {S.ci(change)} points, {verdict(change)}.")
    out.append(f"Without looking at the picture: always answering {blind['answer']} (the most "
               f"frequent training count) gets {S.pct(blind['exact_match'])} of the held-out "
               "problems.")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    parser.add_argument("--out", default="runs/image_table")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="SFT steps (default: the recipe's, shapes/sft.yaml)")
    parser.add_argument("--grpo-steps", type=int, default=None,
                        help="GRPO steps (default: the recipe's, shapes/grpo.yaml)")
    parser.add_argument("--reps", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--record", default="image_table",
                        help="results/<name>.json to write ('none': only print)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        raise ToolError("--seeds must be >= 1")
    out = Path(args.out).resolve()
    runs = [jobs(out, seed, args.sft_steps, args.grpo_steps) for seed in range(args.seeds)]
    for stage in range(3):  # one run at a time: every SFT start, then GRPO, then the control
        for seed_runs in runs:
            S.run_experiment(*seed_runs[stage])
    raw = P.collect(out, ["sft", "grpo", "sft_more"], args.seeds)
    columns, rows, stats = summarise(raw, args.seeds, args.reps)
    blind = blind_answer()
    split = teacher_split(raw, args.seeds)
    seconds = {run: [raw[run][s]["seconds"] for s in range(args.seeds)] for run in raw}
    notes = reading(stats, blind) + ([
        f"The teacher's mistake: {100 * split['confused_share']:.1f}% of the held-out problems "
        "ask for green shapes in a picture holding a blue one, where the SFT data's teacher counts "
        f"both colours {100 * split['slip_rate']:.0f}% of the time (tasks/shapes.py); on those "
        + ", ".join(f"{SHORT[n]} {S.pm(*S.mean_std(split[n]['confused']))}" for n in VERSUS)
        + "; on the others "
        + ", ".join(f"{SHORT[n]} {S.pm(*S.mean_std(split[n]['other']))}" for n in VERSUS)
        + "."] if split else []) + [
        f"{args.seeds} seeds (0 .. {args.seeds - 1}); model gemma3_vision_tiny (gemma_tiny's text, "
        "a 2-layer vision encoder of 16 x 16 pictures: 4 image tokens, one a quarter), the "
        f"vision tower trained too; settings {RECIPES}/sft.yaml and grpo.yaml"
        + (f" with SFT {args.sft_steps} steps" if args.sft_steps else "")
        + (f", GRPO {args.grpo_steps} steps" if args.grpo_steps else "") + ". The untrained "
        "row is the SFT run's step-0 evaluation. Intervals: 95% paired bootstrap over seeds and "
        f"held-out problems ({args.reps} resamples). Wall time per run, one at a time: "
        + ", ".join(f"{run} {sum(v) / len(v):.0f} s" for run, v in seconds.items()
                    if all(x is not None for x in v)) + "."]
    command_line = "python -m tools.image_table " + " ".join(
        argv if argv is not None else sys.argv[1:])
    readme.publish(args.record, command_line.strip(), columns, rows, notes,
                   data={"stats": stats, "seeds": args.seeds, "blind": blind, "seconds": seconds,
                         "teacher_split": split})
    return stats


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
