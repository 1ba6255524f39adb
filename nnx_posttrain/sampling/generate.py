"""Greedy generation for evaluation (exact-match accuracy on held-out prompts).

Built on the KV-cache sampler (``nnx_posttrain.sampling.sampler``) at temperature 0: one
compilation per (batch, prompt width) shape, decoding stops as soon as every row has produced a
stop token.
"""

from __future__ import annotations

import numpy as np

from nnx_posttrain.sampling import sampler

# Re-exported: evaluation and data code build prompts with these.
stop_ids = sampler.stop_ids
encode_prompt = sampler.encode_prompt


def make_greedy(graphdef, max_new_tokens: int):
    """A greedy decoder for ``greedy_complete``: the sampler of ``sampler.make_sampler`` (called
    with temperature 0). The graphdef of a Keras model is not hashable, so it is closed over
    rather than passed as a static argument."""
    return sampler.make_sampler(graphdef, max_new_tokens)


def greedy_complete(lm, greedy, states, prompts: list[list[int]], max_new_tokens: int,
                    batch_size: int = 64) -> list[str]:
    """Greedy completions (text, stop marker removed) of tokenized prompts.

    ``greedy`` comes from ``make_greedy`` (its own ``max_new_tokens`` applies); ``states`` are the
    model's states from ``nnx.split``."""
    del max_new_tokens  # fixed when ``greedy`` was made
    return sampler.sample_ids(lm, greedy, states, prompts, sampler.GREEDY,
                              batch_size=min(batch_size, len(prompts)))


def exact_match(lm, greedy, states, pairs, max_new_tokens: int) -> tuple[float, list[str]]:
    """Fraction of held-out prompts whose greedy completion, stripped, equals the reference."""
    prompts = [encode_prompt(lm, segs) for segs, _ in pairs]
    completions = greedy_complete(lm, greedy, states, prompts, max_new_tokens)
    hits = [c.strip() == ref.strip() for c, (_, ref) in zip(completions, pairs)]
    return float(np.mean(hits)) if hits else 0.0, completions


def complete_chat(lm, module, prompts: list[str], max_new_tokens: int = 32) -> list[str]:
    """Greedy answers of ``module`` (e.g. ``runs.load(...).module``) to user messages, each
    rendered with the model family's chat template and its generation prompt."""
    return [texts[0] for texts in sampler.sample_texts(
        lm, module, prompts, sampler.Sampling(max_new_tokens))]
