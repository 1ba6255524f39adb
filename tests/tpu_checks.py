"""What the TPU tier (tests/test_tpu.py) computes on the chip, in one process: opening a TPU costs
10-15 s and one process at a time may hold it, so the checks share one.

    python tests/tpu_checks.py OUT.json                  # on the default platform (the TPU)
    JAX_PLATFORMS=cpu python tests/tpu_checks.py OUT.json --only sampler

Writes {check: result} as JSON; tests/test_tpu.py asserts on it.

- ``splash``: Pallas splash attention compiled for the chip (not interpreted) against the ``xla``
  formulation, values and gradients (q, k, v), unpacked / packed rows, with and without a sliding
  window and a soft cap: the largest absolute difference relative to the largest value.
- ``sampler``: the micro model's greedy completions (the sampler's compiled loop and KV cache),
  float32 at the highest matmul precision, so that the chip and the CPU compute the same sums.
- ``bf16_step``: one SFT loss of the tiny built-in model on the same batch in float32 and in
  ``--dtype bfloat16`` (float32 weights, bfloat16 computation), on this device.
"""

from __future__ import annotations

import json
import sys

import nnx_posttrain  # noqa: F401  (the Keras backend)
import nnx_posttrain.tasks
import jax
import jax.numpy as jnp
import numpy as np

from nnx_posttrain import model
from nnx_posttrain.model import attention

nnx_posttrain.tasks.register()  # the built-in models (gemma_micro, gemma_tiny)

SPLASH_CASES = {"causal": (False, None, None), "packed": (True, None, None),
                "window": (False, 96, None), "packed_window_softcap": (True, 96, 50.0)}


def _qkv(packed: bool, t: int = 256, kv: int = 1, groups: int = 4, head: int = 128):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, t, kv * groups, head)).astype(np.float32)
    k, v = (rng.standard_normal((2, t, kv, head)).astype(np.float32) for _ in range(2))
    pos = np.arange(t)
    seg = (np.stack([np.select([pos < 70, pos < 180, pos < 230], [1, 2, 3], 0),
                     np.where(pos < 130, 1, 2)]) if packed else np.ones((2, t))).astype(np.int32)
    return [jnp.asarray(x) for x in (q, k, v, seg)]


def splash() -> dict:
    """{case: {"values", "grads"}}: relative differences, splash on the chip vs xla."""
    out, interpret = {}, jax.devices()[0].platform == "cpu"  # the CPU runs the kernel interpreted
    for name, (packed, window, cap) in SPLASH_CASES.items():
        q, k, v, seg = _qkv(packed)
        spec = attention.LayerSpec(scale=1 / np.sqrt(q.shape[-1]), soft_cap=cap, window=window)
        weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
        real = (seg != 0)[..., None, None]

        def loss(q, k, v, implementation):
            choice = attention.Choice(implementation, chunk=4096, interpret=interpret)
            o = attention.attend(q, k, v, seg, spec, choice)
            return jnp.sum(jnp.where(real, o * weights, 0.0)), o

        with jax.default_matmul_precision("highest"):
            results = {impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                                     static_argnums=3)(q, k, v, impl)
                       for impl in ("splash", "xla")}
        (_, got), got_grads = results["splash"]
        (_, want), want_grads = results["xla"]
        keep = np.broadcast_to(np.asarray(real), want.shape)
        out[name] = {"values": _relative(np.asarray(got)[keep], np.asarray(want)[keep]),
                     "grads": max(_relative(np.asarray(a), np.asarray(b))
                                  for a, b in zip(got_grads, want_grads))}
    return out


def _relative(got, want) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def sampler() -> dict:
    """The micro model's greedy completions of 4 prompts (16 new tokens)."""
    from flax import nnx

    from nnx_posttrain.sampling import sampler as sampler_lib

    lm = model.load("gemma_micro", seed=0)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, lm.tokenizer.vocab_size, size=(4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # a left-padded prompt
    graphdef, *states = nnx.split(lm.module)
    sample = sampler_lib.make_sampler(graphdef, 16)
    with jax.default_matmul_precision("highest"):
        out = sample(tuple(states), jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                     sampler_lib.Draw(stop_ids=jnp.asarray([-1], jnp.int32)))
    return {"tokens": np.asarray(out["completion_ids"]).tolist()}


def bf16_step() -> dict:
    """One SFT loss of gemma_tiny on the same batch in float32 and in bfloat16 computation."""
    from nnx_posttrain.algorithms import SFT

    vocab = model.load_tokenizer("gemma_tiny").vocab_size
    ids = np.random.default_rng(0).integers(3, vocab, size=(8, 64)).astype(np.int32)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones(ids.shape, jnp.int32),
             "loss_mask": jnp.ones(ids.shape, jnp.float32).at[:, 0].set(0)}
    losses = {}
    for dtype in ("float32", "bfloat16"):
        lm = model.load("gemma_tiny", dtype=dtype, seed=0)
        algorithm = SFT(SFT.Config(), logprob_chunk=None)
        total, weight, _ = jax.jit(lambda b: algorithm.loss(lm.module, b))(batch)
        losses[dtype] = float(total / weight)
    return {"losses": losses, "platform": jax.devices()[0].platform}


CHECKS = {"splash": splash, "sampler": sampler, "bf16_step": bf16_step}


def main(argv: list[str]) -> None:
    out_path, only = argv[0], argv[argv.index("--only") + 1] if "--only" in argv else None
    results = {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind}
    for name, check in CHECKS.items():
        if only in (None, name):
            results[name] = check()
            print(name, json.dumps(results[name])[:300], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
