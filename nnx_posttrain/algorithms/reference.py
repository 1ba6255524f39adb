"""The reference model of preference and RL methods, without waste (``--algo.reference``):

- ``lora_base`` (the default with LoRA): the same weights with the LoRA delta switched off, inside
  the same step — no second copy of the model in memory;
- ``copy`` (the default for full fine-tuning): a frozen copy of the starting weights, kept by the
  loop beside the trainable state;
- ``precompute``: reference log-probs computed once over the dataset before training, cached on
  disk beside the run (``runs/.reference_cache/<fingerprint>.npz``) and reused while the model,
  the data files and the tokenization settings are unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Literal

import jax
import numpy as np

from nnx_posttrain import data, errors, model, progress

Reference = Literal["auto", "lora_base", "copy", "precompute"]


def resolve_mode(mode: str | None, module) -> str | None:
    """``--algo.reference`` -> the mode used with this module (None: reference-free); auto:
    lora_base with LoRA (and a frozen vision tower), else copy."""
    if mode is None:
        return None
    tower = model.tower_trains(module)  # --train-vision: weights beside LoRA's change too
    if mode == "auto":
        mode = "lora_base" if model.has_lora(module) and not tower else "copy"
    if mode == "lora_base" and not model.has_lora(module):
        raise errors.ConfigError("--algo.reference lora_base needs LoRA (--lora.rank > 0)")
    if mode == "lora_base" and tower:
        raise errors.ConfigError("--algo.reference lora_base: with --train-vision the vision "
                                 "tower trains outside LoRA; use copy (the default there)")
    return mode


def forward(mode: str | None, module, reference_module, fn):
    """``fn(m)`` evaluated as the reference model, without gradient (None for ``precompute``:
    the batch carries the reference log-probs)."""
    if mode == "precompute":
        return None
    if mode == "copy":
        return jax.lax.stop_gradient(fn(reference_module))
    with model.lora_disabled(module):
        return jax.lax.stop_gradient(fn(module))


def precomputed(run, algorithm, params) -> dict:
    """{"train": {name: [records] array}, "eval": {...}}: ``algorithm.reference_logps`` of every
    train and eval example, computed once with the starting weights ``params`` and cached."""
    cfg = run.cfg
    fingerprint = hashlib.sha256(json.dumps({
        "model": cfg.model, "dtype": cfg.dtype, "seed": cfg.seed, "algorithm": algorithm.name,
        "init_from": _init_signature(cfg.init_from),
        "data": [cfg.data, cfg.eval_data, _files_signature(cfg.data), _files_signature(cfg.eval_data)],
        "batching": [cfg.batching.max_length, cfg.batching.max_prompt_length,
                     cfg.batching.truncation, cfg.batching.format, cfg.batching.skip_bad],
        "sizes": [len(run.train_src), len(run.eval_src) if run.eval_src is not None else 0],
    }, sort_keys=True).encode()).hexdigest()[:16]
    path = run.run_dir.parent / ".reference_cache" / f"{fingerprint}.npz"
    if path.exists():
        with np.load(path) as cached:
            out = {"train": {}, "eval": {}}
            for key in cached.files:
                split, name = key.split("/", 1)
                out[split][name] = cached[key]
        run.echo(f"reference log-probs: reused {path}")
        return out

    @jax.jit
    def reference(params, batch):
        module, _ = model.merge(run.graphdef, params, run.frozen)
        with model.images(batch.get("pixel_values")), (
                model.lora_disabled(module) if model.has_lora(module) else contextlib.nullcontext()):
            return algorithm.reference_logps(module, batch)

    out = {"train": {}, "eval": {}}
    t0 = time.perf_counter()
    for split, src in (("train", run.train_src), ("eval", run.eval_src)):
        if src is None:
            continue
        parts = {}
        for batch in progress.bar(data.eval_batches(src, run.transform, run.micro_batch),
                                  desc=f"reference {split}", unit="batch", leave=False):
            batch = algorithm.prepare({k: v for k, v in batch.items()
                                       if k not in ("truncated", "index")})
            for k, v in jax.device_get(reference(params, batch)).items():
                parts.setdefault(k, []).append(np.asarray(v))
        out[split] = {k: np.concatenate(v)[: len(src)] for k, v in parts.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **{f"{s}/{k}": v for s, d in out.items() for k, v in d.items()})
    tmp.replace(path)
    run.echo(f"reference log-probs: computed in {time.perf_counter() - t0:.1f}s, cached in {path}")
    return out


def _init_signature(init_from):
    """The starting weights of ``--init-from`` (the cache key's part for them): the run directory
    and the modification time of its checkpoints (a new or removed checkpoint changes it)."""
    if not init_from:
        return None
    checkpoints = Path(init_from) / "checkpoints"
    return [str(Path(init_from).resolve()),
            checkpoints.stat().st_mtime_ns if checkpoints.exists() else None]


def _files_signature(spec):
    """Size and modification time of each local file of a data spec (the cache key's data part);
    for ``builtin``, the built-in task's own fingerprint (its generator's code is the data)."""
    if not spec:
        return None
    if spec == "builtin":
        return data.builtin_fingerprint()
    out = []
    for part in spec.split(","):
        path = Path(part.rsplit(":", 1)[0] if not Path(part).exists() else part)
        if path.exists():
            st = path.stat()
            out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out
