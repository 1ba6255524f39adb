"""The agentic table: what a tool gives the tiny model on the built-in agentic task (two-digit
multiplication, ``nnx_posttrain.tasks.multiply``), over seeds, with confidence intervals.

    python -m tools.agent_table --seeds 3 --jobs 2                        # docs/results.md's table
    python -m tools.agent_table --seeds 1 --sft-steps 20 --grpo-steps 2 --record none  # a check

For each seed s, on the task's files (written under ``--out``/data) and its model
``gemma_tiny_tools``:

- ``sft_plain``: SFT on the problems answered directly; ``sft_tools``: SFT on demonstrations that
  call ``multiply`` and answer with its result (the ``tools`` column puts its schema in the
  prompt);
- ``grpo_plain``: GRPO from ``sft_plain`` without tools; ``grpo_tools``: GRPO from ``sft_tools``
  with ``--algo.tools nnx_posttrain.tasks.multiply:multiply`` (the same schema in the prompt, the
  tool-calling loop in every rollout and in the held-out evaluation).

Rows: held-out exact match (300 problems; the answer after the tool's result) of each SFT start
(the GRPO run's step-0 evaluation) and of each GRPO run, mean ± std over seeds, the difference to
the direct-answer SFT row with a 95% paired bootstrap interval over seeds and problems
(``tools.seeds.paired_bootstrap``), and for the runs with the tool its call and failure frequency
(TRL's ``tools/call_frequency``: calls per rollout; ``tools/failure_frequency``: failed calls per
call) and for the GRPO runs the rollouts' mean reward (sampled at temperature 1), at the start and
the end of GRPO (the first and last logged steps; the reward: their first and last three). ``--record`` writes results/<name>.json (rendered into
docs/results.md by ``python -m tools.results``).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # python tools/agent_table.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import exit_status, preference_table as P, results as readme, seeds as S  # noqa: E402

MODEL = "gemma_tiny_tools"
TOOL = "nnx_posttrain.tasks.multiply:multiply"
# SFT: the built-in SFT recipe's optimizer (nnx_posttrain/tasks/recipes/sft.yaml)
SFT = ["--model", MODEL, "--remat", "none", "--optim.learning-rate", "1e-3",
       "--optim.warmup-steps", "30", "--optim.min-lr-ratio", "0.1", "--optim.weight-decay", "1.0",
       "--batching.batch-size", "32", "--batching.grad-accum", "1", "--eval.every", "0"]
# GRPO: the built-in GRPO recipe's optimizer (nnx_posttrain/tasks/recipes/grpo.yaml)
GRPO = ["--remat", "none", "--optim.learning-rate", "3e-4", "--optim.warmup-steps", "5",
        "--optim.min-lr-ratio", "0.1", "--batching.batch-size", "64", "--batching.grad-accum", "1",
        "--algo.rewards", "exact_match", "--algo.num-generations", "4",
        "--eval.exact-match", "300", "--log-every", "5"]
LENGTHS = {"plain": ["--batching.max-length", "32", "--algo.max-completion-length", "8"],
           "tools": ["--batching.max-length", "160", "--algo.max-completion-length", "48",
                     "--algo.tools", TOOL, "--algo.max-tool-calling-iterations", "2"]}
ROWS = (("sft_plain", "grpo_plain", "before"), ("grpo_plain", "grpo_plain", "after"),
        ("sft_tools", "grpo_tools", "before"), ("grpo_tools", "grpo_tools", "after"))
LABELS = {"sft_plain": "SFT, answers without the tool (baseline)",
          "grpo_plain": "GRPO without tools, from it",
          "sft_tools": "SFT on demonstrations that call the tool",
          "grpo_tools": "GRPO with the tool, from it"}


def jobs(out: Path, data: dict, seed: int, sft_steps: int, grpo_steps: int) -> list[list]:
    """[(experiment, run dir, arguments)] of one seed: the SFT starts, then the GRPO runs."""
    where = out / f"seed{seed}"
    sft = [("sft", where / f"sft_{kind}",
            ["--seed", str(seed), *SFT, "--data", str(data[f"sft_{kind}"]), "--steps",
             str(sft_steps), "--batching.max-length", "160" if kind == "tools" else "32"])
           for kind in ("plain", "tools")]
    grpo = [("grpo", where / f"grpo_{kind}",
             ["--seed", str(seed), "--model", MODEL, "--init-from", str(where / f"sft_{kind}"),
              "--data", str(data["prompts"]), "--eval-data", str(data["eval"]), *GRPO,
              *LENGTHS[kind], "--steps", str(grpo_steps), "--eval.every", str(grpo_steps)])
            for kind in ("plain", "tools")]
    return [sft, grpo]


def tool_frequencies(run_dir: Path) -> dict:
    """Calls per rollout and failures per call, first and last logged GRPO steps."""
    rows = [r for r in S.train_rows(run_dir) if "tools/call_frequency" in r]
    return {f"{key}_{when}": rows[i][f"tools/{key}_frequency"]
            for key in ("call", "failure") for when, i in (("start", 0), ("end", -1))}


def summarise(raw: dict, out: Path, n_seeds: int, reps: int) -> tuple[list, list, dict]:
    columns = ["row", "held-out exact match (mean ± std)", "vs the baseline [95% CI]",
               "significant", "sampled reward (start → end)",
               "tool calls per rollout (start → end)", "failed calls per call (start → end)"]
    rows, stats = [], {}
    base = [raw["grpo_plain"][s]["before"] for s in range(n_seeds)]
    for name, run, side in ROWS:
        seeds = [raw[run][s] for s in range(n_seeds)]
        st = {"em": [r[f"em_{side}"] for r in seeds]}
        cells = [LABELS[name], S.pm(*S.mean_std(st["em"]))]
        if name == "sft_plain":
            cells += ["(baseline)", ""]
        else:
            st["vs_baseline"] = S.paired_bootstrap(
                [(r[side], b) for r, b in zip(seeds, base)], reps)
            cells += [S.ci(st["vs_baseline"]),
                      "yes" if st["vs_baseline"]["significant"] else "no"]
        if side == "after":  # GRPO: the rollouts' mean reward, first and last 3 logged steps
            st["train_reward"] = [r["train_reward"] for r in seeds]
            cells.append(" → ".join(f"{sum(x[i] for x in st['train_reward']) / n_seeds:.2f}"
                                    for i in (0, 1)))
        else:
            cells.append("")
        if name == "grpo_tools":
            freq = [tool_frequencies(out / f"seed{s}" / run) for s in range(n_seeds)]
            st["tools"] = freq
            mean = {k: sum(f[k] for f in freq) / n_seeds for k in freq[0]}
            cells += [f"{mean['call_start']:.2f} → {mean['call_end']:.2f}",
                      f"{mean['failure_start']:.2f} → {mean['failure_end']:.2f}"]
        else:
            cells += ["", ""]
        rows.append(cells)
        stats[name] = st
    stats["grpo_vs_sft_tools"] = S.paired_bootstrap(  # what GRPO changed in the tool runs
        [(raw["grpo_tools"][s]["after"], raw["grpo_tools"][s]["before"]) for s in range(n_seeds)],
        reps)
    return columns, rows, stats


def reading(stats: dict) -> str:
    """The tool runs' GRPO in words: its change of held-out exact match, of the sampled reward
    and of the failed calls."""
    change, tools = stats["grpo_vs_sft_tools"], stats["grpo_tools"]["tools"]
    reward = stats["grpo_tools"]["train_reward"]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return (f"GRPO with the tool against its SFT start: held-out exact match {S.ci(change)} "
            f"points ({'significant' if change['significant'] else 'not significant'}); the "
            f"sampled rollouts' reward {mean([r[0] for r in reward]):.2f} -> "
            f"{mean([r[1] for r in reward]):.2f}, failed calls per call "
            f"{mean([t['failure_start'] for t in tools]):.2f} -> "
            f"{mean([t['failure_end'] for t in tools]):.2f}.")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="runs/agent_table")
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10_000)
    parser.add_argument("--record", default="agent_table")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    from nnx_posttrain import tasks
    from nnx_posttrain.tasks import multiply

    tasks.register()  # gemma_tiny_tools

    data = multiply.write_files(out / "data")
    stages = [jobs(out, data, s, args.sft_steps, args.grpo_steps) for s in range(args.seeds)]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for stage in range(2):  # the SFT starts, then the GRPO runs from them
            list(pool.map(lambda job: S.run_experiment(*job),
                          [job for seed in stages for job in seed[stage]]))
    raw = P.collect(out, ["grpo_plain", "grpo_tools"], args.seeds)
    columns, rows, stats = summarise(raw, out, args.seeds, args.reps)
    notes = [
        reading(stats),
        f"{args.seeds} seeds (0 .. {args.seeds - 1}); SFT {args.sft_steps} steps, GRPO "
        f"{args.grpo_steps} steps from it; model {MODEL} (gemma_tiny with the task's tokenizer). "
        "An SFT row is its GRPO run's step-0 evaluation (the same weights). Exact match: the "
        "first integer of the last answer equals the product; the tool runs are evaluated "
        "through the tool-calling loop, greedy. Intervals: 95% paired bootstrap over seeds and "
        f"held-out problems ({args.reps} resamples)."]
    command_line = "python -m tools.agent_table " + " ".join(
        argv if argv is not None else sys.argv[1:])
    readme.publish(args.record, command_line.strip(), columns, rows, notes,
                   data={"stats": stats, "seeds": args.seeds})
    return stats


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
