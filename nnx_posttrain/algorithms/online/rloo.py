"""RLOO, as TRL 1.16's RLOOTrainer: REINFORCE Leave-One-Out (Ahmadian et al. 2024)."""

from __future__ import annotations

import dataclasses

import numpy as np

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.base import ONLINE_DATA, merged
from nnx_posttrain.algorithms.online.grpo import policy_inputs, scored_rewards
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm
from nnx_posttrain.losses import rl
from nnx_posttrain.losses.rloo import RLOOOptions, rloo_loss
from nnx_posttrain.losses.router import RouterOptions, with_router_aux


@dataclasses.dataclass(frozen=True)
class RLOOConfig(SamplingConfig, RLOOOptions, RouterOptions):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024), as TRL 1.16's RLOOTrainer: baseline = the
    group's other rewards, the KL to the reference (beta) subtracted from the reward, one clipped
    importance ratio per sequence (a mixture-of-experts policy adds its router load-balancing
    loss, as TRL's RLOOTrainer)."""

    num_generations: int = 4

    def problems(self) -> list[str]:
        return RLOOOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class RLOORunConfig(config_lib.Config):
    """An RLOO run's settings: the common ones, RLOO's own under ``algo``."""

    algo: RLOOConfig = dataclasses.field(default_factory=RLOOConfig)


class RLOO(OnlineAlgorithm):
    """The KL to the reference enters the reward (sequence sum of log pi_old - log pi_ref), not
    the loss; the loss has one clipped ratio per sequence (``losses.rloo.rloo_loss``)."""

    name = "rloo"
    Config = RLOOConfig
    RunConfig = RLOORunConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=1e-6))  # TRL's RLOOTrainer
    min_generations = 2  # the leave-one-out baseline needs another completion
    runs_tools = True
    reads_images = True  # TRL's prompt-only vision format: rollouts and loss read the images

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
        with model.routers_captured(module, self.cfg.router_aux_loss_coef) as routers:
            inputs = policy_inputs(self, module, batch)
        return with_router_aux(rloo_loss(inputs, self.cfg), routers.routed())
