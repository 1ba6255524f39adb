"""Greedy generation for evaluation (exact-match accuracy on held-out prompts).

A simple compiled decoder: the whole buffer goes through the model at each new token (no KV
cache), which is cheap for the short answers of evaluation. One compilation per
(batch, prompt + new tokens) shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import chat, model


def make_greedy(graphdef, max_new_tokens: int):
    """jitted greedy(states, tokens, lengths, stop_ids) -> (tokens, lengths).

    ``tokens`` [batch, width] hold right-padded prompts of ``lengths``; generated tokens are
    written after them, up to ``max_new_tokens`` or a stop id. (The graphdef of a Keras model is
    not hashable, so it is closed over rather than passed as a static argument.)"""

    @jax.jit
    def greedy(states, tokens, lengths, stop_ids):
        module = nnx.merge(graphdef, *states)
        batch, width = tokens.shape
        rows = jnp.arange(batch)

        def step(_, carry):
            tokens, lengths, done = carry
            mask = (jnp.arange(width)[None, :] < lengths[:, None]).astype(jnp.int32)
            h = model.hidden_states(module, tokens, mask)
            last = h[rows, lengths - 1]
            logits = module.token_embedding(last[:, None, :], reverse=True)[:, 0]
            nxt = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(tokens.dtype)
            write = ~done & (lengths < width)
            at = jnp.minimum(lengths, width - 1)
            tokens = tokens.at[rows, at].set(jnp.where(write, nxt, tokens[rows, at]))
            lengths = lengths + write
            done = done | jnp.isin(nxt, stop_ids) | ~write
            return tokens, lengths, done

        done = jnp.zeros((batch,), bool)
        tokens, lengths, _ = jax.lax.fori_loop(0, max_new_tokens, step, (tokens, lengths, done))
        return tokens, lengths

    return greedy


def stop_ids(lm: model.LanguageModel) -> list[int]:
    ids = {lm.tokenizer.eos_id}
    marker = lm.tokenizer.token_id(chat.END_OF_TURN[lm.chat_format])
    if marker is not None:
        ids.add(marker)
    return sorted(i for i in ids if i is not None)


def encode_prompt(lm: model.LanguageModel, segments) -> list[int]:
    tok = lm.tokenizer
    ids = [tok.bos_id] if tok.bos_id is not None else []
    for text, _ in segments:
        ids += tok.encode(text)
    return ids


def greedy_complete(lm, greedy, states, prompts: list[list[int]], max_new_tokens: int,
                    batch_size: int = 64) -> list[str]:
    """Greedy completions (text, stop marker removed) of tokenized prompts.

    ``greedy`` comes from ``make_greedy``; ``states`` are the model's states from ``nnx.split``."""
    stops = stop_ids(lm)
    width = max(len(p) for p in prompts) + max_new_tokens
    width = -(-width // 8) * 8  # round up: fewer distinct shapes
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - n)  # fixed batch shape
        tokens = np.full((batch_size, width), lm.tokenizer.pad_id, np.int32)
        for i, p in enumerate(chunk):
            tokens[i, : len(p)] = p
        lengths = np.array([len(p) for p in chunk], np.int32)
        new_tokens, new_lengths = greedy(
            tuple(states), jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(stops, jnp.int32)
        )
        new_tokens, new_lengths = np.asarray(new_tokens), np.asarray(new_lengths)
        for i in range(n):
            gen = [int(t) for t in new_tokens[i, lengths[i] : new_lengths[i]] if int(t) not in stops]
            out.append(lm.tokenizer.decode(gen))
    return out


def exact_match(lm, greedy, states, pairs, max_new_tokens: int) -> tuple[float, list[str]]:
    """Fraction of held-out prompts whose greedy completion, stripped, equals the reference."""
    prompts = [encode_prompt(lm, segs) for segs, _ in pairs]
    completions = greedy_complete(lm, greedy, states, prompts, max_new_tokens)
    hits = [c.strip() == ref.strip() for c, (_, ref) in zip(completions, pairs)]
    return float(np.mean(hits)) if hits else 0.0, completions


def complete_chat(lm, module, prompts: list[str], max_new_tokens: int = 32) -> list[str]:
    """Greedy answers of ``module`` (e.g. ``runs.load(...).module``) to user messages, each
    rendered with the model family's chat template and its generation prompt."""
    graphdef, *states = nnx.split(module)
    greedy = make_greedy(graphdef, max_new_tokens)
    encoded = [
        encode_prompt(lm, chat.render([{"role": "user", "content": p}], lm.chat_format,
                                      add_generation_prompt=True))
        for p in prompts
    ]
    return greedy_complete(lm, greedy, states, encoded, max_new_tokens,
                           batch_size=min(64, len(prompts)))
