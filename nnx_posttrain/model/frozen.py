"""Frozen bfloat16 weights without float32 copies across a step (XLA:CPU).

XLA:CPU has no bfloat16 matmul: it converts each bfloat16 weight to float32 before its dot.
Those conversions depend only on the step's inputs, so XLA computes them all at the start of the
step and shares each between the forward and the backward pass: a float32 copy of every frozen
weight is alive across the whole step, twice the bfloat16 model (measured on a gemma_2b-shaped
preset: more memory with ``--dtype bfloat16-params`` than with float32).

``lazy_frozen_call(block, call)`` runs a decoder block as a ``jax.custom_vjp`` whose forward
pass and backward pass (a recomputation of the block, as ``jax.checkpoint``) each read the
block's frozen weights through a dependency on their own data (the block's input, then the
incoming cotangent): a conversion cannot be hoisted before the block runs, nor shared between
the two passes, so at most a block's weights exist in float32 at a time. The dependency is an
exact no-op (``w + 0 * s`` with ``s`` a finite sum... made exactly zero by ``stop_gradient`` of
a product with 0 in float32, added in the weight's dtype). Trainable variables (LoRA factors,
full fine-tuning) get their gradients as usual.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

# Weights smaller than this are not worth a tie (norm scales, biases).
_MIN_SIZE = 1 << 16


def _tied(values, anchor):
    """``values`` (frozen weights) made to depend on ``anchor`` without changing them."""
    zero = jnp.zeros((), jnp.float32) * jnp.sum(jnp.ravel(anchor)[:1].astype(jnp.float32))
    zero = jax.lax.stop_gradient(jnp.where(jnp.isfinite(zero), zero, 0.0))
    return [v + zero.astype(v.dtype) if v.size >= _MIN_SIZE else v for v in values]


def lazy_frozen_call(block, call):
    """``call`` (the block's bound ``call``) recomputed in the backward pass, its frozen
    weights read lazily (see the module docstring). Only array arguments are traced."""

    def wrapper(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
        variables = list(block.weights)
        trainable = [v for v in variables if v.trainable]
        frozen = [v for v in variables if not v.trainable]

        def pure(arrays, t_values, f_values):
            full = list(leaves)
            for i, x in zip(where, arrays):
                full[i] = x
            a, k = jax.tree.unflatten(treedef, full)
            mapping = list(zip(trainable, t_values)) + list(zip(frozen, f_values))
            with keras.StatelessScope(state_mapping=mapping):
                return call(*a, **k)

        @jax.custom_vjp
        def run(arrays, t_values, f_values):  # not differentiated (a frozen teacher): tied too
            return pure(arrays, t_values, _tied(f_values, arrays[0]))

        def forward(arrays, t_values, f_values):
            out = pure(arrays, t_values, _tied(f_values, arrays[0]))
            return out, (arrays, t_values, f_values)

        def backward(res, g):
            arrays, t_values, f_values = res
            anchor = jax.tree.leaves(g)[0]
            f_late = _tied(f_values, anchor)
            _, vjp = jax.vjp(lambda a, t: pure(a, t, f_late), arrays, t_values)
            d_arrays, d_trainable = vjp(g)
            return d_arrays, d_trainable, [jnp.zeros_like(f) for f in f_values]

        run.defvjp(forward, backward)
        arrays = [leaves[i] for i in where]
        return run(arrays, [v.value for v in trainable], [v.value for v in frozen])

    return wrapper
