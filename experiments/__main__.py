"""Switch algorithm with one word: ``python -m experiments ALGORITHM [options]``.

    python -m experiments simpo --steps 100        # same as python -m experiments.simpo --steps 100
    python -m experiments dpo --help
"""

import importlib
import sys

from nnx_posttrain import algorithms, experiment


def usage() -> str:
    width = max(map(len, algorithms.names()))
    lines = [f"  {name:<{width}}  {algorithms.registry.summary(algorithms.get(name))}"
             for name in algorithms.names()]
    return ("usage: python -m experiments ALGORITHM [options]   (python -m experiments ALGORITHM "
            "--help lists the options)\n\nALGORITHM is one of:\n" + "\n".join(lines))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return None
    if not argv or argv[0] not in algorithms.names():
        given = f"unknown algorithm {argv[0]!r}\n" if argv and not argv[0].startswith("-") else ""
        raise SystemExit(given + usage())
    module = importlib.import_module(f"experiments.{argv[0]}")
    return experiment.main(argv[0], module.ALGORITHM, module.DEFAULT, module.__doc__, args=argv[1:],
                           builtin=module.BUILTIN)


if __name__ == "__main__":
    main()
