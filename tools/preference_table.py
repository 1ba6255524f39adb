"""The README's method table: each preference and online RL method from the default SFT run, on
the built-in task.

    python -m tools.preference_table [--methods dpo,simpo,grpo,...] [-- extra overrides]

Runs ``python -m experiments.sft`` (unless runs/sft exists) and then every method as its own
process (``runs/table/<method>``), plus a baseline that simply continues SFT for as many steps, and
prints a Markdown table: preference accuracy on held-out
pairs (rewards/accuracies, or accuracy for the reward model), the online methods' training reward
(mean of the first and of the last logged steps), held-out exact-match accuracy before -> after,
and wall time. The table is also written to runs/table/table.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("sft", "dpo", "simpo", "cpo", "orpo", "kto", "reward", "grpo", "rloo", "ppo",
           "online_dpo")
# The baseline row: 200 more SFT steps on the correct answers, with the preference runs' schedule.
SFT_CONTINUED = ["--steps", "200", "--optim.learning-rate", "1e-4", "--optim.warmup-steps", "10",
                 "--eval.every", "50"]


def _run(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", *args], check=True)
    return time.perf_counter() - t0


def _records(run_dir: Path, split: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def _train_reward(run_dir: Path) -> str:
    """Online methods: mean training reward of the first and of the last 3 logged steps."""
    rewards = [r["reward"] for r in _records(run_dir, "train") if "reward" in r]
    if not rewards:
        return "n/a"
    head, tail = rewards[:3], rewards[-3:]
    return f"{sum(head) / len(head):.2f} -> {sum(tail) / len(tail):.2f}"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="runs/table")
    parser.add_argument("--sft-run", default="runs/sft")
    parser.add_argument("extra", nargs="*", help="overrides passed to every method, after --")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not (Path(args.sft_run) / "checkpoints").exists():
        _run(["experiments.sft", "--run-dir", args.sft_run])
    lines = [
        "| method | preference accuracy (held-out pairs) | train reward (online) | exact match before -> after | wall time |",
        "|---|---|---|---|---|",
    ]
    for method in args.methods.split(","):
        run_dir = out / method
        baseline = SFT_CONTINUED if method == "sft" else []
        seconds = _run([f"experiments.{method}", "--run-dir", str(run_dir), "--init-from",
                        args.sft_run, *baseline, *args.extra])
        evals = _records(run_dir, "eval")
        first, last = evals[0], evals[-1]
        pref = last.get("rewards/accuracies", last.get("accuracy"))
        em = (f"{100 * first['exact_match']:.1f}% -> {100 * last['exact_match']:.1f}%"
              if "exact_match" in last else "n/a (scores answers)")
        name = "sft, 200 more steps (baseline)" if method == "sft" else method
        pref = "n/a" if pref is None else f"{100 * pref:.1f}%"
        lines.append(f"| {name} | {pref} | {_train_reward(run_dir)} | {em} | {seconds:.0f} s |")
    table = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
