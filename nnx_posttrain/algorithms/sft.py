"""Supervised fine-tuning."""

from __future__ import annotations

import dataclasses
import math

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.losses.router import RouterOptions, with_router_aux
from nnx_posttrain.losses.sft import sft


@dataclasses.dataclass(frozen=True)
class SFTConfig(RouterOptions):
    """Supervised fine-tuning: next-token loss on completions only (prompt tokens carry none);
    a mixture-of-experts model adds its router load-balancing loss (TRL's SFTTrainer)."""


@dataclasses.dataclass
class SFTRunConfig(config_lib.Config):
    """A SFT run's settings: the common ones, SFT's own under ``algo``."""

    algo: SFTConfig = dataclasses.field(default_factory=SFTConfig)


class SFT(AlgorithmBase):
    name = "sft"
    Config = SFTConfig
    RunConfig = SFTRunConfig
    data_kind = "sft"
    sequences_per_example = 1
    packs = True
    defaults = dict(optim=dict(learning_rate=2e-5))  # TRL's SFTConfig

    def loss(self, module, batch, reference=None):
        with model.routers_captured(module, self.cfg.router_aux_loss_coef) as routers:
            logps, correct = model.token_logprobs(
                module, batch["input_ids"], batch["attention_mask"],
                model.Projection(self.logprob_chunk, correct=True),
                positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))
        return with_router_aux(sft(logps, batch["loss_mask"], correct), routers.routed())

    def eval_metrics(self, metrics):
        """The loss is the mean NLL per token: its exponential is the perplexity."""
        if math.isfinite(metrics.get("loss", math.nan)):
            metrics = dict(metrics, perplexity=math.exp(min(metrics["loss"], 50.0)))
        return metrics

    def eval_metric_names(self, names):
        return names | {"perplexity"} if "loss" in names else names
