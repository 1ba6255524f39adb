"""Notebook helpers: what a model holds, what LoRA changed, how far a policy moved, and merging.

Every function takes the NNX module (``lm.module``, ``runs.load(...).module``: a KerasHub backbone,
or a reward model's / PPO policy's scalar-head wrapper around one) and works by Keras variable path (e.g. ``'decoder_block_0/attention/query/kernel'``).

    from nnx_posttrain import inspection, runs
    run = runs.load("runs/sft_lora")
    inspection.param_counts(run.module)       # {'token_embedding': ..., 'decoder_block_0': ..., 'total': ...}
    inspection.lora_delta_norms(run.module)   # {'decoder_block_0/attention/query': 0.12, ...}
    inspection.merge_lora(run.module)         # fold the adapters in: a plain model again
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import model
from nnx_posttrain.model import expert_lora


def _keras(module):
    """The Keras backbone of ``module``: itself, or the backbone inside a scalar-head wrapper (a
    reward model's, a PPO policy's value head), which holds every LoRA layer."""
    return module if hasattr(module, "_flatten_layers") else module.backbone


def _lora_layers(module) -> list:
    return [l for l in _keras(module)._flatten_layers(include_self=False)
            if getattr(l, "lora_enabled", False)]


def _variables(module) -> dict[str, jnp.ndarray]:
    return model.named_variables(nnx.state(module))


def param_counts(module) -> dict[str, int]:
    """Parameter counts grouped by top-level layer ('token_embedding', 'decoder_block_0', ...,
    'final_normalization'), in model order, plus 'total'. LoRA factors count under their layer."""
    counts: dict[str, int] = {}
    for path, value in _variables(module).items():
        top = path.split("/", 1)[0]
        counts[top] = counts.get(top, 0) + int(np.prod(value.shape))
    counts["total"] = sum(counts.values())
    return counts


def lora_delta_norms(module) -> dict[str, float]:
    """{layer path: Frobenius norm of (alpha / rank) * A @ B} for every layer with LoRA enabled
    (a mixture of experts' stacked kernels: {kernel path: the norm over its experts}; empty for
    a model without LoRA)."""
    out = {}
    for layer in _lora_layers(module):
        if expert_lora.spec_of(layer) is not None:
            spec = expert_lora.spec_of(layer)
            for name in layer.lora_kernels:
                path = getattr(layer, spec.kernels[name]).path
                out[path] = float(jnp.linalg.norm(expert_lora.delta(layer, name).ravel()))
        else:
            out[layer.path] = float(jnp.linalg.norm(model.lora_delta(layer).ravel()))
    return out


def merge_lora(module) -> list[str]:
    """Fold every LoRA delta into its base kernel, in place (the kernel keeps its dtype), remove the
    adapters and make every layer trainable again: the module becomes a plain model, whose config
    and saved weights have no trace of LoRA. Returns the merged layers' paths."""
    merged = []
    for layer in _lora_layers(module):
        if expert_lora.spec_of(layer) is not None:  # stacked experts' factors
            expert_lora.merge(layer)
            merged.append(layer.path)
            continue
        kernel = layer._kernel
        kernel.assign((jnp.asarray(kernel.value, jnp.float32) + model.lora_delta(layer)).astype(kernel.dtype))
        adapters = {id(layer.lora_kernel_a), id(layer.lora_kernel_b)}
        layer._tracker.unlock()
        for name in ("_trainable_variables", "_non_trainable_variables"):
            setattr(layer, name, [v for v in getattr(layer, name) if id(v) not in adapters])
        for name in ("lora_kernel_a", "lora_kernel_b"):
            object.__delattr__(layer, name)
        layer._tracker.lock()
        object.__setattr__(layer, "lora_enabled", False)
        object.__setattr__(layer, "lora_rank", None)
        object.__setattr__(layer, "lora_alpha", None)
        merged.append(layer.path)
    if merged:
        module = _keras(module)
        module.trainable = True  # enable_lora froze every layer; a plain model trains everything
        for layer in module._flatten_layers(include_self=False):
            layer.trainable = True
    return merged


def policy_reference_diff(policy_module, reference_module) -> dict[str, float]:
    """{variable path: ||policy - reference|| / ||reference||} (relative L2; the absolute norm
    where the reference is zero) for two modules of the same architecture. Merge LoRA first
    to compare a LoRA policy's effective weights."""
    policy, reference = _variables(policy_module), _variables(reference_module)
    if policy.keys() != reference.keys():
        only = sorted(set(policy) ^ set(reference))
        raise ValueError(f"the modules have different variables, e.g. {only[:3]}")
    out = {}
    for path, ref in reference.items():
        p, r = np.asarray(policy[path], np.float64), np.asarray(ref, np.float64)
        if p.shape != r.shape:
            raise ValueError(f"{path}: shapes differ, {p.shape} vs {r.shape}")
        denom = np.linalg.norm(r)
        diff = np.linalg.norm(p - r)
        out[path] = float(diff / denom if denom > 0 else diff)
    return out


def show_state(module) -> str:
    """HTML rendering of the module's NNX state with treescope (collapsible tree, array summaries);
    in a notebook, ``IPython.display.HTML(show_state(m))`` or ``treescope.display(nnx.state(m))``."""
    import treescope

    return treescope.render_to_html(nnx.state(module), roundtrip_mode=False)
