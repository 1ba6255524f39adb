"""Switch algorithm with one word: ``python -m experiments ALGORITHM [options]`` (installed as the
console script ``nnx-posttrain ALGORITHM [options]``).

    python -m experiments simpo --steps 100        # same as python -m experiments.simpo --steps 100
    nnx-posttrain dpo --config configs/llama3.2_1b_dpo.yaml
    python -m experiments dpo --help
"""

import importlib
import os
import sys

from nnx_posttrain import algorithms, experiment


def usage(prog: str = "python -m experiments") -> str:
    width = max(map(len, algorithms.names()))
    lines = [f"  {name:<{width}}  {algorithms.registry.summary(algorithms.get(name))}"
             for name in algorithms.names()]
    return (f"usage: {prog} ALGORITHM [options]   ({prog} ALGORITHM --help lists the options; "
            "--config FILE.yaml sets them from a file)\n\nALGORITHM is one of:\n"
            + "\n".join(lines))


def main(argv=None, prog: str = "python -m experiments"):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage(prog))
        return None
    if not argv or argv[0] not in algorithms.names():
        given = f"unknown algorithm {argv[0]!r}\n" if argv and not argv[0].startswith("-") else ""
        raise SystemExit(given + usage(prog))
    module = importlib.import_module(f"experiments.{argv[0]}")
    return experiment.main(argv[0], module.ALGORITHM, module.DEFAULT, module.__doc__, args=argv[1:],
                           builtin=module.BUILTIN, prog=f"{prog} {argv[0]}")


def console():
    """The ``nnx-posttrain`` console script."""
    main(prog=os.path.basename(sys.argv[0]) or "nnx-posttrain")


if __name__ == "__main__":
    main()
