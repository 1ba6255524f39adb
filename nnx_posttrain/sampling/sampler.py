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
one query against it (``attention.attend_cached``: causal, sliding window, soft cap, sinks, left pads
masked). KerasHub's own cached attention slices, updates and re-stacks its whole cache in every
layer and step; this cache is updated in place (`tools.bench.sampler` measures both).

A prompt with images (a vision model's, Gemma 3's or Gemma 4's: ``pixel_values``) takes the
training forward's prompt pass instead: the image placeholder tokens' embeddings replaced by the
vision tower's, and KerasHub's own attention (image tokens attend to each other within an image;
Gemma 4's per-layer inputs and KV-shared blocks as its backbone computes them), its keys and
values written into the same cache; decoding then goes on as for text (a new token attends
causally).

Log-probabilities are those of softmax(logits / temperature) (temperature 1 when greedy) WITHOUT
top-k / top-p truncation, the convention of TRL's rollouts.
"""

from __future__ import annotations

import contextlib

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import chat, families, model
from nnx_posttrain.model import vision
from nnx_posttrain.sampling.capacity import (  # noqa: F401  (re-exported: the sampler's limits)
    CONTEXT_LENGTHS,
    check_generation,
    generation_bytes,
)
from nnx_posttrain.sampling.passes import Cache as _Cache
from nnx_posttrain.sampling.passes import empty_cache as _empty_cache
from nnx_posttrain.sampling.passes import family as _family
from nnx_posttrain.sampling.passes import forward as _forward
from nnx_posttrain.sampling.passes import image_prompt as _image_prompt

CDF_BLOCK = 1024


def _categorical(rng, logits):
    """One draw per row from softmax(logits) [B, V] by inverting its CDF with one uniform number
    per row (as torch.multinomial does), in two levels: the block of ``CDF_BLOCK`` ids whose
    cumulative mass passes u, then the id within that block. ``jax.random.categorical`` adds a
    Gumbel number to every vocabulary entry: B x V threefry draws per token, most of a sampled
    decoding step on CPU (batch 64: 0.32 s vs 0.18 s greedy for 64 tokens); a cumulative sum over
    the whole vocabulary is a log-depth scan of passes over [B, V] on a TPU (the sampled batch 64
    at 0.86x Tunix's sampler); two levels read [B, V] twice. Ids of probability 0 (-inf) are never
    drawn: within the chosen block the first id whose CDF exceeds u's remainder has a positive
    probability; u rounding up to the total falls back to the last such id."""
    probs = jax.nn.softmax(logits, axis=-1)
    batch, vocab = probs.shape
    width = min(CDF_BLOCK, vocab)
    blocks = jnp.pad(probs, ((0, 0), (0, -vocab % width))).reshape(batch, -1, width)
    mass = jnp.sum(blocks, axis=-1)  # [B, blocks]
    cdf = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(rng, (batch, 1), cdf.dtype) * cdf[:, -1:]
    block = jnp.minimum(jnp.sum(cdf <= u, axis=-1), _last_positive(mass))
    before = jnp.where(block > 0, jnp.take_along_axis(cdf, jnp.maximum(block - 1, 0)[:, None],
                                                      axis=-1)[:, 0], 0.0)  # <= u: r >= 0
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, width]
    drawn = jnp.sum(jnp.cumsum(inner, axis=-1) <= (u[:, 0] - before)[:, None], axis=-1)
    return block * width + jnp.minimum(drawn, _last_positive(inner))


def _last_positive(p):
    """[B, n] -> [B]: the index of the last entry > 0 of each row."""
    return p.shape[-1] - 1 - jnp.argmax(p[..., ::-1] > 0, axis=-1)


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

    def __call__(self, states, prompt_ids, prompt_mask, rng, draw: Draw, pixel_values=None):
        module = nnx.merge(self.graphdef, *states)
        fam = _family(module)
        batch, width = prompt_ids.shape
        n = self.n
        key_mask = jnp.concatenate(
            [prompt_mask.astype(jnp.int32), jnp.ones((batch, n), jnp.int32)], axis=1
        )
        cache = _Cache(_empty_cache(module, batch, width + n), 0, key_mask)
        decoding = contextlib.nullcontext  # the decoding steps' rotary positions (Qwen 3.5's)
        if pixel_values is None:
            logits, caches = _forward(module, fam, prompt_ids, cache, prompt=prompt_mask)
        else:
            with vision.images(pixel_values):
                logits, caches = _image_prompt(module, fam, prompt_ids, cache.caches, prompt_mask)
                decoding = vision.decoding_positions(module, prompt_ids, prompt_mask)
        logits = logits[:, -1]

        def cond(carry):
            j, done = carry[0], carry[-1]
            return (j < n) & jnp.any(~done & (j < draw.budget))

        init = (
            jnp.int32(0), caches, logits,
            jnp.full((n, batch), self.pad_id, jnp.int32), jnp.zeros((n, batch), jnp.int32),
            jnp.zeros((n, batch), jnp.float32), jnp.zeros((batch,), bool),
        )
        body = self._step(module, fam, _Cache(None, width, key_mask), rng, draw, decoding)
        _, _, _, ids, mask, logps, done = jax.lax.while_loop(cond, body, init)
        return {"completion_ids": ids.T, "completion_mask": mask.T, "logprobs": logps.T,
                "finished": done}

    def _step(self, module, fam, cache: _Cache, rng, draw: Draw, positions):
        """The decoding loop's body: token j of every live row (``cache.index``: the prompt's
        width, where token 0 goes), within the context ``positions()`` (the rotary positions
        after a prompt with images: ``vision.decoding_positions``)."""
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
            with positions():
                logits, caches = _forward(module, fam, token[:, None],
                                          _Cache(caches, width + j, key_mask))
            return j + 1, caches, logits[:, 0], ids, mask, logps, done

        return body


def make_sampler(graphdef, max_new_tokens: int, *, top_k: int = 0, pad_id: int = 0) -> Callable:
    """``sample(states, prompt_ids, prompt_mask, rng, draw, pixel_values=None) -> dict``.

    ``states``: the states of ``nnx.split(module)`` after the graphdef; ``prompt_ids`` /
    ``prompt_mask`` [B, P]: left-padded prompts (see ``pad_prompts``); ``rng``: a PRNG key;
    ``draw``: how to draw (:class:`Draw`: temperature, top-p, stop ids, vocabulary size,
    budget); ``pixel_values`` [B, max images, ...] (a vision model's: each row's images,
    Gemma 3's [H, W, 3] pixels or Gemma 4's patches with their positions,
    as ``data.TokenizePrompt`` makes them): the prompt pass reads them as the training forward
    does (``passes.image_prompt``); None (text) compiles the text sampler, as without them.
    Gemma 4's patches of images whose patch grids differ in width are refused
    (``vision.check_one_grid``: KerasHub's pooling would read one grid for all).
    Returns ``completion_ids`` [B, N] (``pad_id`` after the stop token),
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

    def sample(states, prompt_ids, prompt_mask, rng, draw: Draw, pixel_values=None):
        # Fixed dtypes (a Python float is weakly typed, an np.float32 is not): no recompilation
        # when callers mix them. vocab_size (traced; default: every id of the embedding).
        rows = np.shape(prompt_ids)[0]
        vocab = np.iinfo(np.int32).max if draw.vocab_size is None else draw.vocab_size
        traced = Draw(
            jnp.asarray(draw.temperature, jnp.float32), jnp.asarray(draw.top_p, jnp.float32),
            jnp.asarray(draw.stop_ids, jnp.int32).reshape(-1), jnp.asarray(vocab, jnp.int32),
            jnp.broadcast_to(jnp.asarray(n if draw.budget is None else draw.budget, jnp.int32),
                             (rows,)))
        vision.check_one_grid(pixel_values)  # Gemma 4: images of one grid width a batch
        pixels = None if pixel_values is None else jnp.asarray(pixel_values, jnp.float32)
        return _sample(tuple(states), jnp.asarray(prompt_ids, jnp.int32),
                       jnp.asarray(prompt_mask, jnp.int32), rng, traced, pixels)

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
    """End-of-sequence id and the chat format's end-of-turn markers (when each is one token):
    ``chat.END_OF_TURN``, and ``chat.CALL_END`` where a calling turn ends with its own."""
    ids = {lm.tokenizer.eos_id}
    for markers in (chat.END_OF_TURN, chat.CALL_END):
        if lm.chat_format in markers:  # None: not one token
            ids.add(lm.tokenizer.token_id(markers[lm.chat_format]))
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


class ImagePrompts(NamedTuple):
    """Tokenized prompts with images, for ``sample_ids`` and ``sample_texts`` (a vision model's):
    ``ids`` (a list of token ids per prompt, its image tokens expanded) and ``pixel_values``
    [prompts, max images, H, W, 3] (the image converter's output: ``data.TokenizePrompt``'s,
    ``cli.sample.image_prompts``)."""

    ids: list
    pixel_values: Any


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


def sample_ids(lm, sample, states, prompts: list[list[int]] | ImagePrompts,
               sampling: Sampling = GREEDY, batch_size: int = 64) -> list[str]:
    """Completions (text, stop marker removed) of tokenized prompts (with their images:
    ``ImagePrompts``) with a sampler from ``make_sampler``, ``batch_size`` rows per call (the
    last batch is padded to the same shape), drawn as ``sampling`` says (its temperature, top-p
    and seed)."""
    pixels = None
    if isinstance(prompts, ImagePrompts):
        prompts, pixels = prompts.ids, np.asarray(prompts.pixel_values, np.float32)
    stops = stop_ids(lm)
    rng = jax.random.key(sampling.seed)
    bucket = 16
    width = -(-max(len(p) for p in prompts) // bucket) * bucket  # one width for every batch
    draw = Draw(sampling.temperature, sampling.top_p, np.asarray(stops, np.int32),
                lm.tokenizer.vocab_size)
    out = []
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        count = len(prompts[start : start + batch_size])
        rows = list(range(start, start + count)) + [start + count - 1] * (batch_size - count)
        ids, mask = pad_prompts([prompts[r] for r in rows], lm.tokenizer.pad_id, bucket=width)
        result = sample(tuple(states), ids, mask, jax.random.fold_in(rng, b), draw,
                        None if pixels is None else pixels[rows])  # fixed batch shape
        out += decode_completions(lm, result, stops)[:count]
    return out


def sample_texts(lm, module_or_states, prompts: list[str] | ImagePrompts,
                 sampling: Sampling = GREEDY, graphdef=None) -> list[list[str]]:
    """Answers to user messages (rendered with the chat template + generation prompt), or to
    prompts with images (``ImagePrompts``, tokenized): for each prompt, ``sampling.num_samples``
    completions (text, stop marker removed), as ``sampling`` says (greedy by default).
    ``module_or_states`` is an ``nnx.Module`` (e.g. ``runs.load(...).module``) or the states of
    ``nnx.split`` with their ``graphdef``."""
    if isinstance(module_or_states, nnx.Module):
        graphdef, *states = nnx.split(module_or_states)
    elif graphdef is None:
        raise ValueError("sample_texts: pass graphdef= with states (or pass the module)")
    else:
        states = list(module_or_states)
    n = sampling.num_samples
    if isinstance(prompts, ImagePrompts):
        ids = [p for p in prompts.ids for _ in range(n)]
        encoded = ImagePrompts(ids, np.repeat(np.asarray(prompts.pixel_values), n, axis=0))
    else:
        ids = encoded = [chat_prompt(lm, p) for p in prompts for _ in range(n)]
    module = module_or_states if isinstance(module_or_states, nnx.Module) else \
        nnx.merge(graphdef, *states)
    check_generation(module, min(64, len(ids)), max(map(len, ids)), sampling.max_new_tokens)
    sample = make_sampler(graphdef, sampling.max_new_tokens, top_k=sampling.top_k,
                          pad_id=lm.tokenizer.pad_id)
    texts = sample_ids(lm, sample, states, encoded, sampling, batch_size=min(64, len(ids)))
    return [texts[i * n:(i + 1) * n] for i in range(len(ids) // n)]
