"""PPO with a value head on the policy's backbone."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain.algorithms.base import ONLINE_DATA, merged
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses import rl


@dataclasses.dataclass
class PPOConfig(SamplingConfig):
    """PPO with a value head on the policy's backbone, GAE, clipped value loss and a per-token
    KL penalty in the reward (Ouyang et al. 2022; TRL's PPOTrainer)."""

    num_generations: int = 1
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    kl_coef: float = 0.05
    """Per-token KL penalty in the reward."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimate in the reward: k1 = log pi - log pi_ref, k3 = (r - 1) - log r (r = pi_ref / pi; >= 0, lower variance)."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (scale only, the mean kept) over the completion tokens before GAE."""
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None
    """Subtracted from the score of a completion with no stop token."""


@register
class PPO(OnlineAlgorithm):
    name = "ppo"
    Config = PPOConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=3e-6))  # TRL's PPOTrainer
    head = "value"  # nnx_posttrain.model.heads.PolicyWithValue

    def needs_reference(self):
        return bool(self.cfg.kl_coef)

    def policy(self, module):
        return module.backbone

    def policy_view(self, graphdef, params, frozen_model):
        backbone_graphdef, *states = nnx.split(nnx.merge(graphdef, params, frozen_model).backbone)
        return backbone_graphdef, tuple(states)

    def attach(self, rollouts):
        # the rollout's log-probs and values under the generating policy, without gradient
        self._logps_and_values = rollouts.compile(
            lambda module, reference, ids, att, positions: module.logps_and_values(
                ids, att, self.logprob_chunk, self.logprob_temperature, positions=positions))

    def make_batch(self, batch, scores, finished, rollouts, state):
        c = self.cfg
        ids, att = batch["input_ids"], batch["attention_mask"]
        mask = batch["loss_mask"].astype(np.float32)
        old_logps, old_values = (np.asarray(x) for x in jax.device_get(
            self._logps_and_values(state, ids, att, batch["positions"])))
        scores = scores.astype(np.float32)
        if c.missing_eos_penalty is not None:
            scores = scores - c.missing_eos_penalty * (~finished)
        # TRL's: the sampled completions' negative log-likelihood, and how many ended with EOS
        metrics = {"objective/scores": float(scores.mean()),
                   "objective/entropy": float((-old_logps * mask).sum(axis=1).mean()),
                   "val/num_eos_tokens": float(np.sum(finished))}
        ref = (rollouts.logps(batch, state, False, True)["ref_logps"]
               if self.reference_mode is not None else None)
        per_token, kl = (np.asarray(x) for x in rl.ppo_rewards(
            scores, old_logps, ref, mask, kl_coef=c.kl_coef, kl_estimator=c.kl_estimator))
        if ref is not None:
            metrics["objective/kl"] = float(kl.sum(axis=1).mean())
            metrics["objective/non_score_reward"] = float(-c.kl_coef * kl.sum(axis=1).mean())
        metrics["objective/rlhf_reward"] = float(per_token.sum(axis=1).mean())
        if c.whiten_rewards:  # TRL's masked_whiten(rewards, shift_mean=False)
            per_token = np.asarray(rl.whiten(jnp.asarray(per_token), jnp.asarray(mask),
                                             shift_mean=False)) * mask
        adv, returns = rl.gae(jnp.asarray(per_token), jnp.asarray(old_values), jnp.asarray(mask),
                              c.gamma, c.lam)
        if c.whiten_advantages:
            adv = rl.whiten(adv, jnp.asarray(mask)) * mask
        batch.update(old_logps=old_logps, old_values=old_values, advantages=np.asarray(adv),
                     returns=np.asarray(returns))
        return batch, metrics

    def loss(self, module, batch, reference=None):
        c = self.cfg
        (logps, entropy), values = module.logps_and_values(
            batch["input_ids"], batch["attention_mask"], self.logprob_chunk,
            self.logprob_temperature, with_entropy=True, positions=batch.get("positions"))
        return rl.ppo_loss(logps, batch["old_logps"], batch["advantages"], batch["returns"], values,
                           batch["old_values"], batch["loss_mask"], cliprange=c.cliprange,
                           cliprange_value=c.cliprange_value, vf_coef=c.vf_coef, entropies=entropy)
