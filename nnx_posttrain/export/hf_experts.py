"""LoRA on stacked experts (``model.expert_lora``) as PEFT adapters (``--adapters-only``).

transformers 5.24 holds a MoE family's experts as 3-D parameters of one module (GPT-OSS's and
Mixtral's ``mlp.experts.gate_up_proj`` / ``down_proj``, Gemma 4's ``experts.*``), whatever its
checkpoints' names, and PEFT (0.21.2 verified) adapts such a parameter through
``LoraConfig.target_parameters`` (``peft.tuners.lora.ParamWrapper``). For a parameter of E
experts and rank R: ``lora_A.weight`` is [E x R, in] (row ``e R + k``: expert-major),
``lora_B.weight`` [out, R x E] (column ``k E + e``: rank-major), and expert e's delta is
``(lora_alpha / R) B_e A_e`` (B_e [out, R], A_e [R, in]), added in the parameter's own layout:
[E, out, in], or [E, in, out] where transformers marks the module ``is_transposed`` (GPT-OSS).
Our factors A [E, in, r], B [E, r, out] (the kernel's [E, in, out], scale alpha / r) are exactly
A_e = A[e]^T, B_e = B[e]^T in either layout (``factors``).

A parameter fusing several kernels (gate | up: Mixtral's w1 / w3, Gemma 4's gate / up) takes
their factors block-diagonally (``fused``: A concatenated over the rank, each B on the diagonal
block of its outputs; a kernel without adapters, zero rows), of rank R = r x the adapted kernels
and ``lora_alpha`` x R / r (``rank_pattern`` / ``alpha_pattern``): alpha / r still, as PEFT
itself converts transformers 4's per-expert adapters of such models.

PEFT wraps a module's targeted parameters one inside another in the order the module declares
them (``PeftExperts.params``): the first innermost, so its keys carry one ``base_layer.`` per
wrapper around it (gate_up_proj's are ``...experts.base_layer.lora_A.weight`` when down_proj is
targeted too).
"""

from __future__ import annotations

import re

import numpy as np

from nnx_posttrain.families.base import ExportError


def factors(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's (lora_A [E R, in], lora_B [out, R E]) of per-expert factors A [E, in, R],
    B [E, R, out]."""
    e, n_in, r = a.shape
    return (np.transpose(a, (0, 2, 1)).reshape(e * r, n_in),
            np.transpose(b, (2, 1, 0)).reshape(b.shape[2], r * e))


def fused(pairs: list, outs: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One pair (A [E, in, R], B [E, R, sum(outs)]) of kernels whose outputs are concatenated:
    ``pairs[i]`` kernel i's (A, B), None where it has no adapters; ``outs[i]`` its outputs."""
    adapted = [p for p in pairs if p is not None]
    a = np.concatenate([p[0] for p in adapted], axis=2)
    b = np.zeros((a.shape[0], a.shape[2], sum(outs)), np.float32)
    rank = offset = 0
    for pair, out in zip(pairs, outs):
        if pair is not None:
            r = pair[1].shape[1]
            b[:, rank:rank + r, offset:offset + out] = pair[1]
            rank += r
        offset += out
    return a, b


def layer_params(layer, peft) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{transformers parameter: (A, B)} of an experts layer's adapted kernels (``peft``: its
    family's ``PeftExperts``)."""
    from nnx_posttrain.model import expert_lora

    attributes = expert_lora.spec_of(layer).kernels
    unmapped = [n for n in layer.lora_kernels if n not in peft.kernels]
    if unmapped:
        raise ExportError(f"--adapters-only: the expert kernel(s) {unmapped} of {layer.path} have "
                          "no verified PEFT parameter")
    out = {}
    for param in peft.params:
        names = sorted((n for n in peft.kernels if peft.kernels[n][0] == param),
                       key=lambda n: peft.kernels[n][1])
        if not any(n in layer.lora_kernels for n in names):
            continue
        pairs = [expert_lora.factors(layer, n) if n in layer.lora_kernels else None
                 for n in names]
        out[param] = fused(pairs, [getattr(layer, attributes[n]).shape[2] for n in names])
    return out


def adapters(layers, peft, decoder_layer) -> tuple[dict, dict, list[str]]:
    """The experts layers' PEFT tensors {key: array}, ranks {``rank_pattern`` key: R} and
    ``target_parameters``; ``decoder_layer(layer)``: the transformers name of the decoder layer
    holding an experts layer (``model.layers.3``)."""
    per_layer = [(decoder_layer(layer), layer_params(layer, peft)) for layer in layers]
    targeted = [p for p in peft.params if any(p in params for _, params in per_layer)]
    tensors, ranks = {}, {}
    for prefix, params in per_layer:
        for param, (a, b) in params.items():
            wrappers = len(targeted) - 1 - targeted.index(param)  # around this parameter's
            key = f"base_model.model.{prefix}.{peft.module}.{'base_layer.' * wrappers}"
            tensors[key + "lora_A.weight"], tensors[key + "lora_B.weight"] = factors(a, b)
            pattern = re.escape(f"{peft.module}.{param}")
            if ranks.setdefault(pattern, a.shape[2]) != a.shape[2]:
                raise ExportError(f"--adapters-only: the layers' {param} adapters differ in rank")
    return tensors, ranks, [f"{peft.module}.{p}" for p in targeted]
