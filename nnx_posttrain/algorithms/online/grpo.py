"""GRPO (and its loss types) and RLOO."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import numpy as np

from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm, SamplingConfig
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses import rl


@dataclasses.dataclass
class GRPOConfig(SamplingConfig):
    """Group Relative Policy Optimization (Shao et al. 2024) and its variants."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Token aggregation: grpo (per-sequence mean), bnpo (per micro-batch token mean), dr_grpo (sum / (sequences x max length)), dapo (token mean over the batch; TRL's default)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    epsilon: float = 0.2
    """Lower clipping range of the ratio."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher, e.g. 0.28); default: epsilon."""
    beta: float = 0.0
    """Weight of the KL penalty (k3 estimator) to the reference; 0 needs no reference."""


@dataclasses.dataclass
class RLOOConfig(GRPOConfig):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): baseline = the group's other rewards; the
    KL to the reference (beta) is subtracted from the reward, as TRL's RLOOTrainer."""

    num_generations: int = 4
    beta: float = 0.05
    normalize_advantages: bool = False
    """Whiten the advantages over the batch."""


@register
class GRPO(OnlineAlgorithm):
    name = "grpo"
    Config = GRPOConfig

    def advantages(self, scores, batch):
        return rl.group_advantages(scores, self.cfg.num_generations, self.cfg.scale_rewards)

    def make_batch(self, batch, scores, finished, rollouts, state):
        c = self.cfg
        batch.update(rollouts.logps(batch, state, c.num_iterations > 1,
                                    self.reference_mode is not None))
        batch["advantages"] = np.asarray(self.advantages(scores, batch), np.float32)
        return batch, {}

    def loss(self, module, batch, reference=None):
        c = self.cfg
        logps, entropy = self.policy_logps(module, batch)
        old = batch.get("old_logps")
        old = jax.lax.stop_gradient(logps) if old is None else old
        return rl.clipped_policy_loss(
            logps, old, batch["advantages"], batch["loss_mask"], epsilon=c.epsilon,
            epsilon_high=c.epsilon_high, beta=c.beta if "ref_logps" in batch else 0.0,
            ref_logps=batch.get("ref_logps"),
            loss_type=c.loss_type, max_completion_length=c.max_completion_length, entropies=entropy,
        )


@register
class RLOO(GRPO):
    """The KL to the reference enters the reward (sequence sum of log pi_old - log pi_ref), not
    the loss (the batch carries no ``ref_logps``, so GRPO's loss adds no KL term)."""

    name = "rloo"
    Config = RLOOConfig

    def make_batch(self, batch, scores, finished, rollouts, state):
        with_ref = self.reference_mode is not None
        logps = rollouts.logps(batch, state, True, with_ref)
        metrics = {}
        if with_ref:
            mask = batch["loss_mask"].astype(np.float32)
            kl = ((logps["old_logps"] - logps["ref_logps"]) * mask).sum(axis=1)
            scores = scores - self.cfg.beta * kl
            metrics["kl"] = float(kl.mean())
        adv = rl.leave_one_out_advantages(scores, self.cfg.num_generations)
        if self.cfg.normalize_advantages:
            adv = rl.whiten(adv)
        if self.cfg.num_iterations > 1:
            batch["old_logps"] = logps["old_logps"]
        batch["advantages"] = np.asarray(adv, np.float32)
        return batch, metrics
