"""Algorithms: what a training step computes, as a loss over a batch.

An algorithm is a settings dataclass plus ``loss(module, batch) -> (total, weight, metrics)``.
It runs the model through ``model.token_logprobs`` and hands arrays to a pure function of
``nnx_posttrain.losses``; the one training loop (``nnx_posttrain.train``) does everything else.
"""

from __future__ import annotations

import dataclasses

from nnx_posttrain import losses, model


@dataclasses.dataclass
class SFTConfig:
    """Supervised fine-tuning: next-token loss on completions only (prompt tokens carry none)."""


class SFT:
    name = "sft"
    Config = SFTConfig

    def __init__(self, cfg: SFTConfig, logprob_chunk: int = 128):
        self.cfg = cfg
        self.logprob_chunk = logprob_chunk

    def loss(self, module, batch):
        logps = model.token_logprobs(
            module, batch["input_ids"], batch["attention_mask"], self.logprob_chunk
        )
        return losses.sft(logps, batch["loss_mask"])


ALGORITHMS = {"sft": SFT}
