"""``nnx-posttrain judge RUN_A RUN_B --prompts FILE [--judge ...]``: the win rate of RUN_A's
answers against RUN_B's on the same prompts, under a judge (``nnx_posttrain.harness.judge``).

    nnx-posttrain judge runs/dpo runs/sft --prompts eval.jsonl                   # exact checker
    nnx-posttrain judge runs/dpo runs/sft --prompts eval.jsonl --judge runs/reward
    nnx-posttrain judge runs/dpo runs/sft --prompts prompts.jsonl --judge my_judges:judge

FILE holds JSON lines with a ``prompt`` (a user message or a conversation) and, for the exact
judge, an ``answer``. Writes RUN_A/judge/<RUN_B's name>.json and RUN_B/judge/<RUN_A's name>.json.
"""

from __future__ import annotations

import argparse


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--prompts", required=True, help="a JSON lines file of prompts")
    parser.add_argument("--judge", default=None,
                        help="exact (default with an 'answer' column), a reward-model run "
                             "directory, or module:name (TRL's pairwise judge signature)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed of both runs")
    parser.add_argument("--examples", type=int, default=5)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("need --max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1")
    from nnx_posttrain.harness import judge

    r = judge.judge_runs(args.run_a, args.run_b, args.prompts, judge.Judging(
        args.judge, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed, examples=args.examples))
    print(f"{args.run_a} vs {args.run_b} ({r['judge']}, {r['n']} prompts): win rate "
          f"{100 * r['win_rate']:.1f}% [95% CI {100 * r['low']:.1f}, {100 * r['high']:.1f}] "
          f"(ties half); {r['wins']} wins, {r['losses']} losses, {r['ties']} ties")
    for e in r["examples"]:
        prompt = e["prompt"] if isinstance(e["prompt"], str) else e["prompt"][-1]["content"]
        print(f"- {prompt[:80]!r}: A {e['a']!r} / B {e['b']!r} -> {e['verdict']}")
    print("written " + ", ".join(r["paths"]))
    return 0
