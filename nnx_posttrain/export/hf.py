"""Hugging Face export of a KerasHub causal LM: full weights (safetensors + config + tokenizer)
or LoRA adapters only (PEFT's adapter_model.safetensors + adapter_config.json).

Only families and configurations whose export was verified by a logits round trip against
``transformers`` (tests/test_hf_export.py: tiny random backbones of each, exported, loaded with
``AutoModelForCausalLM``, logits equal to 1e-4) are exported; anything else is refused by name.
Each family's ``Export`` (``families``) holds its weight names, its config writer and, where
KerasHub has none, its tokenizer writer; the models page lists the verified configurations.

Weights are mapped by Keras variable path (every variable must match exactly one rule, so an
unknown layer stops the export) and written one tensor at a time, in ``dtype``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from nnx_posttrain import families
from nnx_posttrain.export.hf_config import VERIFIED, ExportError, family, hf_config  # noqa: F401

DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", None), "float16": ("F16", np.float16)}
# The layout of a rule whose variable transformers derives from the config instead of reading it
# (a non-persistent buffer: SmolLM3's rotary frequencies); the family's config writer checks
# that its value is the one the config gives. Nothing is written for it.
DERIVED = "derived"


# ----------------------------------------------------------------------------- weights


def _rules(backbone):
    """The family's weight rules (``families``: ``Export.rules``), compiled; the backbone
    repaired first where its family has a repair (``families.prepare``, idempotent: SmolLM3's
    paths, which the rules read, on a backbone built outside the package)."""
    family(backbone)
    families.prepare(backbone)
    return [(re.compile(p + "$"), name, layout)
            for p, name, layout in families.of(backbone).export.rules(backbone)]


def _match(rules, path: str):
    hits = [(rx.match(path), name, layout) for rx, name, layout in rules]
    hits = [(m, name, layout) for m, name, layout in hits if m]
    if len(hits) != 1:
        return None
    m, name, layout = hits[0]
    return (None if layout == DERIVED else name.format(*m.groups())), layout


def to_matrix(array: np.ndarray, layout) -> np.ndarray:
    """A Keras kernel in HF's layout: (outputs, inputs) flattened to [out, in]. ``("expert", e,
    lo, hi)``: expert ``e`` of stacked experts [E, in, out], its outputs ``lo:hi``, as [out, in]
    (one HF tensor per expert: the per-expert names transformers writes); ``("axis", a)``: the
    array with a new axis of size 1 at ``a`` (Qwen 3.5's depthwise convolution [C, 1, K]);
    ``("transpose", axes)``: the array's axes permuted (a convolution kernel [H, W, in, out] as
    PyTorch's [out, in, H, W])."""
    if layout is None:
        return array
    if isinstance(layout, tuple) and layout[0] == "transpose":
        return np.ascontiguousarray(np.transpose(array, layout[1]))
    if isinstance(layout, tuple) and layout[0] == "axis":
        return np.expand_dims(array, layout[1])
    if isinstance(layout, tuple) and layout[0] == "expert":
        _, e, lo, hi = layout
        return np.ascontiguousarray(array[e][:, lo:hi].T)
    if layout == "flat":
        return array.reshape(-1)
    out_axes, in_axes = layout
    t = np.transpose(array, out_axes + in_axes)
    return t.reshape(math.prod(array.shape[a] for a in out_axes),
                     math.prod(array.shape[a] for a in in_axes))


def _expert_hits(rules, path: str) -> list:
    """The (name, layout) of every per-expert rule matching ``path`` (stacked experts: one HF
    tensor per expert and part), or [] when another rule, or none, matches it."""
    hits = [(rx.match(path), name, layout) for rx, name, layout in rules]
    hits = [(name.format(*m.groups()), layout) for m, name, layout in hits
            if m and layout != DERIVED]
    experts = all(isinstance(layout, tuple) and layout[0] == "expert" for _, layout in hits)
    return hits if hits and experts else []


def weight_map(backbone) -> dict[str, tuple]:
    """{HF tensor name: (Keras variable, layout)} of every variable; a tensor of several variables
    (rules with a ``("part", index, axis, layout)`` layout: Gemma 4's fused expert gate | up,
    Phi-3's qkv_proj and gate_up_proj) maps to (their tuple, ``("concat", axis, their
    layouts)``); a ``DERIVED`` variable has no entry. An unmatched variable (a LoRA factor not
    merged, an unknown layer) stops the export by name."""
    rules, out, parts, unmatched = _rules(backbone), {}, {}, []
    for v in backbone.weights:
        hits = _expert_hits(rules, v.path) or [_match(rules, v.path)]
        if hits == [None]:
            unmatched.append(v.path)
            continue
        if hits[0][1] == DERIVED:
            continue
        for name, layout in hits:
            if isinstance(layout, tuple) and layout[0] == "part":
                parts.setdefault(name, {})[layout[1]] = (v, layout[2], layout[3])
                continue
            if name in out:
                raise ExportError(f"--format hf: two variables map to {name}")
            out[name] = (v, layout)
    if unmatched:
        raise ExportError(f"--format hf: {len(unmatched)} variable(s) of {type(backbone).__name__} "
                          f"have no verified Hugging Face name, e.g. {unmatched[:3]}")
    for name, pieces in parts.items():
        if sorted(pieces) != list(range(len(pieces))) or len({p[1] for p in pieces.values()}) != 1:
            raise ExportError(f"--format hf: the parts of {name} are not one concatenation")
        ordered = [pieces[i] for i in range(len(pieces))]
        out[name] = (tuple(p[0] for p in ordered), ("concat", ordered[0][1],
                                                    tuple(p[2] for p in ordered)))
    return out


def derived_variables(backbone) -> list:
    """The variables the export writes nothing for (``DERIVED``: transformers computes them from
    the config)."""
    rules = _rules(backbone)
    return [v for v in backbone.weights if (_match(rules, v.path) or (0, 0))[1] == DERIVED]


def tensor_of(arrays, layout) -> np.ndarray:
    """The HF tensor of a ``weight_map`` entry from its variable's array (``to_matrix``), or from
    its variables' arrays for a ``("concat", axis, layouts)`` entry."""
    if isinstance(layout, tuple) and layout[0] == "concat":
        _, axis, layouts = layout
        return np.concatenate([to_matrix(a, l) for a, l in zip(arrays, layouts)], axis=axis)
    return to_matrix(arrays, layout)


def _values(variables, fn):
    return tuple(fn(v) for v in variables) if isinstance(variables, tuple) else fn(variables)


def _as_numpy(value, dtype: str) -> np.ndarray:
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(value).astype(jnp.dtype(dtype)))


def write_safetensors(path: Path, tensors: dict[str, callable], shapes: dict[str, tuple],
                      dtype: str) -> int:
    """Write ``tensors`` (name -> function returning the numpy array, called one at a time, so
    only one tensor's host copy exists at once) as a safetensors file; returns its size."""
    code, _ = DTYPES[dtype]
    itemsize = np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in tensors:
        size = math.prod(shapes[name]) * itemsize
        header[name] = {"dtype": code, "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, produce in tensors.items():
            produced = np.asarray(produce())
            array = np.ascontiguousarray(produced).reshape(produced.shape)  # 0-d stays 0-d
            if tuple(array.shape) != tuple(shapes[name]):
                raise ExportError(f"{name}: shape {array.shape}, expected {shapes[name]}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
    return path.stat().st_size


def export_model(task, to: Path, dtype: str, chat_format: str | None = None,
                 echo=print) -> list[Path]:
    """Full weights: model.safetensors, config.json, generation_config.json, tokenizer files;
    with ``chat_format``, its template as the tokenizer's ``chat_template``; a vision-language
    model's image processor files (``export_processor``)."""
    backbone = task.backbone
    tokenizer = getattr(task.preprocessor, "tokenizer", None)
    cfg = hf_config(backbone, tokenizer, dtype)  # an unverified configuration: refused by name
    mapping = weight_map(backbone)
    shapes = {n: tensor_of(_values(v, lambda x: np.empty(x.shape, np.int8)), layout).shape
              for n, (v, layout) in mapping.items()}
    tensors = {n: (lambda v=v, layout=layout: tensor_of(
        _values(v, lambda x: _as_numpy(x.value, dtype)), layout))
        for n, (v, layout) in mapping.items()}
    to.mkdir(parents=True, exist_ok=True)
    write_safetensors(to / "model.safetensors", tensors, shapes, dtype)
    (to / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (to / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        export_tokenizer(tokenizer, to)
        if chat_format is not None:
            from nnx_posttrain import chat

            path = to / "tokenizer_config.json"
            config = json.loads(path.read_text())
            config["chat_template"] = chat.hf_template(chat_format)
            path.write_text(json.dumps(config, indent=2) + "\n")
    if "vision_config" in cfg:
        export_processor(task, to, echo)
    return sorted(p for p in to.rglob("*") if p.is_file())


def export_processor(task, to: Path, echo=print) -> None:
    """The image processor files of a vision-language model (its family's
    ``Export.processor``: ``preprocessor_config.json``, ``processor_config.json``) from its
    KerasHub preprocessor's image converter; none, said through ``echo``, where transformers
    has no form of that converter."""
    make = families.of(task.backbone).export.processor
    preprocessor = getattr(task, "preprocessor", None)
    if make is None or getattr(preprocessor, "image_converter", None) is None:
        echo("no image processor files: the model has no image converter to describe")
        return
    try:
        files = make(preprocessor)
    except ExportError as exc:
        echo(f"no image processor files: {exc}")
        return
    for name, content in files.items():
        (to / name).write_text(json.dumps(content, indent=2) + "\n")


def export_tokenizer(tokenizer, to: Path) -> None:
    """The tokenizer files: the writer of the family whose tokenizer class this is
    (``Export.tokenizer``), else KerasHub's tokenizer export."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    name = type(tokenizer).__name__
    own = next((f.export.tokenizer for f in families.FAMILIES.values()
                if f.classes[2] == name and f.export and f.export.tokenizer), None)
    if own is not None:  # the family's own writer (Qwen 3's tokenizer written as Qwen 2's)
        own(tokenizer, to)
        return
    if name not in hf_exporter.MODEL_TOKENIZER_CONFIGS:
        raise ExportError(f"--format hf: KerasHub cannot export a {name} to Hugging Face format")
    hf_exporter.export_tokenizer(tokenizer, str(to))


# ----------------------------------------------------------------------------- LoRA adapters


def lora_factors(a: np.ndarray, b: np.ndarray, layout) -> tuple[np.ndarray, np.ndarray, int]:
    """PEFT factors (lora_A [R, in], lora_B [out, R], R) of a Keras LoRA pair whose product
    a @ b (over the rank) is a delta of the kernel with ``layout``. Keras factors the kernel's
    last axis alone (b: [r, last]); the kernel's other output axes (e.g. the heads of a query
    projection) make one rank-r block each, so the exact PEFT adapter is block-diagonal with
    R = r x their size (R = r when the last axis is the only output axis: k/v with one head,
    o_proj, the MLP)."""
    out_axes, in_axes = layout
    last = a.ndim - 1  # kernel axes: a's leading axes + the last axis (b's)
    if not out_axes or out_axes[-1] != last:
        raise ExportError("LoRA factors of this layer have no exact PEFT form")
    extra = out_axes[:-1]
    r = a.shape[-1]
    ne = math.prod(a.shape[i] for i in extra)
    n_in = math.prod(a.shape[i] for i in in_axes)
    lora_a = np.transpose(a, extra + (last,) + in_axes).reshape(ne * r, n_in)
    lora_b = np.einsum("xy,kl->xlyk", np.eye(ne, dtype=b.dtype), b).reshape(ne * b.shape[1], ne * r)
    return lora_a, lora_b, ne * r


def _refuse_vision(backbone, layers) -> None:
    tower = getattr(backbone, "vision_encoder", None)
    inside = {id(t) for t in tower._flatten_layers()} if tower is not None else set()
    if any(id(l) in inside for l in layers):
        raise ExportError("--adapters-only: LoRA on the vision encoder (--lora.targets projector / "
                          "vision-attention) has no verified PEFT form; export the merged model "
                          "(--format hf without --adapters-only)")
    if tower is not None and any(getattr(l, "lora_kernels", None) for l in layers):
        raise ExportError("--adapters-only: LoRA on the stacked experts of a vision-language "
                          "model has no verified PEFT form; export the merged model (--format hf)")


def _dense_adapter(layer, rules) -> tuple[str, np.ndarray, np.ndarray, int]:
    """(transformers module, lora_A, lora_B, rank) of a Dense / EinsumDense layer's LoRA."""
    import keras

    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        raise ExportError(f"--adapters-only: LoRA on {layer.path} ({type(layer).__name__})")
    kernel = getattr(layer, "_kernel", None)  # .kernel is the merged array once LoRA is on
    hit = _match(rules, kernel.path) if kernel is not None else None
    if hit is None or hit[1] in (None, "flat", DERIVED):
        raise ExportError(f"--adapters-only: {layer.path} has no verified Hugging Face module")
    name, layout = hit
    if isinstance(layout, tuple) and layout[0] == "part":  # Phi-3's fused qkv_proj / gate_up_proj
        raise ExportError(f"--adapters-only: {layer.path} is part of the fused {name}, which has "
                          "no verified PEFT form; export the merged model (--format hf)")
    return (name.removesuffix(".weight"),
            *lora_factors(np.asarray(layer.lora_kernel_a.value, np.float32),
                          np.asarray(layer.lora_kernel_b.value, np.float32), layout))


def _expert_adapters(backbone, layers, rules) -> tuple[dict, dict, list[str]]:
    """``hf_experts.adapters`` of the experts layers, in their family's ``PeftExperts`` form."""
    from nnx_posttrain.export import hf_experts
    from nnx_posttrain.model import expert_lora

    peft = families.of(backbone).export.experts
    if peft is None:
        raise ExportError(f"--adapters-only: LoRA on the stacked experts of {layers[0].path} has "
                          "no verified PEFT form; export the merged model (--format hf)")

    def decoder_layer(layer):
        kernel = getattr(layer, expert_lora.spec_of(layer).kernels[layer.lora_kernels[0]])
        names = [name.format(*m.groups()) for rx, name, layout in rules
                 if layout != DERIVED and (m := rx.match(kernel.path))]
        found = re.match(r"(.*\.layers\.\d+)\.", names[0]) if names else None
        if found is None:
            raise ExportError(f"--adapters-only: {layer.path} has no verified Hugging Face module")
        return found.group(1)

    return hf_experts.adapters(layers, peft, decoder_layer)


def export_adapters(backbone, to: Path, dtype: str, base_model: str) -> list[Path]:
    """PEFT adapter_model.safetensors + adapter_config.json of the backbone's LoRA layers: a
    Dense / EinsumDense layer's as LoRA on its transformers module (``target_modules``), the
    stacked experts' as LoRA on transformers' 3-D expert parameters (``target_parameters``,
    ``hf_experts``)."""
    rules = _rules(backbone)
    layers = [l for l in backbone._flatten_layers(include_self=False)
              if getattr(l, "lora_enabled", False)]
    if not layers:
        raise ExportError("--adapters-only: the run has no LoRA adapters (it trained every weight)")
    _refuse_vision(backbone, layers)
    rank, alpha = layers[0].lora_rank, layers[0].lora_alpha
    for layer in layers:
        if (layer.lora_rank, layer.lora_alpha) != (rank, alpha):
            raise ExportError(f"--adapters-only: {layer.path} has another LoRA rank or alpha")
    experts = [l for l in layers if getattr(l, "lora_kernels", None)]
    arrays, ranks, targets, parameters = {}, {}, set(), []
    for layer in (l for l in layers if not getattr(l, "lora_kernels", None)):
        module, lora_a, lora_b, r = _dense_adapter(layer, rules)
        ranks[module.split(".")[-1]] = r
        targets.add(module.split(".")[-1])
        arrays[f"base_model.model.{module}.lora_A.weight"] = lora_a
        arrays[f"base_model.model.{module}.lora_B.weight"] = lora_b
    if experts:
        more, expert_ranks, parameters = _expert_adapters(backbone, experts, rules)
        arrays.update(more)
        ranks.update(expert_ranks)
    to.mkdir(parents=True, exist_ok=True)
    write_safetensors(to / "adapter_model.safetensors",
                      {k: (lambda x=v: _as_numpy(x, dtype)) for k, v in arrays.items()},
                      {k: v.shape for k, v in arrays.items()}, dtype)
    config = _adapter_config(base_model, rank, alpha, ranks, sorted(targets), parameters)
    (to / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sorted(p for p in to.rglob("*") if p.is_file())


def _adapter_config(base_model, rank, alpha, ranks, targets, parameters) -> dict:
    """PEFT's adapter_config.json. PEFT scales by lora_alpha / r: an adapter of another rank R
    (block-diagonal: a query's heads, fused gate | up experts) keeps Keras' alpha / rank with
    alpha x R / rank (``rank_pattern`` / ``alpha_pattern``)."""
    bigger = {k: v for k, v in sorted(ranks.items()) if v != rank}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": targets, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": bigger,
        "alpha_pattern": {k: alpha * v / rank for k, v in bigger.items()},
        "revision": None,
    }
    if parameters:  # PEFT >= 0.17 (verified: 0.21.2)
        config["target_parameters"] = parameters
    return config
