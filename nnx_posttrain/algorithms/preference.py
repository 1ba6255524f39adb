"""Preference algorithms: DPO (and its variants), SimPO, CPO, ORPO, KTO, reward modelling.

Each is a settings dataclass plus ``loss(module, batch, reference)``: it runs the model (chosen and
rejected in ONE concatenated forward), gets the reference log-probs the configured way
(``nnx_posttrain.algorithms.reference``), and hands arrays to a pure function of
``nnx_posttrain.losses``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

from nnx_posttrain import model
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.algorithms.reference import Reference
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses import preference as pl
from nnx_posttrain.losses.dpo import dpo


def _floats(text: str | None) -> list[float] | None:
    return None if not text else [float(x) for x in text.split(",")]


def _names(text: str) -> list[str] | str:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    return parts[0] if len(parts) == 1 else parts


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass
class DPOConfig:
    """Direct Preference Optimization and its TRL variants."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (deviation from the reference)."""
    loss_type: str = "sigmoid"
    """sigmoid, hinge, ipo, robust, bco_pair, sppo_hard, nca_pair, apo_zero, apo_down, sigmoid_norm, sft; comma-separated for a weighted combination (MPO: sigmoid,bco_pair,sft)."""
    loss_weights: str | None = None
    """Comma-separated weights of a combination (default: all 1)."""
    label_smoothing: float = 0.0
    """Assumed label noise (cDPO / robust)."""
    reference: Reference = "auto"
    """lora_base (LoRA on), copy (full fine-tuning), or precompute; auto picks the first two."""


@dataclasses.dataclass
class SimPOConfig:
    """SimPO: reference-free, length-normalised margin loss."""

    beta: float = 2.0
    """Reward scale."""
    gamma: float | None = None
    """Target margin as TRL's simpo_gamma (the margin itself)."""
    gamma_beta_ratio: float | None = None
    """Target margin as the SimPO paper's ratio gamma/beta; default 0.25 when neither is set."""
    nll_weight: float = 0.0
    """Weight of the chosen NLL term: > 0 gives CPO-SimPO."""
    label_smoothing: float = 0.0


@dataclasses.dataclass
class CPOConfig:
    """Contrastive Preference Optimization: reference-free preference loss + NLL on chosen."""

    beta: float = 0.1
    loss_type: Literal["sigmoid", "hinge", "ipo"] = "sigmoid"
    label_smoothing: float = 0.0
    nll_weight: float = 1.0
    """TRL's cpo_alpha."""


@dataclasses.dataclass
class ORPOConfig:
    """Odds Ratio Preference Optimization: NLL + beta * odds-ratio term, reference-free."""

    beta: float = 0.1
    """TRL's beta (the paper's lambda)."""


@dataclasses.dataclass
class KTOConfig:
    """Kahneman-Tversky Optimization on unpaired desirable / undesirable examples."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference: Reference = "auto"


@dataclasses.dataclass
class RewardConfig:
    """Bradley-Terry reward model: a scalar head on the backbone, trained on preference pairs."""

    center_rewards_coefficient: float | None = None
    """Weight of the reward-centering term (mean squared reward); none by default."""


# ----------------------------------------------------------------------------- shared machinery


def sequence_logps(module, ids, attention, loss_mask, chunk, positions=None):
    """(summed, averaged, lengths) completion log-probs of each row, float32 [rows];
    ``positions`` as in ``model.token_logprobs``."""
    token = model.token_logprobs(module, ids, attention, chunk, positions=positions)
    mask = loss_mask.astype(jnp.float32)
    summed = jnp.sum(token * mask, axis=-1)
    lengths = jnp.sum(mask, axis=-1)
    return summed, summed / jnp.maximum(lengths, 1.0), lengths


def pair_logps(module, batch, chunk, concatenated: bool = True):
    """Chosen and rejected log-probs: dict of [batch] arrays. ``concatenated`` runs both through
    the model in ONE forward (the default); False runs two (a benchmark variant)."""
    if not concatenated:
        out = {}
        for name in ("chosen", "rejected"):
            s, a, n = sequence_logps(module, batch[f"{name}_input_ids"],
                                     batch[f"{name}_attention_mask"], batch[f"{name}_loss_mask"],
                                     chunk, batch.get(f"{name}_positions"))
            out.update({name: s, f"{name}_avg": a, f"{name}_len": n})
        return out
    cat = lambda k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]], axis=0)
    summed, avg, lengths = sequence_logps(
        module, cat("input_ids"), cat("attention_mask"), cat("loss_mask"), chunk,
        cat("positions") if "chosen_positions" in batch else None)
    n = batch["chosen_input_ids"].shape[0]
    return {
        "chosen": summed[:n], "rejected": summed[n:],
        "chosen_avg": avg[:n], "rejected_avg": avg[n:],
        "chosen_len": lengths[:n], "rejected_len": lengths[n:],
    }


class PairAlgorithm(AlgorithmBase):
    """Trains on chosen / rejected pairs; ``pair_forward`` "separate" is a benchmark variant."""

    pair_forward = "concatenated"

    def pair_logps(self, module, batch):
        return pair_logps(module, batch, self.logprob_chunk, self.pair_forward == "concatenated")

    def reference_pair(self, module, reference_module, batch):
        if self.reference_mode == "precompute":
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        ref = self.reference(module, reference_module, lambda m: self.pair_logps(m, batch))
        return ref["chosen"], ref["rejected"]


def _chosen_nll(lp):
    return -lp["chosen_avg"]


@register
class DPO(PairAlgorithm):
    name = "dpo"
    Config = DPOConfig

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        ref_c, ref_r = self.reference_pair(module, reference, batch)
        return dpo(
            lp["chosen"], lp["rejected"], ref_c, ref_r, beta=self.cfg.beta,
            loss_type=_names(self.cfg.loss_type), label_smoothing=self.cfg.label_smoothing,
            loss_weights=_floats(self.cfg.loss_weights), chosen_nll=_chosen_nll(lp),
            chosen_lengths=lp["chosen_len"], rejected_lengths=lp["rejected_len"],
        )

    def reference_logps(self, module, batch):
        lp = self.pair_logps(module, batch)
        return {"ref_chosen_logps": lp["chosen"], "ref_rejected_logps": lp["rejected"]}


@register
class SimPO(PairAlgorithm):
    name = "simpo"
    Config = SimPOConfig

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        c = self.cfg
        return pl.simpo(
            lp["chosen_avg"], lp["rejected_avg"], beta=c.beta, gamma=c.gamma,
            gamma_beta_ratio=c.gamma_beta_ratio, nll_weight=c.nll_weight,
            chosen_nll=_chosen_nll(lp) if c.nll_weight else None, label_smoothing=c.label_smoothing,
        )


@register
class CPO(PairAlgorithm):
    name = "cpo"
    Config = CPOConfig

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        c = self.cfg
        key = "_avg" if c.loss_type == "ipo" else ""
        return pl.cpo(
            lp["chosen" + key], lp["rejected" + key], beta=c.beta, loss_type=c.loss_type,
            label_smoothing=c.label_smoothing, chosen_nll=_chosen_nll(lp), nll_weight=c.nll_weight,
        )


@register
class ORPO(PairAlgorithm):
    name = "orpo"
    Config = ORPOConfig

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        return pl.orpo(lp["chosen_avg"], lp["rejected_avg"], _chosen_nll(lp), beta=self.cfg.beta)


@register
class KTO(AlgorithmBase):
    """KTO's KL reference point uses mismatched completions: each prompt of the batch with the
    next example's completion (as TRL), built on the host by ``prepare``. Those pairs depend on
    the shuffled batch, so their reference log-probs cannot be precomputed."""

    name = "kto"
    Config = KTOConfig
    data_kind = "unpaired_preference"

    def setup(self, module):
        super().setup(module)
        if self.reference_mode == "precompute":
            raise SystemExit("kto: --algo.reference precompute is not supported (the KL pairs are "
                             "formed within each shuffled batch); use lora_base or copy")

    def prepare(self, batch):
        ids, att, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        n, width = ids.shape
        kl_ids = np.zeros_like(ids)
        kl_att = np.zeros_like(att)
        kl_mask = np.zeros_like(mask)
        for i in range(n):
            j = (i + 1) % n
            # the prompt is what precedes the completion: not the template's tokens after it
            loss_i = np.flatnonzero(mask[i] > 0)
            start = int(loss_i[0]) if len(loss_i) else width
            prompt = ids[i][:start][att[i][:start] > 0]
            completion = ids[j][(att[j] > 0) & (mask[j] > 0)]
            row = np.concatenate([prompt, completion])[:width]
            kl_ids[i, : len(row)] = row
            kl_att[i, : len(row)] = 1
            kl_mask[i, len(prompt) : len(row)] = 1
        return super().prepare(dict(batch, kl_input_ids=kl_ids, kl_attention_mask=kl_att,
                                    kl_loss_mask=kl_mask))

    def _forward(self, m, batch):
        cat = lambda k: jnp.concatenate([batch[k], batch[f"kl_{k}"]], axis=0)
        summed, _, _ = sequence_logps(m, cat("input_ids"), cat("attention_mask"),
                                      cat("loss_mask"), self.logprob_chunk,
                                      cat("positions") if "positions" in batch else None)
        n = batch["input_ids"].shape[0]
        return summed[:n], summed[n:]

    def loss(self, module, batch, reference=None):
        policy, kl_policy = self._forward(module, batch)
        if self.reference_mode == "precompute":
            ref, kl_ref = batch["ref_logps"], batch["ref_kl_logps"]
        else:
            ref, kl_ref = self.reference(module, reference, lambda m: self._forward(m, batch))
        return pl.kto(
            policy, ref, batch["label"], kl_policy, kl_ref, beta=self.cfg.beta,
            desirable_weight=self.cfg.desirable_weight, undesirable_weight=self.cfg.undesirable_weight,
        )

    def reference_logps(self, module, batch):
        ref, kl_ref = self._forward(module, batch)
        return {"ref_logps": ref, "ref_kl_logps": kl_ref}


@register
class Reward(AlgorithmBase):
    name = "reward"
    Config = RewardConfig
    head = "reward"  # nnx_posttrain.model.heads.RewardModel
    generates = False

    def prepare(self, batch):
        return batch  # the reward head reads hidden states: no vocabulary projection

    def loss(self, module, batch, reference=None):
        ids = jnp.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]], axis=0)
        att = jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]], 0)
        rewards = module(ids, att)
        n = batch["chosen_input_ids"].shape[0]
        return pl.reward_bt(rewards[:n], rewards[n:], margin=batch.get("margin"),
                            center_rewards_coefficient=self.cfg.center_rewards_coefficient)
