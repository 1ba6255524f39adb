"""A quantized frozen base (QLoRA-style): Keras' own weight-only int8 quantization of every
Dense / EinsumDense / embedding layer, under LoRA, and its inverse for export.

``quantize(module, "int8")`` calls each such layer's ``quantize`` as ``Model.quantize`` does,
with ``Int8QuantizationConfig(activation_quantizer=None)``: each kernel becomes int8 with one
float scale per output channel (per token row for the embedding), activations stay in the
compute dtype (weight-only, as QLoRA's base; Keras' default would quantize activations too).
``while_loading`` does it to each layer as its weights are read from a KerasHub preset, so the
stored-dtype model is never whole in memory. The LoRA factors that
``enable_lora`` adds afterwards are ordinary float variables: Keras' int8 layers add them to the
dequantized product. ``dequantized_into`` writes such a model's effective weights (each int8
kernel divided by its scale, plus its LoRA delta) into an unquantized model of the same
architecture, for export.

``reverse_logits(embedding, h)`` is an int8 embedding's vocabulary projection (Keras'
``ReversibleEmbedding._int8_call(reverse=True)``) a block of vocabulary rows at a time: Keras
multiplies by the whole int8 table, which XLA:CPU converts to float before its dot (no mixed
dot): a float32 copy of a 256,000-token table is 2 GB, and a step holds one per projection and
gradient at once (a gemma_2b-shaped SimPO step: 4.5 GiB of temporaries).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect

import jax
import jax.numpy as jnp
import keras
import numpy as np

from nnx_posttrain import families
from nnx_posttrain.model import expert_lora
from nnx_posttrain.model.lora import lora_delta

MODES = ("none", "int8")
# float32 bytes of the int8 vocabulary table converted at a time by ``reverse_logits``
VOCAB_BLOCK_BYTES = 64 * 2**20


def quantize(module, mode: str) -> int:
    """Quantize ``module``'s Dense / EinsumDense / embedding weights in place (``mode`` 'int8';
    'none' does nothing), those not quantized yet (``while_loading`` may have done some);
    returns how many layers are quantized."""
    if mode not in MODES:
        raise ValueError(f"quantize mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return 0
    skip = skipped(module)
    with _traceable():
        for layer in module._flatten_layers(include_self=False):
            if layer.name not in skip:
                quantize_layer(layer, mode)
    return len(quantized_layers(module))


def _traced(x) -> bool:
    return isinstance(getattr(x, "value", x), jax.core.Tracer)


@contextlib.contextmanager
def _traceable():
    """While active, Keras' int8 quantizer computes in JAX, not numpy, where its input is traced:
    a model built abstractly (``nnx.eval_shape``: ``plan``), whose weights have no values for
    numpy to read (Keras' layers ask for numpy to spare memory; traced, nothing is allocated)."""
    from keras.src import quantizers as package
    from keras.src.quantizers import quantizers as module  # AbsMaxQuantizer's own global

    original = module.abs_max_quantize
    signature = inspect.signature(original)

    def abs_max_quantize(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if _traced(bound.arguments["inputs"]):
            bound.arguments["to_numpy"] = False
        return original(*bound.args, **bound.kwargs)

    module.abs_max_quantize = package.abs_max_quantize = abs_max_quantize
    try:
        yield
    finally:
        module.abs_max_quantize = package.abs_max_quantize = original


def quantized_share(module) -> float:
    """The share of ``module``'s frozen base (its weights but LoRA's factors, in elements) that
    ``quantize(module, "int8")`` would turn to int8: the kernels and tables of the layers it
    quantizes (not their biases, not the layers its family skips: Gemma 4's MLP, 6.15 of E4B's
    13.9 GiB of bfloat16 weights). Read from the variables' shapes (an abstract model too)."""
    skip = skipped(module)

    def size(v) -> int:
        return int(np.prod(v.shape))

    def base(v) -> bool:
        return "lora_kernel" not in v.path

    converted = sum(size(v) for layer in module._flatten_layers(include_self=False)
                    if layer.name not in skip and _quantizable(layer)
                    for v in layer.weights if base(v) and not v.path.endswith("bias"))
    every = sum(size(v) for v in module.weights if base(v))
    return converted / every if every else 0.0


def skipped(backbone) -> tuple[str, ...]:
    """Layer names of ``backbone`` (an instance or its class name) that int8 leaves as they are:
    its family's ``quantize_skip`` (``families``)."""
    family = families.of(backbone)
    return () if family is None else family.quantize_skip


# The layers quantized (Keras' int8 layers; ReversibleEmbedding is an Embedding)
KINDS = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)


def _quantizable(layer) -> bool:
    return (isinstance(layer, KINDS) and not getattr(layer, "quantization_mode", None)
            and not list(layer._flatten_layers(include_self=False)))


def quantize_layer(layer, mode: str) -> bool:
    """Quantize one Dense / EinsumDense / embedding layer (weight-only int8: one scale per
    output channel; an embedding's per token row, a block of rows at a time), as
    ``Model.quantize`` does to each such layer; False (nothing done) for any other layer and
    one already quantized."""
    if not _quantizable(layer):
        return False
    by_rows = isinstance(layer, keras.layers.Embedding)
    # an embedding a block of rows at a time: in one piece (Keras' default quantizer) a
    # 256,000-token table would hold several float32 copies of itself at once
    with _no_collection():
        layer.quantize(mode, config=keras.quantizers.Int8QuantizationConfig(
            weight_quantizer=RowBlockQuantizer(output_of=layer) if by_rows else None,
            activation_quantizer=None))
    return True


@contextlib.contextmanager
def _no_collection():
    """Keras' ``Layer.__delattr__`` runs a full ``gc.collect()`` after deleting each variable
    (the float kernel a layer's ``quantize`` replaces): a pass over every object of the process,
    per layer, which costs seconds in a process that holds many. The deleted kernel is freed by
    its reference count, at once, without it (tests/test_quantize.py checks it): within the
    block, ``gc.collect`` does nothing."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


@contextlib.contextmanager
def while_loading(mode: str, skip: tuple[str, ...] = ()):
    """Within the block, every Dense / EinsumDense / embedding layer whose weights Keras reads
    from a weight file (``load_own_variables``) is quantized (``quantize_layer``) as soon as they
    are read, so a model loads with at most one layer in its stored dtype at a time (a
    gemma_2b-shaped preset: 5 GB of bfloat16 never resident at once). The classes' method is
    put back on exit. Layers named in ``skip`` (``skipped``) load as they are."""
    if mode == "none":
        yield
        return
    originals = {cls: cls.__dict__["load_own_variables"] for cls in KINDS}

    def reading(original):
        def load_own_variables(self, store):
            original(self, store)
            if self.name not in skip:
                quantize_layer(self, mode)
        return load_own_variables

    try:
        for cls, original in originals.items():
            cls.load_own_variables = reading(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.load_own_variables = original


class RowBlockQuantizer(keras.quantizers.AbsMaxQuantizer):
    """Keras' abs-max int8 quantizer along the last axis (one scale per row: an embedding's
    token), computed ``rows`` rows at a time; the same values as in one piece. The untied output
    table of ``output_of`` (a ``ReversibleEmbedding``'s ``reverse_embeddings`` [hidden, vocab],
    which Keras quantizes with the same quantizer) along axis 0 instead, one scale per
    vocabulary column as Keras' own default for it, ``rows`` columns at a time."""

    def __init__(self, rows: int = 8192, output_of=None):
        super().__init__(axis=-1)
        self.rows, self.output_of = rows, output_of

    def __call__(self, x, axis=None, to_numpy=False):
        array = getattr(x, "value", x)
        columns = self.output_of is not None and x is getattr(
            self.output_of, "reverse_embeddings", None)
        axis = 0 if columns else -1
        if _traced(array):  # built abstractly (``plan``): in one piece, nothing allocated
            q, scale = keras.quantizers.abs_max_quantize(
                array, axis, self.value_range, self.output_dtype, self.epsilon)
            return q, keras.ops.cast(scale, str(array.dtype))
        values = np.empty(array.shape, np.int8)
        scales = np.empty((1, array.shape[1]) if columns else (*array.shape[:-1], 1), np.float32)
        for start in range(0, array.shape[1 if columns else 0], self.rows):
            part = (slice(None), slice(start, start + self.rows)) if columns else \
                slice(start, start + self.rows)
            q, scale = keras.quantizers.abs_max_quantize(
                array[part], axis, self.value_range, self.output_dtype, self.epsilon,
                to_numpy=True)
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
    sources = source._flatten_layers(include_self=False)
    targets = target._flatten_layers(include_self=False)  # the same order (not by path: KerasHub
    # names some layers by a process-wide counter, Qwen3-MoE's and Mixtral's MoE blocks)
    if [expert_lora.base_class(l).__name__ for l in sources] != [type(l).__name__ for l in targets]:
        raise ValueError("dequantized_into: the two models' layers differ")
    merged = []
    for layer, into in zip(sources, targets):
        weights = float_weights(layer) if getattr(layer, "quantization_mode", None) else {}
        if weights and getattr(layer, "lora_enabled", False):
            weights["kernel"] = weights["kernel"] + lora_delta(layer)
            merged.append(layer.path)
        elif getattr(layer, "lora_enabled", False) and expert_lora.spec_of(layer) is not None:
            weights = {expert_lora.spec_of(layer).kernels[name]: expert_lora.delta(layer, name)
                       + _f32(getattr(layer, expert_lora.spec_of(layer).kernels[name]))
                       for name in layer.lora_kernels}  # stacked experts: kernel + delta
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


def reverse_logits(embedding, h):
    """``embedding(h, reverse=True)`` (logits [..., vocab], the embedding's compute dtype, after
    its soft cap) for an int8-quantized ``ReversibleEmbedding``, the int8 table read
    ``VOCAB_BLOCK_BYTES`` of float rows at a time (``_int8_projection``), so no float copy of the
    whole table exists, in the forward pass or in the gradient."""
    tied = embedding.tie_weights
    table = jnp.asarray((embedding._embeddings if tied else embedding.reverse_embeddings).value)
    scale = jnp.asarray((embedding.embeddings_scale if tied else
                         embedding.reverse_embeddings_scale).value).reshape(-1)
    logits = _int8_projection(tied, h, table, scale.astype(embedding.compute_dtype))
    cap = embedding.logit_soft_cap
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def _blocks(tied: bool, table):
    """(rows per block, number of blocks, block i -> (its first row, its [rows, width] int8
    weights, its rows' mask: False where the last block overlaps the one before it))."""
    axis = 0 if tied else 1  # the vocabulary's axis of the table: [V, D] tied, [D, V] not
    vocab, width = table.shape[axis], table.shape[1 - axis]
    rows = int(max(1, min(vocab, VOCAB_BLOCK_BYTES // (4 * width))))

    def block(i):
        start = jnp.minimum(i * rows, vocab - rows)
        w = jax.lax.dynamic_slice_in_dim(table, start, rows, axis)
        fresh = start + jnp.arange(rows) >= i * rows
        return start, w if tied else w.T, fresh

    return rows, -(-vocab // rows), block


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int8_projection(tied: bool, h, table, scale):
    """``(h @ table^T) / scale`` (``table`` int8 [V, D] when ``tied``, else [D, V]; ``scale``
    [V] in the compute dtype), as Keras' int8 reverse call computes it, one block of rows at a
    time; the input gradient is summed over blocks in float32, recomputing each block's
    conversion; the table and its scales get none (frozen)."""
    rows, n, block = _blocks(tied, table)
    vocab = scale.shape[0]

    def one(i):
        start, w, _ = block(i)
        logits = jnp.matmul(h, w.astype(h.dtype).T).astype(scale.dtype)  # int8 -> h's, as Keras
        return logits / jax.lax.dynamic_slice_in_dim(scale, start, rows)

    out = jnp.moveaxis(jax.lax.map(one, jnp.arange(n)), 0, -2)  # [..., blocks, rows]
    head = out[..., :-1, :].reshape(*h.shape[:-1], (n - 1) * rows)
    return jnp.concatenate([head, out[..., -1, n * rows - vocab:]], axis=-1)


def _int8_projection_forward(tied, h, table, scale):
    return _int8_projection(tied, h, table, scale), (h, table, scale)


def _int8_projection_backward(tied, residuals, g):
    h, table, scale = residuals
    rows, n, block = _blocks(tied, table)
    g = g.astype(jnp.float32) / scale.astype(jnp.float32)

    def add(i, dh):
        start, w, fresh = block(i)
        g_block = jnp.where(fresh, jax.lax.dynamic_slice_in_dim(g, start, rows, g.ndim - 1), 0.0)
        return dh + jnp.matmul(g_block, w.astype(jnp.float32))

    dh = jax.lax.fori_loop(0, n, add, jnp.zeros(h.shape, jnp.float32))
    return dh.astype(h.dtype), None, None


_int8_projection.defvjp(_int8_projection_forward, _int8_projection_backward)
