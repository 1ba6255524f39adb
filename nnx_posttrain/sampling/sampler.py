"""A compiled, batched sampler with a KV cache: rollouts for RL, greedy evaluation, ``nnx-posttrain sample``.

``make_sampler(graphdef, max_new_tokens, top_k=...)`` returns ``sample(states, prompt_ids,
prompt_mask, rng, temperature, top_p, stop_ids)``, compiled once per (batch, prompt width,
``max_new_tokens``, ``top_k``); temperature and top-p are traced, so changing them does not
recompile. Prompts are LEFT-padded: every row's last prompt token sits at column P - 1, so all rows
decode in lock-step and ``[prompt_ids, completion_ids]`` with mask ``[prompt_mask,
completion_mask]`` is exactly the sequence the training side scores with ``model.token_logprobs``
(left pads, prompt, completion, right pads). Rotary embeddings make attention scores depend only
on relative positions, so left padding changes nothing as long as pads are masked out of
attention, which they are here, in the prompt pass and at every decoding step.

The decoding step runs KerasHub's own decoder blocks (projections, Qwen's biases, q/k norms,
rotary embedding, norms, feed-forward, LoRA: as in training) with this package's KV cache and
attention kernel behind the attention layers' ``_compute_attention`` seam, the one the training
forward replaces (``model.attention``): the prompt pass takes the training path over the prompt's
own keys; each decoding step writes one key and value per row into the cache in place and attends
one query against it (``attention.attend_cached``: causal, sliding window, soft cap, left pads
masked). KerasHub's own cached attention slices, updates and re-stacks its whole cache in every
layer and step; this cache is updated in place (`tools.bench.sampler` measures both).

Log-probabilities are those of softmax(logits / temperature) (temperature 1 when greedy) WITHOUT
top-k / top-p truncation, the convention of TRL's rollouts.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import keras
import numpy as np
from flax import nnx

from nnx_posttrain import chat, errors, model
from nnx_posttrain.model import attention, device_memory
from nnx_posttrain.model.logprobs import vocabulary_logits
from nnx_posttrain.model.device_memory import GiB

# Backbones whose decoder blocks take a KV cache and whose positions are rotary (relative), by
# class name. Absolute-position families (GPT-2, OPT, ...) would see shifted positions with left
# padding and are not supported.
_EMBED_SCALED = ("GemmaBackbone", "Gemma3Backbone")  # multiply embeddings by sqrt(hidden_dim)
_SUPPORTED = _EMBED_SCALED + (
    "LlamaBackbone", "Llama3Backbone", "MistralBackbone", "QwenBackbone", "Qwen3Backbone",
)


# The longest context of each family's released checkpoints (their configs'
# max_position_embeddings; the longest where a family's sizes differ: Gemma 3 1B has 32,768,
# Llama 3.0 8,192). Rotary positions past it are untrained: a generation that would need them is
# refused. A model trained for less still gets the family's bound.
CONTEXT_LENGTHS = {
    "GemmaBackbone": 8_192,  # Gemma, Gemma 2
    "Gemma3Backbone": 131_072,
    "LlamaBackbone": 4_096,  # Llama 2
    "Llama3Backbone": 131_072,  # Llama 3.1 / 3.2
    "MistralBackbone": 32_768,
    "QwenBackbone": 131_072,  # Qwen 2.5 with YaRN (32,768 without)
    "Qwen3Backbone": 131_072,  # Qwen 3 with YaRN (40,960 without)
}


def generation_bytes(module, batch: int, prompt_length: int, max_new_tokens: int) -> int:
    """What decoding ``batch`` prompts of ``prompt_length`` tokens for ``max_new_tokens`` tokens
    allocates beyond the weights: the KV cache of every block, the float32 logits of one
    position (the prompt pass projects only its last)."""
    heads, head_dim, dtype = _kv_layout(module)
    length = prompt_length + max_new_tokens
    cache = 2 * len(model.decoder_blocks(module)) * batch * heads * length * head_dim
    return cache * np.dtype(dtype).itemsize + 4 * batch * int(module.vocabulary_size)


def check_generation(module, batch: int, prompt_length: int, max_new_tokens: int,
                     option: str = "max_new_tokens", memory_check: bool = True) -> None:
    """``ConfigError`` naming ``option`` when a prompt of ``prompt_length`` tokens plus
    ``max_new_tokens`` is longer than the family's context (``CONTEXT_LENGTHS``), or when (with
    ``memory_check``) ``generation_bytes`` is more than the memory free; with the longest
    ``max_new_tokens`` that would pass."""
    name, total = type(module).__name__, prompt_length + max_new_tokens
    context = CONTEXT_LENGTHS.get(name)
    if context and total > context:
        raise errors.ConfigError(
            f"{option} {max_new_tokens:,}: a prompt of up to {prompt_length:,} tokens and "
            f"{max_new_tokens:,} new ones make {total:,} positions, past the {context:,} of "
            f"{name}'s context (nnx_posttrain.sampling.sampler.CONTEXT_LENGTHS); at most "
            f"{max(context - prompt_length, 0):,} new tokens")
    free = device_memory.available_bytes() if memory_check else None
    need = generation_bytes(module, batch, prompt_length, max_new_tokens)
    if free is not None and need > free:
        fixed = generation_bytes(module, batch, prompt_length, 0)
        per_token = generation_bytes(module, batch, prompt_length, 1) - fixed
        fits = max((free - fixed) // per_token, 0)
        raise errors.ConfigError(
            f"{option} {max_new_tokens:,}: decoding {batch} sequences of {total:,} positions needs "
            f"an estimated {need / GiB:,.2f} GiB (KV cache and logits; "
            f"nnx_posttrain.sampling.sampler.generation_bytes), and {free / GiB:,.2f} GiB are free; "
            f"at most ~{fits:,} new tokens fit")


@dataclasses.dataclass(frozen=True)
class _Family:
    cache_kw: str  # the block's cache keyword
    index_kw: str  # the block's cache-index keyword (the position of its first input token)
    pair_cache: bool  # the block's cache is a (key, value) tuple (Gemma 3), else [B, 2, L, kv, hd]
    embed_scale: bool


def _family(module) -> _Family:
    name = type(module).__name__
    if name not in _SUPPORTED:
        raise NotImplementedError(
            f"the KV-cache sampler does not support {name}: supported backbones are "
            f"{', '.join(_SUPPORTED)} (rotary positions and cached decoder blocks)"
        )
    block = type(module.transformer_layers[0])
    params = inspect.signature(block.call).parameters
    if "cache" in params and "cache_update_index" in params:
        return _Family("cache", "cache_update_index", pair_cache=name == "Gemma3Backbone",
                       embed_scale=name in _EMBED_SCALED)
    if "self_attention_cache" in params:
        return _Family("self_attention_cache", "self_attention_cache_update_index",
                       pair_cache=False, embed_scale=name in _EMBED_SCALED)
    raise NotImplementedError(f"{name}: decoder block {block.__name__} takes no KV cache")


def _kv_layout(module) -> tuple[int, int, str]:
    """(kv heads, head dim, compute dtype) of the backbone's keys and values."""
    heads = int(module.num_key_value_heads)
    head_dim = getattr(module, "head_dim", None) or module.hidden_dim // module.num_query_heads
    return heads, int(head_dim), keras.backend.standardize_dtype(module.compute_dtype)


def _empty_cache(module, batch: int, length: int):
    """One (keys, values) pair [B * kv heads, L, head dim] per decoder block (``attend_cached``)."""
    heads, head_dim, dtype = _kv_layout(module)
    shape = (batch * heads, length, head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in model.decoder_blocks(module))


def _pass_through_cache(module, fam: _Family, batch: int, length: int):
    """What a block is given as its cache: zeros exactly as long as its input, so that KerasHub's
    cache write (a dynamic update slice, whose start is clamped to fit) is the new keys and values
    themselves, and its rotary embedding starts at the cache index."""
    heads, head_dim, dtype = _kv_layout(module)
    if fam.pair_cache:
        shape = (batch, length, heads, head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return jnp.zeros((batch, 2, length, heads, head_dim), dtype)


def _forward(module, fam: _Family, token_ids, caches, index, key_mask, prompt=None):
    """Run ``token_ids`` [B, T] at positions index..index+T-1 through the decoder blocks: float32
    logits [B, T, vocab] (the path of ``model.token_logprobs``; for the prompt pass, [B, 1, vocab]:
    its last position, the only one read) and the updated caches.

    KerasHub's blocks compute everything but attention (projections, biases, q/k norms, rotary
    embedding, norms, feed-forward, LoRA); each attention layer's ``_compute_attention`` writes its
    keys and values into this sampler's cache at ``index`` (in place in the decoding loop: no copy
    of the cache per step, as KerasHub's slice / update / stack of its cache makes) and returns
    ``model.attention``'s kernels' output: for the prompt pass (``prompt``: the prompt's padding
    mask), the module's training path over the prompt's own keys; for a decoding step, one query
    per row against the cache (``attend_cached``), its left pads masked by ``key_mask``."""
    batch, t = token_ids.shape
    x = module.token_embedding(token_ids)
    if fam.embed_scale:
        x = x * jnp.sqrt(jnp.asarray(module.hidden_dim, jnp.float32)).astype(x.dtype)
    caches = list(caches)
    choice = attention.attention_of(module)
    if choice.implementation == "keras":
        choice = attention.Choice("xla", choice.chunk)

    def kernel(i, spec, q, k, v):
        own_k, own_v = k[:, :, ::spec.repeated], v[:, :, ::spec.repeated]  # Llama family repeats
        cache_k, cache_v = caches[i]
        cache_k, cache_v = (  # [B, T, K, H] -> rows b * K + k of the [B * K, L, H] cache
            jax.lax.dynamic_update_slice_in_dim(
                cache, jnp.transpose(own, (0, 2, 1, 3)).reshape(cache.shape[0], t, -1)
                .astype(cache.dtype), index, 1)
            for cache, own in ((cache_k, own_k), (cache_v, own_v)))
        caches[i] = (cache_k, cache_v)
        if prompt is not None:
            return attention.attend(q, k, v, prompt, spec, choice)
        return attention.attend_cached(q, cache_k, cache_v, key_mask, index, spec)

    through = _pass_through_cache(module, fam, batch, t)
    with attention.overridden(module, (batch, t), kernel, training=False) as blocks:
        for block in blocks:
            x, _ = block(x, **{fam.cache_kw: through, fam.index_kw: index})
    h = module.layer_norm(x)
    if prompt is not None:  # only the last position's prediction is read
        h = h[:, -1:]
    logits = vocabulary_logits(module.token_embedding, h)
    return logits, tuple(caches)


def _categorical(rng, logits):
    """One draw per row from softmax(logits) [B, V] by inverting its CDF with one uniform number
    per row (as torch.multinomial does). ``jax.random.categorical`` adds a Gumbel number to every
    vocabulary entry: B x V threefry draws per token, most of a sampled decoding step on CPU
    (batch 64: 0.32 s vs 0.18 s greedy for 64 tokens). Ids of probability 0 (-inf) are never
    drawn: the first id whose CDF exceeds u has a positive probability; u rounding up to the total
    falls back to the last such id."""
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    u = jax.random.uniform(rng, cdf.shape[:-1] + (1,), cdf.dtype) * cdf[..., -1:]
    drawn = jnp.sum(cdf <= u, axis=-1)
    last = probs.shape[-1] - 1 - jnp.argmax(probs[..., ::-1] > 0, axis=-1)
    return jnp.minimum(drawn, last)


def _choose(logits, rng, temperature, top_p, top_k: int, vocab_size=None):
    """Next tokens [B] and their log-probs under softmax(logits / T) (T = 1 when greedy), without
    truncation. Greedy (argmax) when ``temperature`` <= 0; else top-k (static), then top-p over
    what remains (renormalised), then a draw (``_categorical``). Ids at or above ``vocab_size`` (the
    tokenizer's size, when the embedding is padded beyond it, as Qwen's) are never chosen; the
    log-probs stay those of the full softmax, as the training forward computes them."""
    greedy = temperature <= 0
    logp = jax.nn.log_softmax(logits / jnp.where(greedy, 1.0, temperature), axis=-1)
    if vocab_size is not None:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    scaled = logits / jnp.where(greedy, 1.0, temperature)

    def draw():
        if top_k > 0:
            vals, idx = jax.lax.top_k(scaled, top_k)  # sorted, descending
            probs = jax.nn.softmax(vals, axis=-1)
            keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # always keeps the first
            choice = _categorical(rng, jnp.where(keep, vals, -jnp.inf))
            return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]

        def nucleus():
            vals = -jnp.sort(-scaled, axis=-1)
            probs = jax.nn.softmax(vals, axis=-1)
            kept = jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < top_p, axis=-1)  # >= 1
            threshold = jnp.take_along_axis(vals, kept[:, None] - 1, axis=-1)
            return jnp.where(scaled >= threshold, scaled, -jnp.inf)

        filtered = jax.lax.cond(top_p < 1.0, nucleus, lambda: scaled)
        return _categorical(rng, filtered)

    tokens = jax.lax.cond(greedy, lambda: jnp.argmax(logits, axis=-1), draw).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def make_sampler(graphdef, max_new_tokens: int, *, top_k: int = 0, pad_id: int = 0) -> Callable:
    """``sample(states, prompt_ids, prompt_mask, rng, temperature, top_p, stop_ids) -> dict``.

    ``states``: the states of ``nnx.split(module)`` after the graphdef; ``prompt_ids`` /
    ``prompt_mask`` [B, P]: left-padded prompts (see ``pad_prompts``); ``rng``: a PRNG key;
    ``temperature``: 0 for greedy; ``top_p``: 1.0 for off; ``stop_ids`` int32 [S]. Returns
    ``completion_ids`` [B, N] (``pad_id`` after the stop token), ``completion_mask`` [B, N] (1 up
    to and including the stop token), ``logprobs`` [B, N] float32 (0 where the mask is 0) and
    ``finished`` [B] (a stop token was produced). Rows stop independently; decoding ends when every
    row has stopped. ``vocab_size`` (optional, traced): ids at or above it are never sampled (the
    tokenizer's size, when the embedding has padding rows, as Qwen's 151,936 for 151,665 tokens).
    ``budget`` (optional, traced, [B] or a scalar): new tokens row by row at most (a row at its
    budget stops unfinished; 0: the row generates nothing; default ``max_new_tokens``): a
    tool-calling rollout's continuation (``nnx_posttrain.agents``). ``top_k`` (0 = off) is static: one compilation per value. The graphdef of a
    Keras model is not hashable, so it is closed over rather than passed as a static argument.
    """
    n = int(max_new_tokens)
    if n < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")

    @jax.jit
    def _sample(states, prompt_ids, prompt_mask, rng, temperature, top_p, stop_ids, vocab_size,
                budget):
        module = nnx.merge(graphdef, *states)
        fam = _family(module)
        batch, width = prompt_ids.shape
        length = width + n
        key_mask = jnp.concatenate(
            [prompt_mask.astype(jnp.int32), jnp.ones((batch, n), jnp.int32)], axis=1
        )
        caches = _empty_cache(module, batch, length)
        logits, caches = _forward(module, fam, prompt_ids, caches, 0, key_mask, prompt=prompt_mask)
        logits = logits[:, -1]

        def cond(carry):
            j, done = carry[0], carry[-1]
            return (j < n) & jnp.any(~done & (j < budget))

        def body(carry):
            j, caches, logits, ids, mask, logps, done = carry
            token, logp = _choose(logits, jax.random.fold_in(rng, j), temperature, top_p, top_k,
                                  vocab_size)
            live = ~done & (j < budget)
            token = jnp.where(live, token, pad_id)
            # [N, B] buffers: row j is one contiguous dynamic-update-slice per step
            ids = jax.lax.dynamic_update_index_in_dim(ids, token, j, 0)
            mask = jax.lax.dynamic_update_index_in_dim(mask, live.astype(jnp.int32), j, 0)
            logps = jax.lax.dynamic_update_index_in_dim(logps, jnp.where(live, logp, 0.0), j, 0)
            done = done | (live & jnp.isin(token, stop_ids))
            logits, caches = _forward(module, fam, token[:, None], caches, width + j, key_mask)
            return j + 1, caches, logits[:, 0], ids, mask, logps, done

        init = (
            jnp.int32(0), caches, logits,
            jnp.full((n, batch), pad_id, jnp.int32), jnp.zeros((n, batch), jnp.int32),
            jnp.zeros((n, batch), jnp.float32), jnp.zeros((batch,), bool),
        )
        _, _, _, ids, mask, logps, done = jax.lax.while_loop(cond, body, init)
        return {"completion_ids": ids.T, "completion_mask": mask.T, "logprobs": logps.T,
                "finished": done}

    def sample(states, prompt_ids, prompt_mask, rng, temperature, top_p, stop_ids,
               vocab_size=None, budget=None):
        # Fixed dtypes (a Python float is weakly typed, an np.float32 is not): no recompilation
        # when callers mix them. vocab_size (traced; default: every id of the embedding).
        rows = np.shape(prompt_ids)[0]
        return _sample(
            tuple(states), jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32),
            rng, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
            jnp.asarray(stop_ids, jnp.int32).reshape(-1),
            jnp.asarray(np.iinfo(np.int32).max if vocab_size is None else vocab_size, jnp.int32),
            jnp.broadcast_to(jnp.asarray(n if budget is None else budget, jnp.int32), (rows,)),
        )

    sample.jitted = _sample
    sample._cache_size = _sample._cache_size
    return sample


def pad_prompts(prompts: list[list[int]], pad_id: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids and mask [B, P], P = the longest prompt rounded up to a multiple of
    ``bucket`` (fewer distinct shapes, fewer compilations)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("pad_prompts needs a non-empty list of non-empty prompts")
    width = -(-max(len(p) for p in prompts) // bucket) * bucket
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids, mask


def stop_ids(lm) -> list[int]:
    """End-of-sequence id and the chat format's end-of-turn marker (when it is one token)."""
    ids = {lm.tokenizer.eos_id}
    marker = lm.tokenizer.token_id(chat.END_OF_TURN[lm.chat_format])
    if marker is not None:
        ids.add(marker)
    return sorted(i for i in ids if i is not None)


def encode_prompt(lm, segments) -> list[int]:
    """Token ids of rendered chat segments, with the beginning-of-sequence id."""
    tok = lm.tokenizer
    ids = [tok.bos_id] if tok.bos_id is not None else []
    for text, _ in segments:
        ids += tok.encode(text)
    return ids


def chat_prompt(lm, prompt: str | list[dict]) -> list[int]:
    """A user message (or a conversation) rendered with the family's chat template and its
    generation prompt."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return encode_prompt(lm, chat.render(messages, lm.chat_format, add_generation_prompt=True))


def decode_completions(lm, out: dict, stops) -> list[str]:
    """Text of each row of a sampler output, stop tokens removed."""
    ids, mask = np.asarray(out["completion_ids"]), np.asarray(out["completion_mask"])
    stops = set(int(s) for s in stops)
    return [lm.tokenizer.decode([int(t) for t, m in zip(row, ms) if m and int(t) not in stops])
            for row, ms in zip(ids, mask)]


def sample_ids(lm, sample, states, prompts: list[list[int]], *, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, batch_size: int = 64) -> list[str]:
    """Completions (text, stop marker removed) of tokenized prompts with a sampler from
    ``make_sampler``, ``batch_size`` rows per call (the last batch is padded to the same shape)."""
    stops = stop_ids(lm)
    rng = jax.random.key(seed)
    bucket = 16
    width = -(-max(len(p) for p in prompts) // bucket) * bucket  # one width for every batch
    out = []
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[start : start + batch_size]
        count = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - count)  # fixed batch shape
        ids, mask = pad_prompts(chunk, lm.tokenizer.pad_id, bucket=width)
        result = sample(tuple(states), ids, mask, jax.random.fold_in(rng, b), temperature, top_p,
                        np.asarray(stops, np.int32), lm.tokenizer.vocab_size)
        out += decode_completions(lm, result, stops)[:count]
    return out


def sample_texts(lm, module_or_states, prompts: list[str], max_new_tokens: int = 32, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 num_samples: int = 1, graphdef=None) -> list[list[str]]:
    """Answers to user messages (rendered with the chat template + generation prompt): for each
    prompt, ``num_samples`` completions (text, stop marker removed). ``module_or_states`` is an
    ``nnx.Module`` (e.g. ``runs.load(...).module``) or the states of ``nnx.split`` with their
    ``graphdef``. Greedy when ``temperature`` is 0."""
    if isinstance(module_or_states, nnx.Module):
        graphdef, *states = nnx.split(module_or_states)
    elif graphdef is None:
        raise ValueError("sample_texts: pass graphdef= with states (or pass the module)")
    else:
        states = list(module_or_states)
    encoded = [chat_prompt(lm, p) for p in prompts for _ in range(num_samples)]
    module = module_or_states if isinstance(module_or_states, nnx.Module) else \
        nnx.merge(graphdef, *states)
    check_generation(module, min(64, len(encoded)),
                     max(map(len, encoded)), max_new_tokens)
    sample = make_sampler(graphdef, max_new_tokens, top_k=top_k, pad_id=lm.tokenizer.pad_id)
    texts = sample_ids(lm, sample, states, encoded, temperature=temperature, top_p=top_p,
                       seed=seed, batch_size=min(64, len(encoded)))
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
