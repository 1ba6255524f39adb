"""``nnx-posttrain export RUN_DIR --to DIR [--step N] [--format keras|hf] [--dtype D]
[--adapters-only]``: a run's checkpoint as a standalone model (``nnx_posttrain.export``).

- ``keras`` (default): a KerasHub preset, LoRA merged, loadable with ``--model DIR``;
- ``hf``: Hugging Face safetensors + config + tokenizer (with the chat template), LoRA merged,
  for the families verified against ``transformers`` (others are refused by name);
- ``hf --adapters-only``: the LoRA adapters alone, in PEFT's format.
"""

from __future__ import annotations

import argparse

from nnx_posttrain import export


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (runs/<name>) with checkpoints")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--to", required=True, help="output directory (new or empty)")
    parser.add_argument("--format", choices=export.FORMATS, default="keras")
    parser.add_argument("--dtype", choices=export.DTYPES, default=None,
                        help="weight dtype of the export (default: the source model's)")
    parser.add_argument("--adapters-only", action="store_true",
                        help="with --format hf: only the LoRA adapters, in PEFT's format")
    args = parser.parse_args(argv)
    export.export(args.run_dir, args.to, args.step,
                  export.Target(args.format, args.dtype, args.adapters_only))
    return 0
