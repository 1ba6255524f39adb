"""Algorithms: what a training step computes, as a loss over a batch.

An algorithm is a settings dataclass plus ``loss(module, batch, reference) -> (total, weight,
metrics)``. It runs the model through ``model.token_logprobs`` and hands arrays to a pure function
of ``nnx_posttrain.losses`` / ``nnx_posttrain.preference_losses``; the one training loop
(``nnx_posttrain.train``) does everything else. ``data_kind`` names the tokenized view of the data
the loss reads (see ``nnx_posttrain.data.make_transform``).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from nnx_posttrain import model
from nnx_posttrain.losses import sft as losses  # import line only: losses.sft is the function


class Algorithm:
    """Base: what the training loop needs besides ``loss``."""

    name = "algorithm"
    data_kind = "preference"  # which tokenized view of the data the loss reads
    reference_mode: str | None = None  # None: reference-free
    generates = True  # the module is a language model: exact-match evaluation applies
    online = False  # generates its own training batches (see nnx_posttrain.online)

    def __init__(self, cfg, logprob_chunk: int = 128):
        self.cfg = cfg
        self.logprob_chunk = logprob_chunk

    def build_module(self, lm: model.LanguageModel) -> nnx.Module:
        return lm.module

    def setup(self, module) -> None:
        """Resolve settings that depend on the model (e.g. the reference mode)."""
        mode = getattr(self.cfg, "reference", None)
        if mode is None:
            return
        if mode == "auto":
            mode = "lora_base" if model.has_lora(module) else "copy"
        if mode == "lora_base" and not model.has_lora(module):
            raise SystemExit("--algo.reference lora_base needs LoRA (--lora.rank > 0)")
        self.reference_mode = mode

    def policy_view(self, graphdef, params, frozen_model):
        """(graphdef, states) of the language model inside the trained module, for generation."""
        return graphdef, (params, frozen_model)

    def prepare(self, batch: dict) -> dict:
        """Host-side preparation of a numpy batch before it goes to the device: for each loss
        mask ``*loss_mask``, the positions that carry loss as ``*positions``
        (``model.scored_positions``), so that only those go through the vocabulary projection."""
        masks = [key for key in batch if key.endswith("loss_mask")]
        positions = model.scored_positions(*(batch[k] for k in masks)) if masks else None
        if positions is None:
            return batch
        return dict(batch, **{k.replace("loss_mask", "positions"): p
                              for k, p in zip(masks, positions)})

    def reference(self, module, reference_module, batch, forward):
        """``forward(m)`` evaluated as the reference, without gradient."""
        if self.reference_mode == "precompute":
            return None
        if self.reference_mode == "copy":
            return jax.lax.stop_gradient(forward(reference_module))
        with model.lora_disabled(module):
            return jax.lax.stop_gradient(forward(module))



@dataclasses.dataclass
class SFTConfig:
    """Supervised fine-tuning: next-token loss on completions only (prompt tokens carry none)."""


class SFT(Algorithm):
    name = "sft"
    Config = SFTConfig
    data_kind = "sft"

    def loss(self, module, batch, reference=None):
        logps = model.token_logprobs(
            module, batch["input_ids"], batch["attention_mask"], self.logprob_chunk,
            segment_ids=batch.get("segment_ids"), positions=batch.get("positions"),
        )
        return losses.sft(logps, batch["loss_mask"])


def registry() -> dict[str, type[Algorithm]]:
    from nnx_posttrain import online, preference

    return {"sft": SFT, **preference.ALGORITHMS, **online.ALGORITHMS}
