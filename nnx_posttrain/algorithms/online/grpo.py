"""GRPO (every loss type of TRL 1.16), as TRL 1.16's GRPOTrainer."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.base import ONLINE_DATA, merged
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm
from nnx_posttrain.losses import rl
from nnx_posttrain.losses.grpo import GRPOOptions, PolicyInputs, clipped_policy_loss
from nnx_posttrain.losses.router import RouterOptions, with_router_aux


@dataclasses.dataclass(frozen=True)
class GRPOConfig(SamplingConfig, GRPOOptions, RouterOptions):
    """Group Relative Policy Optimization (Shao et al. 2024) and its variants (TRL's options; a
    mixture-of-experts policy adds its router load-balancing loss, as TRL's GRPOTrainer)."""

    def problems(self) -> list[str]:
        return GRPOOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class GRPORunConfig(config_lib.Config):
    """A GRPO run's settings: the common ones, GRPO's own under ``algo``."""

    algo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)


def scored_rewards(rollouts) -> np.ndarray:
    """[B] weighted sum of the reward functions, NaN where every function returned None (TRL's
    unscorable rows; the rollout's own ``scores`` count those as 0)."""
    per_fn = rollouts.rewards_per_func
    total = np.nansum(per_fn * rollouts.reward_weights[None, :], axis=1)
    return np.where(np.isnan(per_fn).all(axis=1), np.nan, total).astype(np.float32)


def policy_inputs(algorithm: OnlineAlgorithm, module, batch) -> PolicyInputs:
    """The policy's log-probs and entropies on a rollout batch, with its advantages, mask,
    generating policy's log-probs (``old_logps``; the policy's own, detached, with one
    optimisation iteration per rollout) and reference log-probs (when it has them)."""
    logps, entropy = algorithm.policy_logps(module, batch)
    old = batch.get("old_logps")
    old = jax.lax.stop_gradient(logps) if old is None else old
    return PolicyInputs(logps, old, batch["advantages"], batch["loss_mask"],
                        batch.get("ref_logps"), entropy)


class GRPO(OnlineAlgorithm):
    name = "grpo"
    Config = GRPOConfig
    RunConfig = GRPORunConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=1e-6))  # TRL's GRPOTrainer
    min_generations = 2  # as TRL: a group of one has no advantage
    runs_tools = True
    reads_images = True  # TRL's prompt-only vision format: rollouts and loss read the images

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
        with model.routers_captured(module, self.cfg.router_aux_loss_coef) as routers:
            inputs = policy_inputs(self, module, batch)
        return with_router_aux(clipped_policy_loss(inputs, self.cfg), routers.routed())
