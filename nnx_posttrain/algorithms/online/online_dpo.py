"""Online DPO: two samples per prompt, ranked by the reward, DPO loss."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm, SamplingConfig
from nnx_posttrain.algorithms.preference import pair_logps
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses.dpo import dpo


@dataclasses.dataclass
class OnlineDPOConfig(SamplingConfig):
    """Online DPO (Guo et al. 2024): two samples per prompt, ranked by the reward, DPO loss."""

    num_generations: int = 2
    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"


@register
class OnlineDPO(OnlineAlgorithm):
    """Of each prompt's two samples the higher-reward one is chosen (ties: the first)."""

    name = "online_dpo"
    Config = OnlineDPOConfig

    def needs_reference(self):
        return True

    def prompts_per_step(self, batch_size):
        if self.cfg.num_generations != 2:
            raise SystemExit("online_dpo samples exactly 2 completions per prompt "
                             "(--algo.num-generations 2)")
        return super().prompts_per_step(batch_size)

    def make_batch(self, batch, scores, finished, rollouts, state):
        pairs = scores.reshape(-1, 2)
        first_wins = pairs[:, 0] >= pairs[:, 1]
        chosen = np.arange(0, len(scores), 2) + np.where(first_wins, 0, 1)
        rejected = np.arange(0, len(scores), 2) + np.where(first_wins, 1, 0)
        out = {}
        for key in ("input_ids", "attention_mask", "loss_mask", "positions"):
            out[f"chosen_{key}"] = batch[key][chosen]
            out[f"rejected_{key}"] = batch[key][rejected]
        return out, {"objective/scores_margin": float(np.abs(pairs[:, 0] - pairs[:, 1]).mean())}

    def loss(self, module, batch, reference=None):
        lp = pair_logps(module, batch, self.logprob_chunk)
        ref = self.reference(module, reference, lambda m: pair_logps(m, batch, self.logprob_chunk))
        return dpo(lp["chosen"], lp["rejected"], ref["chosen"], ref["rejected"],
                   beta=self.cfg.beta, loss_type=self.cfg.loss_type)
