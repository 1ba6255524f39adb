"""The SFT loss: next-token negative log-likelihood on the loss tokens. Imports jax only.

Returns ``(total, weight, metrics)`` as every loss of :mod:`nnx_posttrain.losses` (see
:mod:`nnx_posttrain.losses.common`): the NLL summed over tokens and the number of tokens.
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
