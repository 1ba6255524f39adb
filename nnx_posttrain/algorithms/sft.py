"""Supervised fine-tuning."""

from __future__ import annotations

import dataclasses

from nnx_posttrain import model
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses.sft import sft


@dataclasses.dataclass
class SFTConfig:
    """Supervised fine-tuning: next-token loss on completions only (prompt tokens carry none)."""


@register
class SFT(AlgorithmBase):
    name = "sft"
    Config = SFTConfig
    data_kind = "sft"

    def loss(self, module, batch, reference=None):
        logps, correct = model.token_logprobs(
            module, batch["input_ids"], batch["attention_mask"], self.logprob_chunk,
            segment_ids=batch.get("segment_ids"), positions=batch.get("positions"),
            with_correct=True,
        )
        return sft(logps, batch["loss_mask"], correct)
