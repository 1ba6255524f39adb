"""A compiled, batched sampler with a KV cache: rollouts for RL, greedy evaluation, ``nnx-posttrain sample``.

``make_sampler(graphdef, max_new_tokens, top_k=...)`` returns ``sample(states, prompt_ids,
prompt_mask, rng, draw)``, compiled once per (batch, prompt width, ``max_new_tokens``,
``top_k``); how it draws (``Draw``: temperature, top-p, stop ids, ...) is traced, so changing it
does not recompile. Prompts are LEFT-padded: every row's last prompt token sits at column P - 1, so all rows
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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import chat, families, model
from nnx_posttrain.model import attention
from nnx_posttrain.model.logprobs import vocabulary_logits
from nnx_posttrain.sampling.capacity import (  # noqa: F401  (re-exported: the sampler's limits)
    CONTEXT_LENGTHS,
    check_generation,
    generation_bytes,
)
from nnx_posttrain.sampling.capacity import kv_layout as _kv_layout

def _family(module) -> families.Decoding:
    """How the sampler drives ``module``'s decoder blocks (its family's ``Decoding``). Rotary
    positions only: an absolute-position family (GPT-2, OPT, ...) would see shifted positions
    with left padding."""
    name = type(module).__name__
    family = families.of(module)
    if family is None or isinstance(family.decoding, families.Unsupported):
        supported = [f.backbone for f in families.FAMILIES.values() if f.decoding]
        why = f" ({family.decoding.reason})" if family is not None else ""
        raise NotImplementedError(
            f"the KV-cache sampler does not support {name}{why}: supported backbones are "
            f"{', '.join(supported)} (rotary positions and cached decoder blocks)"
        )
    params = inspect.signature(type(module.transformer_layers[0]).call).parameters
    if family.decoding.cache_kw not in params:
        raise NotImplementedError(f"{name}: decoder block takes no {family.decoding.cache_kw}")
    return family.decoding


def _empty_cache(module, batch: int, length: int):
    """One (keys, values) pair [B * kv heads, L, head dim] per decoder block (``attend_cached``)."""
    heads, head_dim, dtype = _kv_layout(module)
    shape = (batch * heads, length, head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in model.decoder_blocks(module))


def _pass_through_cache(module, fam: families.Decoding, batch: int, length: int):
    """What a block is given as its cache: zeros exactly as long as its input, so that KerasHub's
    cache write (a dynamic update slice, whose start is clamped to fit) is the new keys and values
    themselves, and its rotary embedding starts at the cache index."""
    heads, head_dim, dtype = _kv_layout(module)
    if fam.pair_cache:
        shape = (batch, length, heads, head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return jnp.zeros((batch, 2, length, heads, head_dim), dtype)


class _Cache(NamedTuple):
    """The KV cache of every block, the position of the next token written to it, and the mask
    of its keys (the prompt's left pads masked)."""

    caches: tuple
    index: Any
    key_mask: Any


def _forward(module, fam: families.Decoding, token_ids, cache: _Cache, prompt=None):
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
    index, key_mask = cache.index, cache.key_mask
    x = module.token_embedding(token_ids)
    if fam.embed_scale:
        x = x * jnp.sqrt(jnp.asarray(module.hidden_dim, jnp.float32)).astype(x.dtype)
    caches = list(cache.caches)
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


class Draw(NamedTuple):
    """How a sampler of ``make_sampler`` draws (traced: changing it does not recompile):
    ``temperature`` (0: greedy), ``top_p`` (1.0: off), ``stop_ids`` int32 [S], ``vocab_size``
    (ids at or above it are never sampled: the tokenizer's size, when the embedding has padding
    rows, as Qwen's), ``budget`` ([B] or a scalar: new tokens row by row at most, a row at its
    budget stops unfinished; default the sampler's ``max_new_tokens``: tool-calling turns)."""

    temperature: Any = 0.0
    top_p: Any = 1.0
    stop_ids: Any = ()
    vocab_size: Any = None
    budget: Any = None


class _Decoder:
    """The compiled body of ``make_sampler``'s sampler: the prompt pass, then one token per step
    until every row has stopped (``max_new`` tokens at most, ``top_k`` static)."""

    def __init__(self, graphdef, max_new: int, top_k: int, pad_id: int):
        self.graphdef, self.n, self.top_k, self.pad_id = graphdef, max_new, top_k, pad_id

    def __call__(self, states, prompt_ids, prompt_mask, rng, draw: Draw):
        module = nnx.merge(self.graphdef, *states)
        fam = _family(module)
        batch, width = prompt_ids.shape
        n = self.n
        key_mask = jnp.concatenate(
            [prompt_mask.astype(jnp.int32), jnp.ones((batch, n), jnp.int32)], axis=1
        )
        cache = _Cache(_empty_cache(module, batch, width + n), 0, key_mask)
        logits, caches = _forward(module, fam, prompt_ids, cache, prompt=prompt_mask)
        logits = logits[:, -1]

        def cond(carry):
            j, done = carry[0], carry[-1]
            return (j < n) & jnp.any(~done & (j < draw.budget))

        init = (
            jnp.int32(0), caches, logits,
            jnp.full((n, batch), self.pad_id, jnp.int32), jnp.zeros((n, batch), jnp.int32),
            jnp.zeros((n, batch), jnp.float32), jnp.zeros((batch,), bool),
        )
        body = self._step(module, fam, _Cache(None, width, key_mask), rng, draw)
        _, _, _, ids, mask, logps, done = jax.lax.while_loop(cond, body, init)
        return {"completion_ids": ids.T, "completion_mask": mask.T, "logprobs": logps.T,
                "finished": done}

    def _step(self, module, fam, cache: _Cache, rng, draw: Draw):
        """The decoding loop's body: token j of every live row (``cache.index``: the prompt's
        width, where token 0 goes)."""
        width, key_mask = cache.index, cache.key_mask

        def body(carry):
            j, caches, logits, ids, mask, logps, done = carry
            token, logp = _choose(logits, jax.random.fold_in(rng, j), draw.temperature,
                                  draw.top_p, self.top_k, draw.vocab_size)
            live = ~done & (j < draw.budget)
            token = jnp.where(live, token, self.pad_id)
            # [N, B] buffers: row j is one contiguous dynamic-update-slice per step
            ids = jax.lax.dynamic_update_index_in_dim(ids, token, j, 0)
            mask = jax.lax.dynamic_update_index_in_dim(mask, live.astype(jnp.int32), j, 0)
            logps = jax.lax.dynamic_update_index_in_dim(logps, jnp.where(live, logp, 0.0), j, 0)
            done = done | (live & jnp.isin(token, draw.stop_ids))
            logits, caches = _forward(module, fam, token[:, None],
                                      _Cache(caches, width + j, key_mask))
            return j + 1, caches, logits[:, 0], ids, mask, logps, done

        return body


def make_sampler(graphdef, max_new_tokens: int, *, top_k: int = 0, pad_id: int = 0) -> Callable:
    """``sample(states, prompt_ids, prompt_mask, rng, draw) -> dict``.

    ``states``: the states of ``nnx.split(module)`` after the graphdef; ``prompt_ids`` /
    ``prompt_mask`` [B, P]: left-padded prompts (see ``pad_prompts``); ``rng``: a PRNG key;
    ``draw``: how to draw (:class:`Draw`: temperature, top-p, stop ids, vocabulary size,
    budget). Returns ``completion_ids`` [B, N] (``pad_id`` after the stop token),
    ``completion_mask`` [B, N] (1 up to and including the stop token), ``logprobs`` [B, N]
    float32 (0 where the mask is 0) and ``finished`` [B] (a stop token was produced). Rows stop
    independently; decoding ends when every row has stopped. ``top_k`` (0 = off) is static: one
    compilation per value. The graphdef of a Keras model is not hashable, so it is closed over
    rather than passed as a static argument.
    """
    n = int(max_new_tokens)
    if n < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    _sample = jax.jit(_Decoder(graphdef, n, top_k, pad_id).__call__)

    def sample(states, prompt_ids, prompt_mask, rng, draw: Draw):
        # Fixed dtypes (a Python float is weakly typed, an np.float32 is not): no recompilation
        # when callers mix them. vocab_size (traced; default: every id of the embedding).
        rows = np.shape(prompt_ids)[0]
        vocab = np.iinfo(np.int32).max if draw.vocab_size is None else draw.vocab_size
        traced = Draw(
            jnp.asarray(draw.temperature, jnp.float32), jnp.asarray(draw.top_p, jnp.float32),
            jnp.asarray(draw.stop_ids, jnp.int32).reshape(-1), jnp.asarray(vocab, jnp.int32),
            jnp.broadcast_to(jnp.asarray(n if draw.budget is None else draw.budget, jnp.int32),
                             (rows,)))
        return _sample(tuple(states), jnp.asarray(prompt_ids, jnp.int32),
                       jnp.asarray(prompt_mask, jnp.int32), rng, traced)

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


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How ``sample_texts`` answers: ``max_new_tokens`` per answer, ``temperature`` (0: greedy),
    ``top_k`` (0: off), ``top_p`` (1: off), ``seed``, ``num_samples`` answers per prompt
    (``sample_ids`` reads the temperature, top-p and seed: its sampler has the rest)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1


GREEDY = Sampling()


def sample_ids(lm, sample, states, prompts: list[list[int]], sampling: Sampling = GREEDY,
               batch_size: int = 64) -> list[str]:
    """Completions (text, stop marker removed) of tokenized prompts with a sampler from
    ``make_sampler``, ``batch_size`` rows per call (the last batch is padded to the same shape),
    drawn as ``sampling`` says (its temperature, top-p and seed)."""
    stops = stop_ids(lm)
    rng = jax.random.key(sampling.seed)
    bucket = 16
    width = -(-max(len(p) for p in prompts) // bucket) * bucket  # one width for every batch
    draw = Draw(sampling.temperature, sampling.top_p, np.asarray(stops, np.int32),
                lm.tokenizer.vocab_size)
    out = []
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[start : start + batch_size]
        count = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - count)  # fixed batch shape
        ids, mask = pad_prompts(chunk, lm.tokenizer.pad_id, bucket=width)
        result = sample(tuple(states), ids, mask, jax.random.fold_in(rng, b), draw)
        out += decode_completions(lm, result, stops)[:count]
    return out


def sample_texts(lm, module_or_states, prompts: list[str], sampling: Sampling = GREEDY,
                 graphdef=None) -> list[list[str]]:
    """Answers to user messages (rendered with the chat template + generation prompt): for each
    prompt, ``sampling.num_samples`` completions (text, stop marker removed), as ``sampling``
    says (greedy by default). ``module_or_states`` is an ``nnx.Module`` (e.g.
    ``runs.load(...).module``) or the states of ``nnx.split`` with their ``graphdef``."""
    if isinstance(module_or_states, nnx.Module):
        graphdef, *states = nnx.split(module_or_states)
    elif graphdef is None:
        raise ValueError("sample_texts: pass graphdef= with states (or pass the module)")
    else:
        states = list(module_or_states)
    n = sampling.num_samples
    encoded = [chat_prompt(lm, p) for p in prompts for _ in range(n)]
    module = module_or_states if isinstance(module_or_states, nnx.Module) else \
        nnx.merge(graphdef, *states)
    check_generation(module, min(64, len(encoded)), max(map(len, encoded)),
                     sampling.max_new_tokens)
    sample = make_sampler(graphdef, sampling.max_new_tokens, top_k=sampling.top_k,
                          pad_id=lm.tokenizer.pad_id)
    texts = sample_ids(lm, sample, states, encoded, sampling, batch_size=min(64, len(encoded)))
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]
