"""``python -m nnx_posttrain.cli COMMAND [options]``: the console script ``nnx-posttrain``."""

import sys

from nnx_posttrain.cli import main

raise SystemExit(main(sys.argv[1:], prog="nnx-posttrain", own_process=True))
