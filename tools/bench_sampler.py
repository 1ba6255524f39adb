"""Throughput of the KV-cache sampler: ``python -m tools.bench_sampler [--model gemma_tiny]
[--batch 16] [--new-tokens 64] [--prompt-len 32] [--repeats 5]``.

Greedy decoding of the same batch of prompts (random token ids, all ``--prompt-len`` long, no stop
token so every row generates ``--new-tokens``) by three decoders of the same weights, timed in one
process after a warm-up call (median of ``--repeats``):

- ``sampler``: ``nnx_posttrain.sampling.sampler.make_sampler`` (compiled loop, KV cache);
- ``kerashub``: KerasHub's own ``CausalLM.generate`` (greedy sampler, its KV cache);
- ``no-cache``: a plain compiled argmax loop that runs the whole buffer through the model for
  every new token (the evaluation decoder before the sampler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import jax
import jax.numpy as jnp
import keras_hub
import numpy as np
from flax import nnx

from nnx_posttrain import model
from nnx_posttrain import tasks  # noqa: F401  (registers the built-in models)
from nnx_posttrain.sampling import sampler


def make_no_cache_greedy(graphdef, max_new_tokens: int):
    """Plain reference decoder: left-padded buffer [B, P + N], full forward per token."""

    @jax.jit
    def greedy(states, ids, mask):
        module = nnx.merge(graphdef, *states)
        batch, width = ids.shape
        tokens = jnp.concatenate([ids, jnp.zeros((batch, max_new_tokens), ids.dtype)], 1)
        masks = jnp.concatenate([mask, jnp.zeros((batch, max_new_tokens), mask.dtype)], 1)

        def step(j, carry):
            tokens, masks = carry
            h = model.hidden_states(module, tokens, masks)
            last = jax.lax.dynamic_slice_in_dim(h, width + j - 1, 1, axis=1)
            logits = module.token_embedding(last, reverse=True)[:, 0].astype(jnp.float32)
            nxt = jnp.argmax(logits, -1).astype(tokens.dtype)
            tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], width + j, axis=1)
            masks = jax.lax.dynamic_update_slice_in_dim(masks, jnp.ones_like(nxt)[:, None],
                                                        width + j, axis=1)
            return tokens, masks

        tokens, _ = jax.lax.fori_loop(0, max_new_tokens, step, (tokens, masks))
        return tokens[:, width:]

    return greedy


def _time_all(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, after a warm-up call (compilation); the repeats
    are interleaved so that a change of machine load hits every decoder alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma_tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], choices=["kerashub", "no-cache"])
    args = parser.parse_args(argv)

    lm = model.load(args.model)
    batch, width, n = args.batch, args.prompt_len, args.new_tokens
    rng = np.random.default_rng(0)
    ids = rng.integers(3, lm.tokenizer.vocab_size, size=(batch, width)).astype(np.int32)
    if lm.tokenizer.bos_id is not None:
        ids[:, 0] = lm.tokenizer.bos_id
    mask = np.ones_like(ids)
    graphdef, *states = nnx.split(lm.module)
    states = tuple(states)
    no_stop = np.array([-1], np.int32)

    sample = sampler.make_sampler(graphdef, n)
    d_ids, d_mask, key = jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0)
    ours_ids = None

    def ours():
        nonlocal ours_ids
        out = sample(states, d_ids, d_mask, key, 0.0, 1.0, no_stop)
        ours_ids = out["completion_ids"]
        return out

    fns = {"sampler": ours}

    if "kerashub" not in args.skip:
        task = lm.task
        task.sampler = keras_hub.samplers.GreedySampler()
        task.generate_function = None
        preprocessor, task.preprocessor = task.preprocessor, None  # dense ids in, dense ids out
        buf = {"token_ids": np.concatenate([ids, np.zeros((batch, n), np.int32)], 1),
               "padding_mask": np.concatenate([mask, np.zeros((batch, n), np.int32)], 1)}
        kh_out = {}

        def kerashub():
            kh_out["ids"] = task.generate(buf, stop_token_ids=None)["token_ids"]
            return kh_out["ids"]

        fns["kerashub"] = kerashub

    if "no-cache" not in args.skip:
        greedy = make_no_cache_greedy(graphdef, n)
        nc = {}

        def no_cache():
            nc["ids"] = greedy(states, d_ids, d_mask)
            return nc["ids"]

        fns["no-cache"] = no_cache

    seconds = _time_all(fns, args.repeats)
    agree = {}
    if "kerashub" in fns:
        task.preprocessor = preprocessor
        agree["kerashub"] = float(np.mean(np.asarray(kh_out["ids"])[:, width:] == np.asarray(ours_ids)))
    if "no-cache" in fns:
        agree["no-cache"] = float(np.mean(np.asarray(nc["ids"]) == np.asarray(ours_ids)))

    tokens = batch * n
    print(f"{args.model} on {jax.devices()[0].platform}: batch {batch}, prompt {width}, "
          f"{n} new tokens, greedy, median of {args.repeats}")
    print(f"{'decoder':<10} {'seconds':>9} {'tokens/s':>10} {'time/sampler':>13} {'same tokens':>12}")
    rates = {}
    for name, sec in seconds.items():
        rates[name] = tokens / sec
        same = f"{agree[name]:.1%}" if name in agree else "-"
        print(f"{name:<10} {sec:>9.4f} {rates[name]:>10.0f} {seconds[name] / seconds['sampler']:>12.2f}x "
              f"{same:>12}")
    return rates


if __name__ == "__main__":
    main()
