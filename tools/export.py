"""Export a run's checkpoint as a standalone model: a KerasHub preset or Hugging Face safetensors.

    python -m tools.export RUN_DIR [--step N] --to DIR [--format keras|hf]

Loads checkpoint ``--step`` (default: the latest) of RUN_DIR, folds LoRA adapters into the base
kernels if the run used LoRA, and writes to DIR (which must be new or empty):

- ``keras`` (default): a KerasHub preset (``task.save_to_preset``), loadable with
  ``keras_hub.models.CausalLM.from_preset(DIR)``, ``--model DIR`` or ``nnx_posttrain.model.load(DIR)``;
- ``hf``: Hugging Face Transformers safetensors + config + tokenizer (``task.export_to_transformers``),
  for the families KerasHub can export (Gemma, Gemma 3, Llama 3, Mistral, Qwen, ...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

FORMATS = ("keras", "hf")


class ExportError(RuntimeError):
    """The run cannot be exported as asked; the message says why."""


def _hf_families() -> list[str]:
    from keras_hub.src.utils.transformers.export import hf_exporter

    return sorted(hf_exporter.MODEL_CONFIGS)


def export(run_dir: str | Path, to: str | Path, step: int | None = None, fmt: str = "keras") -> list[Path]:
    """Write ``run_dir``'s checkpoint ``step`` to ``to`` in format ``fmt``; returns the files written."""
    import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
    from nnx_posttrain import inspection, runs

    run_dir, to = Path(run_dir), Path(to)
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not (run_dir / "config.json").exists():
        raise ExportError(f"{run_dir}: not a run directory (no config.json)")
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ExportError(f"--to {to}: exists and is not an empty directory; choose a new one")
    try:
        loaded = runs.load(run_dir, step)
    except FileNotFoundError as exc:
        raise ExportError(f"{run_dir}: nothing to export: {exc}") from None
    task = loaded.lm.task
    family = type(task.backbone).__name__
    if fmt == "hf" and family not in _hf_families():
        raise ExportError(
            f"--format hf: KerasHub cannot export {family} to Hugging Face format (it exports "
            f"{', '.join(_hf_families())}); use --format keras"
        )
    merged = inspection.merge_lora(loaded.module)
    to.mkdir(parents=True, exist_ok=True)
    if fmt == "keras":
        task.save_to_preset(str(to))
    else:
        task.export_to_transformers(str(to))
    files = sorted(p for p in to.rglob("*") if p.is_file())
    what = f"step {loaded.step} of {run_dir} ({loaded.config['model']}, {family}"
    what += f", {len(merged)} LoRA layers merged)" if merged else ")"
    print(f"exported {what} as {'a KerasHub preset' if fmt == 'keras' else 'Hugging Face safetensors'} to {to}:")
    for p in files:
        print(f"  {p.relative_to(to)}  ({p.stat().st_size:,} bytes)")
    return files


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (runs/<name>) with checkpoints")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--to", required=True, help="output directory (new or empty)")
    parser.add_argument("--format", choices=FORMATS, default="keras")
    args = parser.parse_args(argv)
    try:
        return export(args.run_dir, args.to, args.step, args.format)
    except ExportError as exc:
        raise SystemExit(f"export: {exc}") from None


if __name__ == "__main__":
    main()
