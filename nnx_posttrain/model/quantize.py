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
import numpy as np

from nnx_posttrain.model.lora import lora_delta

MODES = ("none", "int8")


def quantize(module, mode: str) -> int:
    """Quantize ``module``'s Dense / EinsumDense / embedding weights in place (``mode`` 'int8';
    'none' does nothing); returns how many layers were quantized."""
    if mode not in MODES:
        raise ValueError(f"quantize mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return 0

    def embedding(layer):
        return isinstance(layer, keras.layers.Embedding)

    weights_only = keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
    # an embedding row by row, a block of rows at a time: in one piece (Keras' default quantizer)
    # a 256,000-token table would hold several float32 copies of itself at once
    by_rows = keras.quantizers.Int8QuantizationConfig(weight_quantizer=RowBlockQuantizer(),
                                                      activation_quantizer=None)
    with warnings.catch_warnings():  # norms, rotary embeddings...: nothing to quantize, rightly
        warnings.filterwarnings("ignore", message=".*does not have a `quantize` method")
        module.quantize(mode, config=by_rows, filters=embedding)
        module.quantize(mode, config=weights_only, filters=lambda layer: not embedding(layer))
    return len(quantized_layers(module))


class RowBlockQuantizer(keras.quantizers.AbsMaxQuantizer):
    """Keras' abs-max int8 quantizer along the last axis (one scale per row: an embedding's
    token), computed ``rows`` rows at a time; the same values as in one piece."""

    def __init__(self, rows: int = 8192):
        super().__init__(axis=-1)
        self.rows = rows

    def __call__(self, x, axis=None, to_numpy=False):
        array = getattr(x, "value", x)
        values = np.empty(array.shape, np.int8)
        scales = np.empty((*array.shape[:-1], 1), np.float32)
        for start in range(0, array.shape[0], self.rows):
            part = slice(start, start + self.rows)
            q, scale = keras.quantizers.abs_max_quantize(
                array[part], -1, self.value_range, self.output_dtype, self.epsilon, to_numpy=True)
            values[part], scales[part] = np.asarray(q), np.asarray(scale, np.float32)
        return (keras.ops.convert_to_tensor(values),
                keras.ops.convert_to_tensor(scales, dtype=str(array.dtype)))


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
    scale = (layer._adjust_scale_for_dequant(layer.kernel_scale)
             if isinstance(layer, keras.layers.EinsumDense) else layer.kernel_scale)
    return {"kernel": _f32(layer._kernel) / _f32(scale)}


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
