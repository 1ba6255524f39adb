"""GRPO (every loss type of TRL 1.16) and RLOO, as TRL 1.16's GRPOTrainer and RLOOTrainer."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import numpy as np

from nnx_posttrain.algorithms.base import ONLINE_DATA, merged
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses import rl


@dataclasses.dataclass
class GRPOConfig(SamplingConfig):
    """Group Relative Policy Optimization (Shao et al. 2024) and its variants (TRL's options)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo",
                       "vespo"] = "dapo"
    """grpo (per-sequence mean), bnpo (per micro-batch token mean), dr_grpo (sum / (sequences x max length)), dapo (token mean over the batch; TRL's default), cispo (clipped IS weight), sapo (soft gate), luspo (per-sequence sum), vespo (gamma-weighted sequence ratio)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = (
        "sum_then_normalize")
    """Several reward functions: sum the weighted rewards then normalise per group, or normalise each function per group, sum, then normalise over the batch (GDPO)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sequence (mean log-ratio; GSPO)."""
    epsilon: float = 0.2
    """Lower clipping range of the ratio."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher, e.g. 0.28; cispo's weight cap, e.g. 5.0); default: epsilon."""
    delta: float | None = None
    """Two-sided clipping: cap the unclipped ratio at delta (INTELLECT-2; > 1 + epsilon_high)."""
    beta: float = 0.0
    """Weight of the KL penalty (k3 estimator) to the reference; 0 needs no reference."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the importance ratio (DeepSeek-V3.2's unbiased KL gradient; TRL's default)."""
    top_entropy_quantile: float = 1.0
    """Keep the policy loss only on the top quantile of tokens by entropy (0.2 in the paper; 1 = all)."""
    off_policy_mask_threshold: float | None = None
    """Drop sequences with negative advantage whose mean KL(old || current) exceeds this (DeepSeek-V3.2)."""
    sapo_temperature_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    sapo_temperature_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages."""
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


@dataclasses.dataclass
class RLOOConfig(SamplingConfig):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024), as TRL 1.16's RLOOTrainer: baseline = the
    group's other rewards, the KL to the reference (beta) subtracted from the reward, one clipped
    importance ratio per sequence."""

    num_generations: int = 4
    beta: float = 0.05
    """Weight of the sequence KL (sum of log pi_old - log pi_ref) subtracted from the reward."""
    epsilon: float = 0.2
    """Lower clipping range of the sequence ratio."""
    epsilon_high: float | None = None
    """Upper clipping range; default: epsilon."""
    normalize_advantages: bool = False
    """(A - mean) / (std + 1e-4) over the batch."""
    reward_clip_range: tuple[float, float] | None = None
    """Clip the rewards to (min, max) before the KL penalty."""


def scored_rewards(rollouts) -> np.ndarray:
    """[B] weighted sum of the reward functions, NaN where every function returned None (TRL's
    unscorable rows; the rollout's own ``scores`` count those as 0)."""
    per_fn = rollouts.rewards_per_func
    total = np.nansum(per_fn * rollouts.reward_weights[None, :], axis=1)
    return np.where(np.isnan(per_fn).all(axis=1), np.nan, total).astype(np.float32)


@register
class GRPO(OnlineAlgorithm):
    name = "grpo"
    Config = GRPOConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=1e-6))  # TRL's GRPOTrainer
    min_generations = 2  # as TRL: a group of one has no advantage
    runs_tools = True

    def problems(self):
        c = self.cfg
        problems = [f"--algo.{name.replace('_', '-')} must be {rule}, got {getattr(c, name)}"
                    for name, ok, rule in (
                        ("top_entropy_quantile", 0 <= c.top_entropy_quantile <= 1, "in [0, 1]"),
                        ("epsilon", c.epsilon >= 0, ">= 0"))
                    if not ok]
        if c.loss_type == "dr_grpo" and c.max_completion_length < 1:
            problems.append("--algo.loss-type dr_grpo needs --algo.max-completion-length >= 1")
        return problems + super().problems()

    def advantages(self, rollouts):
        c = self.cfg
        if c.multi_objective_aggregation == "normalize_then_sum":
            return rl.normalize_then_sum_advantages(rollouts.rewards_per_func,
                                                    rollouts.reward_weights, c.num_generations)
        return rl.group_advantages(scored_rewards(rollouts), c.num_generations, c.scale_rewards)

    def make_batch(self, batch, scores, finished, rollouts, state):
        c = self.cfg
        batch.update(rollouts.logps(batch, state, c.num_iterations > 1,
                                    self.reference_mode is not None))
        batch["advantages"] = np.asarray(self.advantages(rollouts), np.float32)
        return batch, {}

    def loss(self, module, batch, reference=None):
        c = self.cfg
        logps, entropy = self.policy_logps(module, batch)
        old = batch.get("old_logps")
        old = jax.lax.stop_gradient(logps) if old is None else old
        return rl.clipped_policy_loss(
            logps, old, batch["advantages"], batch["loss_mask"], epsilon=c.epsilon,
            epsilon_high=c.epsilon_high, beta=c.beta if "ref_logps" in batch else 0.0,
            ref_logps=batch.get("ref_logps"), loss_type=c.loss_type,
            max_completion_length=c.max_completion_length, entropies=entropy,
            importance_sampling_level=c.importance_sampling_level, delta=c.delta,
            top_entropy_quantile=c.top_entropy_quantile,
            use_bias_correction_kl=c.use_bias_correction_kl,
            off_policy_mask_threshold=c.off_policy_mask_threshold,
            sapo_temperature_pos=c.sapo_temperature_pos,
            sapo_temperature_neg=c.sapo_temperature_neg, vespo_k_pos=c.vespo_k_pos,
            vespo_lambda_pos=c.vespo_lambda_pos, vespo_k_neg=c.vespo_k_neg,
            vespo_lambda_neg=c.vespo_lambda_neg,
        )


@register
class RLOO(OnlineAlgorithm):
    """The KL to the reference enters the reward (sequence sum of log pi_old - log pi_ref), not
    the loss; the loss has one clipped ratio per sequence (``losses.rl.rloo_loss``)."""

    name = "rloo"
    Config = RLOOConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=1e-6))  # TRL's RLOOTrainer
    min_generations = 2  # the leave-one-out baseline needs another completion
    runs_tools = True

    def problems(self):
        clip = self.cfg.reward_clip_range
        own = ([f"--algo.reward-clip-range: min {clip[0]} > max {clip[1]}"]
               if clip is not None and clip[0] > clip[1] else [])
        return own + super().problems()

    def make_batch(self, batch, scores, finished, rollouts, state):
        c = self.cfg
        with_ref = self.reference_mode is not None
        logps = rollouts.logps(batch, state, c.num_iterations > 1 or with_ref, with_ref)
        rewards = scored_rewards(rollouts)
        if c.reward_clip_range is not None:
            rewards = np.clip(rewards, *c.reward_clip_range)
        metrics = {}
        if with_ref:
            mask = batch["loss_mask"].astype(np.float32)
            per_token = (logps["old_logps"] - logps["ref_logps"]) * mask
            rewards = rewards - c.beta * per_token.sum(axis=1)
            metrics["kl"] = float(per_token.sum() / max(mask.sum(), 1.0))  # TRL: token mean
        # normalised over the scored completions only, as TRL (the others get 0)
        adv = rl.leave_one_out_advantages(rewards, c.num_generations,
                                          nan_to_zero=not c.normalize_advantages)
        if c.normalize_advantages:
            adv = rl.normalize_advantages(adv)
        if c.num_iterations > 1:
            batch["old_logps"] = logps["old_logps"]
        batch["advantages"] = np.asarray(adv, np.float32)
        return batch, metrics

    def loss(self, module, batch, reference=None):
        logps, entropy = self.policy_logps(module, batch)
        old = batch.get("old_logps")
        old = jax.lax.stop_gradient(logps) if old is None else old
        return rl.rloo_loss(logps, old, batch["advantages"], batch["loss_mask"],
                            epsilon=self.cfg.epsilon, epsilon_high=self.cfg.epsilon_high,
                            entropies=entropy)
