"""``nnx-posttrain compare RUN_DIR [RUN_DIR ...] [--metrics loss,exact_match] [--out DIR]``:
final and best eval metrics per run, the settings that differ, one PNG per metric
(``nnx_posttrain.compare``)."""

from __future__ import annotations

import argparse

from nnx_posttrain import compare


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=compare.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--metrics", default=None, help="comma-separated, e.g. loss,exact_match")
    parser.add_argument("--out", default=None,
                        help="where the PNGs go (default: <common parent>/compare)")
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    compare.compare(args.runs, metrics, args.out)
    return 0
