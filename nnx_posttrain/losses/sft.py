"""The SFT loss: next-token negative log-likelihood on the loss tokens. Imports jax only.

Returns ``(total, weight, metrics)`` as every loss of :mod:`nnx_posttrain.losses` (see
:mod:`nnx_posttrain.losses.common`): the NLL summed over tokens and the number of tokens.
"""

from __future__ import annotations

import jax.numpy as jnp


def sft(token_logps, loss_mask, correct=None):
    """Next-token negative log-likelihood on the tokens where ``loss_mask`` is 1.

    loss = -sum_t mask_t * log p(x_t | x_<t) / sum_t mask_t

    ``token_logps[b, t]`` is log p(x_t | x_<t) (see ``model.token_logprobs``); prompt and padding
    positions have mask 0 and contribute nothing, whatever their log-probs. ``correct[b, t]``
    (1 where x_t is the model's most likely next token, ``token_logprobs(with_correct=True)``)
    adds TRL's ``mean_token_accuracy``: the share of the loss tokens predicted exactly.
    """
    mask = loss_mask.astype(jnp.float32)
    nll = -jnp.sum(token_logps * mask)
    tokens = jnp.sum(mask)
    metrics = {"loss": (nll, tokens)}
    if correct is not None:
        metrics["mean_token_accuracy"] = (jnp.sum(correct * mask), tokens)
    return nll, tokens, metrics
