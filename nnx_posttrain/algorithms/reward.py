"""Reward modelling: a Bradley-Terry scalar head on the backbone, trained on preference pairs
(TRL 1.16's RewardTrainer; ``losses.preference.reward_bt``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.losses.reward import RewardOptions, RewardPairs, reward_bt
from nnx_posttrain.losses.router import RouterOptions, with_router_aux


@dataclasses.dataclass(frozen=True)
class RewardConfig(RewardOptions, RouterOptions):
    """Bradley-Terry reward model: a scalar head on the backbone, trained on preference pairs.

    A mixture-of-experts backbone adds its router load-balancing loss."""

    def problems(self) -> list[str]:
        return RewardOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class RewardRunConfig(config_lib.Config):
    """A Reward run's settings: the common ones, Reward's own under ``algo``."""

    algo: RewardConfig = dataclasses.field(default_factory=RewardConfig)


class Reward(AlgorithmBase):
    name = "reward"
    Config = RewardConfig
    RunConfig = RewardRunConfig
    defaults: dict = {}  # TRL's RewardTrainer: its learning rate (1e-4) is the common default
    head = "reward"  # nnx_posttrain.model.heads.RewardModel
    generates = False

    def prepare(self, batch):
        return batch  # the reward head reads hidden states: no vocabulary projection

    def loss(self, module, batch, reference=None):
        ids = jnp.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]], axis=0)
        att = jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]], 0)
        # TRL's RewardTrainer does not add it: transformers' convention (output_router_logits on)
        with model.routers_captured(module.backbone, self.cfg.router_aux_loss_coef) as routers:
            rewards = module(ids, att)
        n = batch["chosen_input_ids"].shape[0]
        return with_router_aux(reward_bt(RewardPairs(rewards[:n], rewards[n:],
                                                     batch.get("margin")), self.cfg),
                               routers.routed())
