"""The decoder blocks' projections (KerasHub's ``EinsumDense`` / ``Dense`` layers) with a weight
gradient computed as one 2-D matmul.

The forward pass is the layer's own (``keras.ops.einsum`` / ``matmul`` on the same operands), and
so is the input gradient (its ``jax.vjp``). What differs is the kernel gradient: autodiff
transposes an einsum such as ``btd,df->btf`` into a ``dot_general`` that contracts the batch and
time axes of the activation and of the output gradient; XLA:CPU lays that out by transposing the
output gradient (fused into the elementwise backward before it, e.g. GELU's, where the strided
writes made each such fusion of a medium-size MLP cost as much as its matmul). Here the kernel
gradient is ``x[rows, contracted]^T @ dy[rows, out]``, the operands reshaped, not transposed,
for every equation where the rows (axes of the input that the kernel does not have) come first,
which is every projection of the supported families; other equations keep autodiff's gradient.
A LoRA layer adds its adapters' term from the factors, ``(x A) B``, to the base kernel's product
(``_lora_term``), where Keras' own call multiplies by ``W + A B``, a kernel-size tensor.

``overridden(module)`` shadows ``call`` on those layers of every decoder block for the duration
of a forward pass (``blocks.shadowed``: on the instances; the classes are untouched).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from nnx_posttrain.model.blocks import decoder_blocks, shadowed


@functools.lru_cache(maxsize=None)
def _plan(equation: str):
    """(x's axes, w's axes, rows, contracted, kernel outputs) of a ``x,w->out`` einsum whose
    kernel gradient is one matmul, or None (autodiff's gradient). The output must be exactly the
    rows (x's axes the kernel lacks) then the kernel's own axes, in their operands' order: that
    excludes an axis shared by all three, an axis summed within one operand and reordered outputs."""
    if "..." in equation or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    if inputs.count(",") != 1:
        return None
    x, w = inputs.split(",")
    if len(set(x)) != len(x) or len(set(w)) != len(w) or len(set(out)) != len(out):
        return None
    rows = [a for a in x if a not in w]
    contracted = [a for a in x if a in w and a not in out]
    kernel_out = [a for a in w if a not in x]
    if list(out) != rows + kernel_out:
        return None
    return x, w, rows, contracted, kernel_out


def _kernel_gradient(equation, x, dy, w_shape, w_dtype):
    x_axes, w_axes, rows, contracted, kernel_out = _plan(equation)
    size = dict(zip(x_axes, x.shape)) | dict(zip(w_axes, w_shape))
    order = [x_axes.index(a) for a in rows + contracted]
    if order != sorted(order):
        x = jnp.transpose(x, order)
    r = math.prod(size[a] for a in rows)
    x2 = x.reshape(r, math.prod(size[a] for a in contracted))
    dy2 = dy.reshape(r, math.prod(size[a] for a in kernel_out))
    dw = jnp.matmul(x2.T, dy2).reshape([size[a] for a in contracted + kernel_out])
    perm = [(contracted + kernel_out).index(a) for a in w_axes]
    if perm != sorted(perm):
        dw = jnp.transpose(dw, perm)
    return dw.astype(w_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def contract(equation: str, x, w):
    """``keras.ops.einsum(equation, x, w)``, with the kernel gradient as one 2-D matmul."""
    import keras

    return keras.ops.einsum(equation, x, w)


def _forward(equation, x, w):
    return contract(equation, x, w), (x, w)


def _backward(equation, residuals, dy):
    import keras

    x, w = residuals
    _, x_vjp = jax.vjp(lambda x_: keras.ops.einsum(equation, x_, w), x)
    (dx,) = x_vjp(dy)
    return dx, _kernel_gradient(equation, x, dy, w.shape, w.dtype)


contract.defvjp(_forward, _backward)


def _matmul_equation(ndim: int) -> str:
    """``Dense``'s ``matmul(x, kernel)`` as an einsum over an input of ``ndim`` axes."""
    rows = "abcefg"[: ndim - 1]
    return f"{rows}d,dz->{rows}z"


def _equation(layer, ndim: int) -> str:
    """The einsum ``layer`` computes on an input of ``ndim`` axes."""
    import keras

    if isinstance(layer, keras.layers.EinsumDense):
        return layer.equation
    return _matmul_equation(ndim)


def _factored(layer, equation: str) -> bool:
    """Whether ``layer``'s LoRA term can be computed from its factors: LoRA is on and the
    kernel's last axis is the output's last (the factor B maps the rank to it)."""
    if not getattr(layer, "lora_enabled", False):
        return False
    inputs, out = equation.replace(" ", "").split("->")
    return inputs.split(",")[1][-1] == out[-1]


def _lora_term(layer, equation: str, x):
    """``(alpha / rank) * (x A) B`` in the layer's compute dtype: the adapters' share of the
    output from the factors (as Keras computes it for a quantized kernel), never the full-size
    ``A B`` that the layer's own ``kernel`` adds to its base kernel (a float32 tensor of the
    kernel's size per layer and call, and its gradient, for every adapted projection)."""
    import keras

    a = keras.ops.convert_to_tensor(layer.lora_kernel_a)  # kernel.shape[:-1] + (rank,)
    b = keras.ops.convert_to_tensor(layer.lora_kernel_b)  # (rank, kernel.shape[-1])
    term = keras.ops.matmul(keras.ops.einsum(equation, x, a), b)
    return keras.ops.cast(term * (layer.lora_alpha / layer.lora_rank), layer.compute_dtype)


def _projection_call(layer, original):
    """``layer.call`` (an ``EinsumDense`` or ``Dense``) with its product through ``contract``
    (with LoRA: the base kernel's, plus the adapters' term from their factors, ``_lora_term``);
    the bias and activation as the layer applies them."""
    import keras

    def call(inputs, *args, **kwargs):
        equation = _equation(layer, len(inputs.shape))
        if _plan(equation) is None:
            return original(inputs, *args, **kwargs)
        x = keras.ops.convert_to_tensor(inputs)
        if _factored(layer, equation):
            base = keras.ops.cast(keras.ops.convert_to_tensor(layer._kernel), layer.compute_dtype)
            out = keras.ops.add(contract(equation, x, base), _lora_term(layer, equation, x))
        else:
            out = contract(equation, x, keras.ops.convert_to_tensor(layer.kernel))  # autocast
        if layer.bias is not None:
            out = keras.ops.add(out, layer.bias)
        if layer.activation is not None:
            out = layer.activation(out)
        return out

    return call


def projections(block) -> list:
    """The unquantized ``EinsumDense`` / ``Dense`` layers inside a decoder block."""
    import keras

    calls = (keras.layers.EinsumDense.call, keras.layers.Dense.call)  # not a subclass' own call
    return [layer for layer in block._flatten_layers(include_self=False, recursive=True)
            if type(layer).call in calls and layer.quantization_mode is None]


@contextlib.contextmanager
def overridden(module):
    """While active, every projection of every decoder block of ``module`` computes its kernel
    gradient as one matmul (``contract``); forward values and input gradients are the layers'
    own."""
    layers = [layer for block in decoder_blocks(module) for layer in projections(block)]
    with shadowed(layers, "call", _projection_call) as patched:
        yield patched
