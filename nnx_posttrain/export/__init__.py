"""Export a run's checkpoint as a standalone model: a KerasHub preset or Hugging Face safetensors,
or its LoRA adapters alone in PEFT's format (``nnx-posttrain export``, ``export.export``).

    nnx-posttrain export RUN_DIR [--step N] --to DIR [--format keras|hf] [--dtype D] [--adapters-only]

Loads checkpoint ``--step`` (default: the latest) of RUN_DIR (the weights only: no optimizer or
reference state is built) and writes to DIR (which must be new or empty):

- ``keras`` (default): a KerasHub preset (``task.save_to_preset``), LoRA merged, loadable with
  ``keras_hub.models.CausalLM.from_preset(DIR)``, ``--model DIR`` or ``nnx_posttrain.model.load(DIR)``;
- ``hf``: Hugging Face Transformers safetensors + config + tokenizer, LoRA merged, for the families
  and configurations verified by a logits round trip against ``transformers`` (``export.hf``:
  Gemma, Gemma 2, Gemma 3 and Gemma 4 (text, and with their vision towers), Llama 3 / 3.1+, Mistral,
  Qwen 2 / 2.5, Qwen 3, and the newer families the models page lists: Gemma 4's 26B-A4B experts,
  Qwen3-MoE, Mixtral, GPT-OSS, Qwen 3.5 and its MoE, SmolLM3 with its NoPE layers); others
  refused;
- ``hf --adapters-only``: ``adapter_model.safetensors`` + ``adapter_config.json`` that PEFT loads
  on top of the base model (``PeftModel.from_pretrained(base, DIR)``).

``--dtype`` (float32, bfloat16, float16): the weights' dtype in the export; default: the source
model's (the dtype a local preset or Hugging Face directory was saved in, else the run's weights').
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nnx_posttrain import errors
from nnx_posttrain.export.hf import ExportError

FORMATS = ("keras", "hf")
DTYPES = ("float32", "bfloat16", "float16")


def source_dtype(model_name: str, run_dtype: str) -> str:
    """The dtype the run's model came in: its checkpoint's stored dtype
    (``model.checkpoint_dtype``), else the run's weight dtype (bfloat16 only with --dtype
    bfloat16-params)."""
    from nnx_posttrain import model

    stored = model.checkpoint_dtype(model_name)
    if stored in DTYPES:
        return stored
    return "bfloat16" if run_dtype == "bfloat16-params" else "float32"


def _dequantized(saved: dict, policy, echo):
    """(a task of the run's model without quantization or LoRA holding ``policy``'s effective
    weights: each int8 kernel divided by its scale plus its LoRA delta; the merged layers)."""
    from nnx_posttrain import model

    name = saved["model"]
    plain = model.load(name, model.resolve_dtype(name, saved["dtype"], lora=False),
                       chat_format=saved.get("chat_format"))
    merged = model.dequantized_into(policy, plain.module)
    echo(f"dequantized the {saved['quantize']} base of {name} and merged {len(merged)} LoRA layers")
    return plain.task, merged


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


@dataclasses.dataclass(frozen=True)
class Target:
    """What ``export`` writes: ``format`` (``FORMATS``), the weights' ``dtype`` (``DTYPES``;
    default: the source model's), ``adapters_only`` (with hf: the LoRA adapters alone, in PEFT's
    format)."""

    format: str = "keras"
    dtype: str | None = None
    adapters_only: bool = False


def export(run_dir: str | Path, to: str | Path, step: int | None = None,
           target: Target = Target(), echo=print) -> list[Path]:
    """Write ``run_dir``'s checkpoint ``step`` to ``to`` as ``target`` says; returns the files
    written. ``ExportError`` (a ``UserError``) when it cannot be done as asked."""
    from nnx_posttrain import inspection, model, runs
    from nnx_posttrain.export import hf as hf_export

    fmt, dtype, adapters_only = target.format, target.dtype, target.adapters_only
    run_dir, to = Path(run_dir), Path(to)
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if adapters_only and fmt != "hf":
        raise ExportError("--adapters-only writes PEFT's format: use it with --format hf")
    try:
        saved = runs.check_policy(run_dir)
    except errors.RunDirError as exc:
        raise ExportError(str(exc)) from None
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        what = "is not an empty directory" if to.is_dir() else "is a file"
        raise ExportError(f"--to {to}: exists and {what}; choose a new one")
    if adapters_only and not saved["lora"]["rank"]:
        raise ExportError(f"--adapters-only: {run_dir} trained every weight (no LoRA adapters)")
    try:
        loaded = runs.load(run_dir, step, echo=echo)
        policy = loaded.policy()  # a PPO run: the policy, without its value head
    except errors.CheckpointError as exc:
        raise ExportError(f"{run_dir}: nothing to export: {exc}") from None
    task = loaded.lm.task
    family = type(task.backbone).__name__
    dtype = dtype or source_dtype(saved["model"], saved["dtype"])
    if fmt == "hf":
        hf_export.family(task.backbone)  # refuse an unverified family before writing
    if adapters_only:
        files = hf_export.export_adapters(task.backbone, to, dtype, base_model=saved["model"])
        what = f"the LoRA adapters of step {loaded.step} of {run_dir} ({family}, {dtype})"
        kind = "PEFT adapters"
    else:
        if saved.get("quantize", "none") != "none":  # its effective weights, in a plain model
            task, merged = _dequantized(saved, policy, echo)
        else:
            merged = inspection.merge_lora(policy)
        if fmt == "keras":
            to.mkdir(parents=True, exist_ok=True)
            _cast_task(task, dtype).save_to_preset(str(to))
            model.converters.complete_preset(task, to)  # what KerasHub's config leaves out
            files = sorted(p for p in to.rglob("*") if p.is_file())
        else:
            files = hf_export.export_model(task, to, dtype, loaded.lm.chat_format, echo=echo)
        what = f"step {loaded.step} of {run_dir} ({saved['model']}, {family}, {dtype}"
        what += f", {len(merged)} LoRA layers merged)" if merged else ")"
        kind = "a KerasHub preset" if fmt == "keras" else "Hugging Face safetensors"
    echo(f"exported {what} as {kind} to {to}:")
    for p in files:
        echo(f"  {p.relative_to(to)}  ({p.stat().st_size:,} bytes)")
    return files
