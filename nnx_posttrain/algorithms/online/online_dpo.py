"""Online DPO: two samples per prompt, ranked by the reward, DPO loss.

Besides DPO's metrics it logs TRL's OnlineDPOTrainer ones: ``objective/kl`` (the mean over the
completions of their summed log pi - log pi_ref), ``objective/entropy`` (the mean of -log pi
summed over each completion), ``objective/non_score_reward`` (-beta times the KL),
``objective/rlhf_reward`` (the completion's reward plus that), ``objective/scores``,
``objective/scores_margin``, ``val/contain_eos_token`` and ``beta``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.base import ONLINE_DATA, merged
from nnx_posttrain.algorithms.online.options import SamplingConfig
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm
from nnx_posttrain.algorithms.preference import pair_logps
from nnx_posttrain.losses.common import _mean_metric
from nnx_posttrain.losses.dpo import DPOOptions, DPOPairs, dpo
from nnx_posttrain.losses.router import RouterOptions, with_router_aux


@dataclasses.dataclass(frozen=True)
class OnlineDPOConfig(SamplingConfig, RouterOptions):
    """Online DPO (Guo et al. 2024): two samples per prompt, ranked by the reward, DPO loss.

    A mixture-of-experts policy adds its router load-balancing loss (not the reference's)."""

    num_generations: int = 2
    # TRL's OnlineDPOConfig: DPO's beta and two of its loss types, with DPO's defaults
    beta: float = DPOOptions.beta
    loss_type: Literal["sigmoid", "ipo"] = DPOOptions.loss_type

    @property
    def dpo_options(self) -> DPOOptions:
        """The DPO loss's options these settings give."""
        return DPOOptions(beta=self.beta, loss_type=self.loss_type)


@dataclasses.dataclass
class OnlineDPORunConfig(config_lib.Config):
    """An online DPO run's settings: the common ones, OnlineDPO's own under ``algo``."""

    algo: OnlineDPOConfig = dataclasses.field(default_factory=OnlineDPOConfig)


class OnlineDPO(OnlineAlgorithm):
    """Of each prompt's two samples the higher-reward one is chosen (ties: the first)."""

    name = "online_dpo"
    Config = OnlineDPOConfig
    RunConfig = OnlineDPORunConfig
    defaults = merged(ONLINE_DATA, optim=dict(learning_rate=5e-7))  # TRL's OnlineDPOTrainer
    reads_images = True  # TRL's prompt-only vision format: the pairs read their prompt's images

    def needs_reference(self):
        return True

    def problems(self):
        own = (["online_dpo samples exactly 2 completions per prompt (--algo.num-generations 2)"]
               if self.cfg.num_generations != 2 else [])
        return own + super().problems()

    def make_batch(self, batch, scores, finished, rollouts, state):
        pairs = scores.reshape(-1, 2)
        first_wins = pairs[:, 0] >= pairs[:, 1]
        chosen = np.arange(0, len(scores), 2) + np.where(first_wins, 0, 1)
        rejected = np.arange(0, len(scores), 2) + np.where(first_wins, 1, 0)
        out = {}
        for key in ("input_ids", "attention_mask", "loss_mask", "positions"):
            out[f"chosen_{key}"] = batch[key][chosen]
            out[f"rejected_{key}"] = batch[key][rejected]
        if "pixel_values" in batch:  # a pair's two completions share their prompt's images
            out["pixel_values"] = batch["pixel_values"][chosen]
        out["chosen_score"] = np.asarray(scores[chosen], np.float32)  # for objective/rlhf_reward
        out["rejected_score"] = np.asarray(scores[rejected], np.float32)
        return out, {"objective/scores": float(np.mean(scores)),
                     "objective/scores_margin": float(np.abs(pairs[:, 0] - pairs[:, 1]).mean()),
                     "val/contain_eos_token": float(np.mean(finished)), "beta": self.cfg.beta}

    def loss(self, module, batch, reference=None):
        # TRL's OnlineDPOTrainer does not add it: transformers' convention (output_router_logits on)
        with model.routers_captured(module, self.cfg.router_aux_loss_coef) as routers:
            lp = pair_logps(module, batch, self.logprob_chunk)
        ref = self.reference(module, reference, lambda m: pair_logps(m, batch, self.logprob_chunk))
        total, weight, metrics = dpo(DPOPairs(lp["chosen"], lp["rejected"], ref["chosen"],
                                              ref["rejected"]), self.cfg.dpo_options)
        # TRL's objective/* over both completions of every pair (sequence sums, no gradient)
        logps = jnp.concatenate([lp["chosen"], lp["rejected"]])
        kl = logps - jnp.concatenate([ref["chosen"], ref["rejected"]])
        scores = jnp.concatenate([batch["chosen_score"], batch["rejected_score"]])
        for name, values in (("objective/kl", kl), ("objective/entropy", -logps),
                             ("objective/non_score_reward", -self.cfg.beta * kl),
                             ("objective/rlhf_reward", scores - self.cfg.beta * kl)):
            metrics[name] = _mean_metric(values)
        return with_router_aux((total, weight, metrics), routers.routed())
