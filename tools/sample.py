"""Answer prompts with a run's checkpoint: ``python -m tools.sample RUN_DIR --prompt "..." [...]``.

    python -m tools.sample runs/sft --prompt "What is 12 + 30?" --prompt "What is 47 + 38?"

Each prompt is a user message rendered with the model family's chat template; answers are greedy
(the compiled decoder used for exact-match evaluation; temperature / top-k / top-p sampling arrives
with the KV-cache sampler).
"""

from __future__ import annotations

import argparse

from nnx_posttrain import generate, runs


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        run = runs.load(args.run_dir, args.step)
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None
    answers = generate.complete_chat(run.lm, run.module, args.prompt, args.max_new_tokens)
    for prompt, answer in zip(args.prompt, answers):
        print(f"> {prompt}\n{answer}\n")
    return answers


if __name__ == "__main__":
    main()
