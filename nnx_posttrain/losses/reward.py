"""Reward modelling: the Bradley-Terry pairwise loss of a scalar reward head and its options,
as TRL 1.16.0's ``trl/trainer/reward_trainer.py`` (``compute_loss``). Conventions: see
:mod:`nnx_posttrain.losses.common`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import Metrics, Options, _count, _f32, _mean_metric


@dataclasses.dataclass(frozen=True)
class RewardOptions(Options):
    """The reward model's options: TRL's RewardConfig (``--algo.*`` of ``reward``)."""

    center_rewards_coefficient: float | None = None
    """Weight of the reward-centering term (mean squared reward); none by default."""


class RewardPairs(NamedTuple):
    """The arrays of :func:`reward_bt`: the scalar rewards of the chosen and rejected
    completions, ``[batch]`` (a trailing axis of size 1, as a score head gives, is dropped), and
    TRL's optional per-pair ``margin`` column."""

    chosen: jax.Array
    rejected: jax.Array
    margin: jax.Array | None = None


def reward_bt(rewards: RewardPairs, options: RewardOptions):
    r"""Bradley-Terry pairwise loss for a reward model, as TRL's RewardTrainer.

        loss = -log s(r_c - r_r - m) + coef * (r_c + r_r)^2

    Bradley and Terry, "Rank Analysis of Incomplete Block Designs" (Biometrika, 1952), as used for
    RLHF reward models in "Training language models to follow instructions with human feedback"
    (Ouyang et al., arXiv:2203.02155), eq. 1. The optional per-pair ``margin`` m (TRL's ``margin``
    column) is Llama 2's preference-strength margin ("Llama 2: Open Foundation and Fine-Tuned Chat
    Models", arXiv:2307.09288, eq. 2). The optional centering term with
    ``center_rewards_coefficient`` (TRL's ``RewardConfig.center_rewards_coefficient``) pushes
    rewards to mean zero ("Helping or Herding? Reward Model Ensembles Mitigate but do not Eliminate
    Reward Hacking", Eisenstein et al., arXiv:2312.09244); TRL adds coef * mean((r_c + r_r)^2),
    which is the per-pair term above averaged.

    Metrics: ``accuracy`` (r_c > r_r, ties wrong, margin not applied; TRL's name), ``margin`` =
    mean(r_c - r_r) (TRL's name), ``mean_reward`` over chosen and rejected, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins``, ``loss``. TRL's ``min_reward`` / ``max_reward`` are
    not sums, so they are not returned.
    """

    def vector(x):
        x = _f32(x)
        return x[..., 0] if x.ndim == 2 and x.shape[-1] == 1 else x

    chosen, rejected = vector(rewards.chosen), vector(rewards.rejected)
    diff = chosen - rejected
    logits = diff if rewards.margin is None else diff - vector(rewards.margin)
    per_pair = -jax.nn.log_sigmoid(logits)
    coef = options.center_rewards_coefficient
    if coef is not None:
        per_pair = per_pair + _f32(coef) * jnp.square(chosen + rejected)
    both = jnp.concatenate([chosen, rejected])
    metrics: Metrics = {
        "loss": _mean_metric(per_pair),
        "accuracy": _mean_metric((chosen > rejected).astype(jnp.float32)),
        "margin": _mean_metric(diff),
        "mean_reward": _mean_metric(both),
        "rewards/chosen": _mean_metric(chosen),
        "rewards/rejected": _mean_metric(rejected),
        "rewards/margins": _mean_metric(diff),
    }
    return jnp.sum(per_pair), _count(chosen), metrics
