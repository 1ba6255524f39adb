"""Switch algorithm with one word: ``python -m experiments ALGORITHM [options]``, the same as the
console script ``nnx-posttrain ALGORITHM [options]``.

    python -m experiments simpo --steps 100        # same as python -m experiments.simpo --steps 100
    python -m experiments dpo --help
"""

import sys

from nnx_posttrain import cli

if __name__ == "__main__":
    raise SystemExit(cli.main(sys.argv[1:], prog="python -m experiments", own_process=True))
