"""Switch algorithm with one word: ``python -m experiments ALGORITHM [options]``.

    python -m experiments simpo --steps 100        # same as python -m experiments.simpo --steps 100
    python -m experiments dpo --help
"""

import importlib
import sys

from nnx_posttrain import experiment

NAMES = ("sft", "dpo", "simpo", "cpo", "orpo", "kto", "reward", "grpo", "rloo", "ppo",
         "online_dpo")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in NAMES:
        given = f"unknown algorithm {argv[0]!r}; " if argv and not argv[0].startswith("-") else ""
        raise SystemExit(f"usage: python -m experiments ALGORITHM [options]\n{given}"
                         f"ALGORITHM is one of: {', '.join(NAMES)}")
    module = importlib.import_module(f"experiments.{argv[0]}")
    return experiment.main(argv[0], module.ALGORITHM, module.DEFAULT, module.__doc__, args=argv[1:])


if __name__ == "__main__":
    main()
