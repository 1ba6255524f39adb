"""Throughput of the KV-cache sampler: ``python -m tools.bench.sampler [--model gemma_tiny]
[--batch 16] [--new-tokens 64] [--prompt-len 32] [--repeats 5]``.

Greedy decoding of the same batch of prompts (random token ids, all ``--prompt-len`` long, no stop
token so every row generates ``--new-tokens``) by three decoders of the same weights, timed in one
process after a warm-up call (median of ``--repeats``):

- ``sampler``: ``nnx_posttrain.sampling.sampler.make_sampler`` (compiled loop, KV cache);
- ``kerashub``: KerasHub's own ``CausalLM.generate`` (greedy sampler, its KV cache);
- ``no-cache``: a plain compiled argmax loop that runs the whole buffer through the model for
  every new token (the evaluation decoder before the sampler);
- ``tunix`` (with ``--tunix-python``, in its own process and environment): Tunix's
  ``tunix.generate.sampler.Sampler`` (KV cache) on ``tunix.models.gemma`` with the same dimensions
  and weights (exported with KerasHub's Hugging Face exporter, read by Tunix's loader), prompts
  passed as text of the same token ids; its call includes that trivial tokenisation and the
  detokenisation of its output, as its API does.

``--spec SIZE`` (a ``tools.bench`` size, e.g. ``gemma_2b``) decodes with a random model of that
size in bfloat16 instead of ``--model`` (``--device tpu``: the chip), both sides with random
weights (no export: the agreement column is not compared); Tunix's side then runs first, in its
own process, before this one opens the chip (one process at a time may hold a TPU).

``--temperature T`` (> 0) samples instead of greedy decoding (Tunix: ``top_p=1.0``, the only way
it samples), as a GRPO rollout does (``--batch 64``); the agreement column is then not compared.
``--record NAME`` writes the table to ``results/NAME.json`` (``tools.results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import jax
import jax.numpy as jnp
import keras_hub
import numpy as np
from flax import nnx

from nnx_posttrain import model, tasks
from nnx_posttrain.sampling import sampler

tasks.register()  # the built-in models


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
    parser.add_argument("--spec", default=None, help="a tools.bench size: a random bfloat16 "
                        "model of its dimensions instead of --model (e.g. gemma_2b)")
    parser.add_argument("--device", choices=("cpu", "gpu", "tpu"), default=None,
                        help="where to decode (default: JAX's default device)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], choices=["kerashub", "no-cache"])
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--tunix-python", default=None,
                        help="the Python of an environment with Tunix: adds Tunix's sampler")
    parser.add_argument("--record", default=None, metavar="NAME",
                        help="write the table to results/NAME.json (tools.results)")
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("--json", default=None, help="also write the measurement to this file")
    args = parser.parse_args(argv)
    greedy = args.temperature == 0
    if args.device:
        jax.config.update("jax_platforms", {"gpu": "cuda"}.get(args.device, args.device))
    batch, width, n = args.batch, args.prompt_len, args.new_tokens
    rng = np.random.default_rng(0)
    if args.spec:  # a random model of a benchmark size; Tunix first (the chip is then free)
        from tools.bench import run as bench
        from tools.bench.ours import build_task

        spec = bench.spec_of(args.spec)
        ids = rng.integers(3, spec["vocab"], size=(batch, width)).astype(np.int32)
        ids[:, 0] = 2  # Gemma's bos
        tunix = _tunix_random(spec, ids, n, args) if args.tunix_python else None
        lm, args.skip = _Random(build_task(spec, "bfloat16-params")), ["kerashub", "no-cache"]
        label = f"{args.spec} (random, bfloat16)"
    else:
        lm, tunix, label = model.load(args.model), None, args.model
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
        out = sample(states, d_ids, d_mask, key, sampler.Draw(args.temperature, 1.0, no_stop))
        ours_ids = out["completion_ids"]
        return out

    fns = {"sampler": ours}

    if "kerashub" not in args.skip and greedy:
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

    if "no-cache" not in args.skip and greedy:
        greedy = make_no_cache_greedy(graphdef, n)
        nc = {}

        def no_cache():
            nc["ids"] = greedy(states, d_ids, d_mask)
            return nc["ids"]

        fns["no-cache"] = no_cache

    seconds = _time_all(fns, args.repeats)
    notes = list(args.note)
    if args.tunix_python and not args.spec:
        tunix = _tunix(lm, ids, n, args)
    if tunix is not None and "seconds" in tunix:
        seconds["tunix"] = tunix["seconds"]
        if not tunix.get("same_weights"):
            notes.append("Tunix: " + tunix.get("weights_note", "weights differ"))
    elif tunix is not None:
        notes.append(f"Tunix side failed: {tunix.get('error')}")
        print(tunix.get("log_tail", ""))
    agree = {}
    if tunix is not None and "completion_ids" in tunix and greedy and tunix.get("same_weights"):
        agree["tunix"] = float(np.mean(np.asarray(tunix["completion_ids"]) == np.asarray(ours_ids)))
    if "kerashub" in fns:
        task.preprocessor = preprocessor
        agree["kerashub"] = float(np.mean(np.asarray(kh_out["ids"])[:, width:] == np.asarray(ours_ids)))
    if "no-cache" in fns:
        agree["no-cache"] = float(np.mean(np.asarray(nc["ids"]) == np.asarray(ours_ids)))

    tokens = batch * n
    mode = "greedy" if greedy else f"temperature {args.temperature:g}"
    print(f"{label} on {jax.devices()[0].platform}: batch {batch}, prompt {width}, "
          f"{n} new tokens, {mode}, median of {args.repeats}")
    print(f"{'decoder':<10} {'seconds':>9} {'tokens/s':>10} {'time/sampler':>13} {'same tokens':>12}")
    rates, rows = {}, []
    for name, sec in seconds.items():
        rates[name] = tokens / sec
        same = f"{agree[name]:.1%}" if name in agree else "-"
        ratio = seconds[name] / seconds["sampler"]
        print(f"{name:<10} {sec:>9.4f} {rates[name]:>10.0f} {ratio:>12.2f}x {same:>12}")
        rows.append([label, str(batch), mode, name, f"{sec:.4f}", f"{rates[name]:,.0f}",
                     f"{ratio:.2f}x", same])
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"argv": argv if argv is not None else sys.argv[1:], "label": label, "batch": batch,
             "prompt": width, "new_tokens": n, "mode": mode, "seconds": seconds,
             "agreement": agree, "notes": notes, "device_kind": jax.devices()[0].device_kind},
            indent=1))
    if args.record:
        from tools import results as readme

        command = "python -m tools.bench.sampler " + " ".join(argv if argv is not None else sys.argv[1:])
        readme.record(args.record, command,
                      ["model", "batch", "decoding", "decoder", "seconds", "tokens/s",
                       "time / ours", "same tokens as ours"], rows, notes,
                      {"seconds": seconds, "prompt": width, "new_tokens": n})
    return rates


class _Random:
    """A benchmark task of random weights as ``model.load``'s ``LanguageModel`` is read here."""

    def __init__(self, task):
        self.task, self.module = task, task.backbone


def _tunix_random(spec: dict, ids, new_tokens: int, args) -> dict:
    """Tunix's sampler on a random bfloat16 model of ``spec``'s size, in its own process."""
    from tools.bench import run as bench

    with tempfile.TemporaryDirectory(prefix="bench_sampler_") as tmp:
        np.save(Path(tmp) / "prompts.npy", ids)
        return bench._run_worker(
            "tools.bench.tunix_side",
            ["--spec", json.dumps(spec), "--sample", str(Path(tmp) / "prompts.npy"),
             "--new-tokens", str(new_tokens), "--repeats", str(args.repeats), "--temperature",
             str(args.temperature), "--dtype", "bfloat16", "--device", args.device or "cpu"],
            1800, python=args.tunix_python)


def _tunix(lm, ids, new_tokens: int, args) -> dict:
    """Tunix's sampler on the same prompts and weights, in its own process (tools.bench.tunix_side)."""
    from tools.bench import run as bench

    bb = lm.module
    spec = dict(vocab=bb.vocabulary_size, hidden_dim=bb.hidden_dim, num_layers=bb.num_layers,
                num_query_heads=bb.num_query_heads, num_key_value_heads=bb.num_key_value_heads,
                head_dim=bb.head_dim, intermediate_dim=bb.intermediate_dim)
    with tempfile.TemporaryDirectory(prefix="bench_sampler_") as tmp:
        lm.task.export_to_transformers(str(Path(tmp) / "hf"))
        np.save(Path(tmp) / "prompts.npy", ids)
        return bench._run_worker(
            "tools.bench.tunix_side",
            ["--spec", json.dumps(spec), "--hf-dir", str(Path(tmp) / "hf"), "--sample",
             str(Path(tmp) / "prompts.npy"), "--new-tokens", str(new_tokens), "--repeats",
             str(args.repeats), "--temperature", str(args.temperature)], 1800,
            python=args.tunix_python)


if __name__ == "__main__":
    main()
