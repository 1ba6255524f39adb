"""Scalar heads on a KerasHub backbone, as ``nnx.Module``s: the reward model (reward modelling)
and the policy with a value head (PPO). The head is a Keras ``Dense`` layer, so its variables are
Keras variables like the backbone's (trainable filter, checkpoints and sharding treat them alike).
"""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
from flax import nnx

from nnx_posttrain.model.logprobs import Projection, hidden_states, logprobs_from_hidden


class RewardModel(nnx.Module):
    """A KerasHub backbone with a scalar head read at the last real token of each sequence."""

    def __init__(self, backbone, seed: int = 0):
        self.backbone = backbone
        self.head = keras.layers.Dense(
            1, name="reward_head", kernel_initializer=keras.initializers.RandomNormal(
                stddev=1.0 / np.sqrt(backbone.hidden_dim + 1), seed=seed),
        )
        self.head.build((None, backbone.hidden_dim))

    def __call__(self, token_ids, padding_mask):
        h = hidden_states(self.backbone, token_ids, padding_mask)
        last = jnp.maximum(jnp.sum(padding_mask, axis=-1) - 1, 0)
        picked = h[jnp.arange(h.shape[0]), last]
        return self.head(picked)[:, 0].astype(jnp.float32)


class PolicyWithValue(nnx.Module):
    """The policy's backbone with a scalar value head (initialised to zero) on its hidden states.

    ``values[:, t]`` estimates the return from token t on, read (like the log-prob of token t)
    from the hidden state of position t - 1."""

    def __init__(self, backbone, seed: int = 0):
        del seed  # zero-initialised: nothing random
        self.backbone = backbone
        self.value_head = keras.layers.Dense(1, name="value_head", kernel_initializer="zeros")
        self.value_head.build((None, backbone.hidden_dim))

    def logps_and_values(self, ids, att, chunk, temperature, with_entropy=False, positions=None):
        h = hidden_states(self.backbone, ids, att)
        values = self.value_head(h)[..., 0].astype(jnp.float32)
        values = jnp.pad(values[:, :-1], ((0, 0), (1, 0)))
        out = logprobs_from_hidden(self.backbone, h, ids,
                                   Projection(chunk, temperature, entropy=with_entropy), positions)
        return out, values


HEADS = {"reward": RewardModel, "value": PolicyWithValue}


def wrap(head: str | None, backbone, seed: int = 0):
    """The module an algorithm trains: the backbone itself (``head`` None), or the backbone with
    the named scalar head (``HEADS``) on top, its random initialisation drawn from ``seed``."""
    if head is None:
        return backbone
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {sorted(HEADS)}")
    return HEADS[head](backbone, seed=seed)
