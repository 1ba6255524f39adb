"""``nnx-posttrain sample RUN_DIR --prompt "..." [...]``: answer prompts with a run's checkpoint.

    nnx-posttrain sample runs/sft --prompt "What is 12 + 30?" --prompt "What is 47 + 38?"
    nnx-posttrain sample runs/sft --prompt "Tell me a story." --temperature 0.8 --top-p 0.95 \\
        --num-samples 4 --seed 1

Each prompt is a user message rendered with the run's chat template and decoded by the compiled
KV-cache sampler (``nnx_posttrain.sampling.sampler``): greedy by default (``--temperature 0``),
else sampled at that temperature, with optional top-k / top-p truncation.
"""

from __future__ import annotations

import argparse

from nnx_posttrain import runs
from nnx_posttrain.sampling import sampler


def answers(run_dir, prompts: list[str], step: int | None = None, **sampling) -> list[list[str]]:
    """The answers of ``run_dir``'s checkpoint ``step`` (default: the latest) to ``prompts``
    (``sampling``: ``sampler.sample_texts``' options)."""
    runs.check_policy(run_dir)  # a reward model: refused before it loads
    run = runs.load(run_dir, step)
    return sampler.sample_texts(run.lm, run.policy(), prompts, sampler.Sampling(**sampling))


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="at least 1")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1, help="answers per prompt")
    args = parser.parse_args(argv)
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1 or args.num_samples < 1 \
            or args.max_new_tokens < 1:
        parser.error("need --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1, --num-samples >= 1, "
                     "--max-new-tokens >= 1")
    out = answers(args.run_dir, args.prompt, args.step, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, num_samples=args.num_samples)
    for prompt, texts in zip(args.prompt, out):
        print(f"> {prompt}")
        for i, text in enumerate(texts):
            print(f"[{i + 1}] {text}" if len(texts) > 1 else text)
        print()
    return 0
