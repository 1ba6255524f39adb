"""Random initialisation a block of rows at a time, for ``tools.make_preset``'s real-size presets.

JAX's partitionable threefry (its default) draws a tensor with temporaries of ~8x its size in
bfloat16: Gemma 4 E4B's per-layer embedding (262,144 x 10,752, 5.6 GB) asked for a 45 GB buffer.
Within ``by_blocks()``, a variable of at least ``BLOCK_BYTES`` is drawn from the distribution its
Keras initializer gives the whole shape (the fans of the whole tensor, not of a block), a block
of rows at a time, into an unlinked temporary file mapped in memory (``file_backed``), which JAX
takes without a copy: its pages are the page cache's, written back and dropped under memory
pressure, so the model need not fit in memory beside the copies Keras makes while saving it
(E4B: 14.9 GB of bfloat16 on a 23 GB host, whose save copies each tensor once more). Smaller
variables are drawn as before.
"""

from __future__ import annotations

import contextlib
import math
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_BYTES = 1 << 30
ROWS_BYTES = 1 << 26  # ~64 MB drawn per block


def distribution(initializer, shape) -> tuple[str, float, float] | None:
    """What ``initializer`` draws for ``shape``: ("normal", mean, std), ("truncated", mean, std)
    (cut at 2 std, as Keras' truncated normal), ("uniform", low, high); None for an initializer
    this module does not know (then drawn whole, as Keras does)."""
    from keras import initializers as ki
    from keras.src.initializers.random_initializers import compute_fans

    if isinstance(initializer, ki.VarianceScaling):
        fans = compute_fans(shape, initializer.input_axes, initializer.output_axes)
        fan = {"fan_in": fans[0], "fan_out": fans[1]}.get(initializer.mode, sum(fans) / 2)
        scale = initializer.scale / max(1.0, fan)
        if initializer.distribution == "truncated_normal":
            return "truncated", 0.0, math.sqrt(scale) / 0.87962566103423978
        if initializer.distribution == "untruncated_normal":
            return "normal", 0.0, math.sqrt(scale)
        return "uniform", -math.sqrt(3 * scale), math.sqrt(3 * scale)
    if isinstance(initializer, ki.TruncatedNormal):
        return "truncated", initializer.mean, initializer.stddev
    if isinstance(initializer, ki.RandomNormal):
        return "normal", initializer.mean, initializer.stddev
    if isinstance(initializer, ki.RandomUniform):
        return "uniform", initializer.minval, initializer.maxval
    return None


def file_backed(shape, dtype) -> np.ndarray:
    """Zeros of ``shape`` in an unlinked temporary file mapped in memory (gone with the array)."""
    return np.memmap(tempfile.TemporaryFile(), dtype, "w+", shape=tuple(shape))


def draw(kind: tuple[str, float, float], shape, dtype, key) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` drawn from ``kind`` (``distribution``) a block of
    leading-axis rows at a time, each block from its own fold of ``key``, in ``file_backed``
    pages."""
    name, a, b = kind
    out = file_backed(shape, dtype)
    row = math.prod(shape[1:]) * out.itemsize
    rows = max(1, ROWS_BYTES // max(row, 1))

    @jax.jit
    def block(key):  # in float32, then cast (a bfloat16 draw has ~128 distinct values)
        size = (rows, *shape[1:])
        if name == "uniform":
            return jax.random.uniform(key, size, minval=a, maxval=b).astype(dtype)
        cut = jax.random.truncated_normal(key, -2, 2, size) if name == "truncated" else (
            jax.random.normal(key, size))
        return (a + b * cut).astype(dtype)

    for i, start in enumerate(range(0, shape[0], rows)):
        part = np.asarray(block(jax.random.fold_in(key, i)))
        out[start:start + rows] = part[: shape[0] - start]
    return out


@contextlib.contextmanager
def by_blocks(seed: int = 0):
    """Variables of at least ``BLOCK_BYTES`` made within the block are drawn by ``draw`` (keys
    from ``seed`` and the order they are made in); the others by their own initializer."""
    from keras.src.backend.jax import core

    cls = core.NnxVariable
    original = cls._initialize_with_initializer
    made = [0]

    def sampled(self, initializer):
        shape, dtype = tuple(self._shape), jnp.dtype(self._dtype)
        kind = distribution(initializer, shape) if shape else None
        if kind is None or math.prod(shape) * dtype.itemsize < BLOCK_BYTES:
            return original(self, initializer)
        made[0] += 1
        key = jax.random.fold_in(jax.random.key(seed), made[0])
        self._initialize(jax.device_put(draw(kind, shape, dtype, key)))

    cls._initialize_with_initializer = sampled
    try:
        yield
    finally:
        cls._initialize_with_initializer = original
