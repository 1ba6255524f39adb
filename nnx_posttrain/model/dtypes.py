"""Dtypes before a model loads: ``--dtype``'s names (``DTYPES``, Keras policies), the dtype a
checkpoint stores its weights in (``checkpoint_dtype``), what ``--dtype auto`` resolves to
(``resolve_dtype``) and how much memory its weights will take (``weights_bytes``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from nnx_posttrain.model.names import PRESETS, TINY, is_local_model

DTYPES = {"float32": "float32", "bfloat16": "mixed_bfloat16", "bfloat16-params": "bfloat16"}
AUTO = "auto"  # the checkpoint's own dtype (``resolve_dtype``)


def checkpoint_dtype(name: str) -> str | None:
    """The dtype a checkpoint stores its weights in ('float32', 'bfloat16' or 'float16'): a local
    KerasHub preset's config.json ``dtype`` (a mixed policy keeps float32 weights) or a Hugging
    Face config's ``torch_dtype`` / ``dtype``; a KerasHub preset name's published config where
    KerasHub can read it (its cache, or the network); None where nothing says (a built-in model)."""
    if name in TINY:
        return None
    handle = PRESETS.get(name, name)
    try:
        saved = (json.loads((Path(handle).expanduser() / "config.json").read_text())
                 if is_local_model(handle) else _published_config(handle))
    except Exception:  # noqa: BLE001 - unreadable or offline: the model's own load says why
        return None
    dtype = saved.get("config", {}).get("dtype") if "class_name" in saved else (
        saved.get("torch_dtype") or saved.get("dtype"))
    if isinstance(dtype, dict):
        dtype = dtype.get("config", {}).get("name")
    if not isinstance(dtype, str):
        return None
    return "float32" if dtype.startswith("mixed_") else dtype


@functools.lru_cache(maxsize=None)
def _published_config(handle: str) -> dict:
    """A KerasHub preset's config.json, read once per process (KerasHub may fetch it)."""
    from keras_hub.src.utils.preset_utils import load_json

    return load_json(handle, "config.json")


def resolve_dtype(name: str, dtype: str, lora: bool) -> str:
    """``--dtype``'s ``DTYPES`` name: ``dtype`` itself, or for 'auto' the checkpoint's own (TRL's
    ``dtype="auto"``): a checkpoint stored in 16 bits trains with LoRA as 'bfloat16-params' (the
    frozen base in bfloat16; ``enable_lora`` gives the factors float32 master weights) and in full
    as 'bfloat16' (float32 master weights, bfloat16 compute); a float32 checkpoint, a built-in
    model or one whose dtype is unknown in 'float32'."""
    if dtype != AUTO:
        return dtype
    if checkpoint_dtype(name) in ("bfloat16", "float16"):
        return "bfloat16-params" if lora else "bfloat16"
    return "float32"


def weights_bytes(name: str, dtype: str) -> int | None:
    """The memory a local checkpoint directory's weights take once loaded in ``dtype`` (a
    ``DTYPES`` name), from its weight files' sizes and stored dtype (KerasHub's config.json
    ``dtype``, a Hugging Face config's ``torch_dtype``), before anything loads; None for names
    that are not local directories."""
    if not is_local_model(name):
        return None
    root = Path(name).expanduser()
    files = keras_weight_files(root) + [p for p in root.iterdir()
                                         if p.suffix in (".safetensors", ".bin")]
    stored_size = 2 if checkpoint_dtype(name) in ("bfloat16", "float16") else 4
    wanted_size = 2 if DTYPES[dtype] == "bfloat16" else 4  # 'bfloat16' keeps float32 weights
    return sum(p.stat().st_size for p in files) * wanted_size // stored_size


def keras_weight_files(preset) -> list[Path]:
    """A local KerasHub preset's weight files: its ``model.weights.h5``, or where
    ``save_to_preset`` sharded the weights (a backbone over its ``max_shard_size``, 10 GiB by
    default) the shards that its ``model.weights.json`` maps (``model_00000.weights.h5``, ...);
    [] for a directory that holds neither (a Hugging Face checkpoint)."""
    root = Path(preset).expanduser()
    if (root / "model.weights.h5").is_file():
        return [root / "model.weights.h5"]
    index = root / "model.weights.json"
    if not index.is_file():
        return []
    names = set()
    for shard in json.loads(index.read_text()).get("weight_map", {}).values():
        names.update(shard if isinstance(shard, list) else [shard])
    return [root / n for n in sorted(names) if (root / n).is_file()]
