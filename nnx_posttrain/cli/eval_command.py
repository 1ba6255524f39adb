"""``nnx-posttrain eval RUN_DIR --tasks T1,T2 [--limit N] [--step S]``: a run's checkpoint through
lm-evaluation-harness, on this package's own forward and sampler (``nnx_posttrain.harness``).

    nnx-posttrain eval runs/sft --tasks nnx_arithmetic
    nnx-posttrain eval runs/dpo --tasks my_task --include-path tasks/ --limit 100

Prints lm-eval's table and writes its result JSON to RUN_DIR/lm_eval/step_<S>.json
(``nnx-posttrain compare`` shows it beside the training metrics).
"""

from __future__ import annotations

import argparse


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task, group or tag names; nnx_arithmetic: "
                             "the built-in task's held-out problems")
    parser.add_argument("--limit", type=float, default=None,
                        help="examples per task at most (a fraction below 1)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--include-path", default=None, help="a folder of your task YAML files")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--no-chat-template", action="store_true",
                        help="prompts as the task writes them (default: in the run's chat "
                             "template, as it was trained)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.limit is not None and args.limit <= 0):
        parser.error("need --batch-size >= 1 and --limit > 0")
    from nnx_posttrain.harness import evaluate

    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    how = evaluate.Evaluation(limit=limit, step=args.step, include_path=args.include_path,
                              batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                              apply_chat_template=not args.no_chat_template)
    results = evaluate.evaluate(args.run_dir,
                                [t.strip() for t in args.tasks.split(",") if t.strip()], how)
    from lm_eval.utils import make_table  # installed: evaluate checked it

    print(make_table(results))
    print(f"written {results['path']}")
    return 0
