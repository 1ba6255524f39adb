"""A quantized frozen base (QLoRA-style): Keras' own weight-only int8 quantization of every
Dense / EinsumDense / embedding layer, under LoRA, and its inverse for export.

``quantize(module, "int8")`` calls ``Model.quantize`` with ``Int8QuantizationConfig(
activation_quantizer=None)``: each kernel becomes int8 with one float scale per output channel
(per token row for the embedding), activations stay in the compute dtype (weight-only, as
QLoRA's base; Keras' default would quantize activations too). The LoRA factors that
``enable_lora`` adds afterwards are ordinary float variables: Keras' int8 layers add them to the
dequantized product. ``dequantized_into`` writes such a model's effective weights (each int8
kernel divided by its scale, plus its LoRA delta) into an unquantized model of the same
architecture, for export.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import keras

from nnx_posttrain.model.lora import lora_delta

MODES = ("none", "int8")


def quantize(module, mode: str) -> int:
    """Quantize ``module``'s Dense / EinsumDense / embedding weights in place (``mode`` 'int8';
    'none' does nothing); returns how many layers were quantized."""
    if mode not in MODES:
        raise ValueError(f"quantize mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return 0
    config = keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
    with warnings.catch_warnings():  # norms, rotary embeddings...: nothing to quantize, rightly
        warnings.filterwarnings("ignore", message=".*does not have a `quantize` method")
        module.quantize(mode, config=config)
    return len(quantized_layers(module))


def quantized_layers(module) -> list:
    return [layer for layer in module._flatten_layers(include_self=False)
            if getattr(layer, "quantization_mode", None)]


def float_weights(layer) -> dict[str, jnp.ndarray]:
    """{variable name: float32 value} of an int8 layer's quantized weights, dequantized as its
    ``_int8_call`` computes with them (the int8 values divided by their scale)."""
    if isinstance(layer, keras.layers.Embedding):  # ReversibleEmbedding included
        out = {"embeddings": _f32(layer._embeddings) / _f32(layer.embeddings_scale)[:, None]}
        if getattr(layer, "reverse_embeddings", None) is not None and not layer.tie_weights:
            out["reverse_embeddings"] = (_f32(layer.reverse_embeddings)
                                         / _f32(layer.reverse_embeddings_scale))
        return out
    scale = _f32(layer.kernel_scale)
    if isinstance(layer, keras.layers.EinsumDense):
        scale = _f32(layer._adjust_scale_for_dequant(layer.kernel_scale))
    return {"kernel": _f32(layer._kernel) / scale}


def _f32(variable):
    return jnp.asarray(getattr(variable, "value", variable), jnp.float32)


def dequantized_into(source, target) -> list[str]:
    """Write ``source``'s effective weights into ``target``, an unquantized model of the same
    architecture (int8 layers dequantized, LoRA deltas added; every other variable copied);
    returns the paths of the layers whose LoRA delta was merged."""
    targets = {layer.path: layer for layer in target._flatten_layers(include_self=False)}
    merged = []
    for layer in source._flatten_layers(include_self=False):
        into = targets[layer.path]
        weights = float_weights(layer) if getattr(layer, "quantization_mode", None) else {}
        if weights and getattr(layer, "lora_enabled", False):
            weights["kernel"] = weights["kernel"] + lora_delta(layer)
            merged.append(layer.path)
        own = {v.name: v for v in [*layer._trainable_variables, *layer._non_trainable_variables]}
        for variable in [*into._trainable_variables, *into._non_trainable_variables]:
            if variable.name in weights or variable.name not in own:
                continue
            variable.assign(jnp.asarray(own[variable.name].value).astype(variable.dtype))
        for name, value in weights.items():
            variable = into._kernel if name == "kernel" else getattr(into, name)
            variable.assign(value.astype(variable.dtype))
    return merged
