"""Export a run's checkpoint as a standalone model: a KerasHub preset or Hugging Face safetensors,
or its LoRA adapters alone in PEFT's format.

    python -m tools.export RUN_DIR [--step N] --to DIR [--format keras|hf] [--dtype D] [--adapters-only]

Loads checkpoint ``--step`` (default: the latest) of RUN_DIR (the weights only: no optimizer or
reference state is built) and writes to DIR (which must be new or empty):

- ``keras`` (default): a KerasHub preset (``task.save_to_preset``), LoRA merged, loadable with
  ``keras_hub.models.CausalLM.from_preset(DIR)``, ``--model DIR`` or ``nnx_posttrain.model.load(DIR)``;
- ``hf``: Hugging Face Transformers safetensors + config + tokenizer, LoRA merged, for the families
  and configurations verified by a logits round trip against ``transformers`` (``tools.hf_export``:
  Gemma, Gemma 2, Gemma 3 text, Llama 3 / 3.1+, Mistral, Qwen 2 / 2.5, Qwen 3); others refused;
- ``hf --adapters-only``: ``adapter_model.safetensors`` + ``adapter_config.json`` that PEFT loads
  on top of the base model (``PeftModel.from_pretrained(base, DIR)``).

``--dtype`` (float32, bfloat16, float16): the weights' dtype in the export; default: the source
model's (the dtype a local preset or Hugging Face directory was saved in, else the run's weights').
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORMATS = ("keras", "hf")
DTYPES = ("float32", "bfloat16", "float16")


class ExportError(RuntimeError):
    """The run cannot be exported as asked; the message says why."""


def source_dtype(model_name: str, run_dtype: str) -> str:
    """The dtype the run's model came in: a local KerasHub preset's or Hugging Face directory's
    saved dtype, else the run's weight dtype (bfloat16 only with --dtype bfloat16-params)."""
    config = Path(model_name).expanduser() / "config.json"
    if config.is_file():
        try:
            saved = json.loads(config.read_text())
        except ValueError:
            saved = {}
        dtype = saved.get("config", {}).get("dtype") if "class_name" in saved else (
            saved.get("torch_dtype") or saved.get("dtype"))
        if isinstance(dtype, dict):
            dtype = dtype.get("config", {}).get("name")
        if isinstance(dtype, str):
            if dtype.startswith("mixed_"):  # a mixed policy keeps float32 weights
                dtype = "float32"
            if dtype in DTYPES:
                return dtype
    return "bfloat16" if run_dtype == "bfloat16-params" else "float32"


def _cast_task(task, dtype: str):
    """``task`` with its weights in ``dtype`` (a new task; the same one if they already are)."""
    import keras

    backbone = task.backbone
    if all(keras.backend.standardize_dtype(v.dtype) == dtype for v in backbone.weights
           if "float" in str(v.dtype)):
        return task
    config = dict(backbone.get_config(), dtype=dtype)
    new = type(backbone).from_config(config)
    for target, source in zip(new.weights, backbone.weights):
        target.assign(keras.ops.cast(source.value, target.dtype))
    return type(task)(backbone=new, preprocessor=task.preprocessor)


def export(run_dir: str | Path, to: str | Path, step: int | None = None, fmt: str = "keras",
           dtype: str | None = None, adapters_only: bool = False) -> list[Path]:
    """Write ``run_dir``'s checkpoint ``step`` to ``to`` in format ``fmt``; returns the files written."""
    import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
    from nnx_posttrain import inspection, runs
    from tools import hf_export

    run_dir, to = Path(run_dir), Path(to)
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if adapters_only and fmt != "hf":
        raise ExportError("--adapters-only writes PEFT's format: use it with --format hf")
    try:
        saved = runs.check_policy(run_dir)
    except (runs.NotARunError, runs.NotAPolicyError) as exc:
        raise ExportError(str(exc)) from None
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        what = "is not an empty directory" if to.is_dir() else "is a file"
        raise ExportError(f"--to {to}: exists and {what}; choose a new one")
    if adapters_only and not saved["lora"]["rank"]:
        raise ExportError(f"--adapters-only: {run_dir} trained every weight (no LoRA adapters)")
    try:
        loaded = runs.load(run_dir, step)
        policy = loaded.policy()  # a PPO run: the policy, without its value head
    except FileNotFoundError as exc:
        raise ExportError(f"{run_dir}: nothing to export: {exc}") from None
    task = loaded.lm.task
    family = type(task.backbone).__name__
    dtype = dtype or source_dtype(saved["model"], saved["dtype"])
    try:
        if fmt == "hf":
            hf_export.family(task.backbone)  # refuse an unverified family before writing
        if adapters_only:
            files = hf_export.export_adapters(task.backbone, to, dtype, base_model=saved["model"])
            what = f"the LoRA adapters of step {loaded.step} of {run_dir} ({family}, {dtype})"
            kind = "PEFT adapters"
        else:
            merged = inspection.merge_lora(policy)
            if fmt == "keras":
                to.mkdir(parents=True, exist_ok=True)
                _cast_task(task, dtype).save_to_preset(str(to))
                files = sorted(p for p in to.rglob("*") if p.is_file())
            else:
                files = hf_export.export_model(task, to, dtype, loaded.lm.chat_format)
            what = f"step {loaded.step} of {run_dir} ({saved['model']}, {family}, {dtype}"
            what += f", {len(merged)} LoRA layers merged)" if merged else ")"
            kind = "a KerasHub preset" if fmt == "keras" else "Hugging Face safetensors"
    except hf_export.ExportError as exc:
        raise ExportError(str(exc)) from None
    print(f"exported {what} as {kind} to {to}:")
    for p in files:
        print(f"  {p.relative_to(to)}  ({p.stat().st_size:,} bytes)")
    return files


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (runs/<name>) with checkpoints")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--to", required=True, help="output directory (new or empty)")
    parser.add_argument("--format", choices=FORMATS, default="keras")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weight dtype of the export (default: the source model's)")
    parser.add_argument("--adapters-only", action="store_true",
                        help="with --format hf: only the LoRA adapters, in PEFT's format")
    args = parser.parse_args(argv)
    try:
        return export(args.run_dir, args.to, args.step, args.format, args.dtype, args.adapters_only)
    except ExportError as exc:
        raise SystemExit(f"export: {exc}") from None


if __name__ == "__main__":
    main()
