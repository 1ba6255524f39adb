"""Losses: pure functions of arrays. No model, no I/O.

Every loss returns ``(total, weight, metrics)``:

- ``total``: the loss *summed* over its unit (tokens for SFT, pairs for preference losses);
- ``weight``: how many units were summed, so that ``total / weight`` is the mean, and summing
  ``total`` and ``weight`` over micro-batches before dividing gives exactly the large-batch mean
  (gradient accumulation is token-weighted, not a mean of means);
- ``metrics``: ``name -> (sum, count)``, reduced the same way.
"""

from __future__ import annotations

import jax.numpy as jnp


def sft(token_logps, loss_mask):
    """Next-token negative log-likelihood on the tokens where ``loss_mask`` is 1.

    loss = -sum_t mask_t * log p(x_t | x_<t) / sum_t mask_t

    ``token_logps[b, t]`` is log p(x_t | x_<t) (see ``model.token_logprobs``); prompt and padding
    positions have mask 0 and contribute nothing, whatever their log-probs.
    """
    mask = loss_mask.astype(jnp.float32)
    nll = -jnp.sum(token_logps * mask)
    tokens = jnp.sum(mask)
    return nll, tokens, {"loss": (nll, tokens)}
