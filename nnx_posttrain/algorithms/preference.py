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

from nnx_posttrain import errors
from nnx_posttrain.algorithms.base import USER_DATA, merged
from nnx_posttrain.algorithms.pairs import (  # noqa: F401  (pair_logps, sequence_logps: re-exported)
    PairAlgorithm,
    nll_terms,
    pair_logps,
    sequence_logps,
)
from nnx_posttrain.algorithms.reference import Reference
from nnx_posttrain.algorithms.registry import register
from nnx_posttrain.losses import preference as pl
from nnx_posttrain.losses.dpo import dpo, ld_split, wpo_weights


def _floats(text: str | None) -> list[float] | None:
    return None if not text else [float(x) for x in text.split(",")]


def _names(text: str) -> list[str] | str:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    return parts[0] if len(parts) == 1 else parts


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass
class DPOConfig:
    """Direct Preference Optimization and its TRL 1.16 variants."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (deviation from the reference)."""
    loss_type: str = "sigmoid"
    """sigmoid, cdpo, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm; comma-separated for a weighted combination (MPO: sigmoid,bco_pair,sft)."""
    loss_weights: str | None = None
    """Comma-separated weights of a combination (default: all 1)."""
    label_smoothing: float = 0.0
    """Label noise of cdpo / robust / aot, EXO's epsilon (exo_pair); sigmoid ignores it, as TRL."""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence",
                               "alpha_divergence"] = "reverse_kl"
    """f-DPO's divergence to the reference (for the terms built on the chosen - rejected difference)."""
    f_alpha_divergence_coef: float = 0.5
    """alpha of alpha_divergence."""
    use_weighting: bool = False
    """WPO: weight each pair by the policy's length-normalised (aligned) probabilities of both answers."""
    ld_alpha: float | None = None
    """LD-DPO: weight of the log-probs past the shorter answer's length (1 = DPO, 0 = cut)."""
    discopop_tau: float = 0.05
    """DiscoPOP's temperature."""
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
    """Weight of the chosen NLL term (token mean over the batch): > 0 gives CPO-SimPO."""
    label_smoothing: float = 0.0
    alpha: float = 0.0
    """AlphaPO's reward shape (1 - p^-alpha) / alpha; 0 = SimPO."""


@dataclasses.dataclass
class CPOConfig:
    """Contrastive Preference Optimization: reference-free preference loss + NLL on chosen."""

    beta: float = 0.1
    loss_type: Literal["sigmoid", "hinge", "ipo", "simpo", "alphapo"] = "sigmoid"
    """sigmoid, hinge, ipo; simpo (SimPO's margin loss on averaged log-probs); alphapo (simpo with nll-weight 0, TRL's shorthand)."""
    label_smoothing: float = 0.0
    nll_weight: float = 1.0
    """TRL's cpo_alpha: weight of the chosen NLL (token mean over the batch)."""
    simpo_gamma: float = 0.5
    """Target reward margin of loss-type simpo / alphapo."""
    alpha: float = 0.0
    """AlphaPO's reward shape (1 - p^-alpha) / alpha for every loss type; 0 = log p."""


@dataclasses.dataclass
class ORPOConfig:
    """Odds Ratio Preference Optimization: NLL + beta * odds-ratio term, reference-free."""

    beta: float = 0.1
    """TRL's beta (the paper's lambda)."""
    nll_tokens: Literal["prompt_and_completion", "completion"] = "prompt_and_completion"
    """Tokens of the chosen NLL term: TRL's (every token of prompt and answer) or the answer's."""


# ----------------------------------------------------------------------------- pairwise


class _CacheKey:
    """``algorithm`` as ``reference.precomputed`` sees it, under another name: LD-DPO's cached
    reference log-probs carry the tails, so they must not share a cache with plain DPO's."""

    def __init__(self, algorithm, name):
        self._algorithm, self.name = algorithm, name

    def __getattr__(self, key):
        return getattr(self._algorithm, key)


@register
class DPO(PairAlgorithm):
    """DPO and TRL 1.16's variants (``losses.dpo``). LD-DPO (``ld_alpha``) splits each side's
    per-token log-probs at the pair's shared length; WPO (``use_weighting``) also asks the policy
    forward for log sum_v p_v^2 per position; both come from the one concatenated forward."""

    name = "dpo"
    Config = DPOConfig
    defaults = merged(USER_DATA, optim=dict(learning_rate=1e-6))  # TRL's DPOTrainer

    def setup(self, module):
        super().setup(module)
        c = self.cfg
        self.with_log_sum_sq = c.use_weighting
        if c.ld_alpha is not None and not 0.0 <= c.ld_alpha <= 1.0:
            raise errors.ConfigError(f"--algo.ld-alpha must be in [0, 1], got {c.ld_alpha}")
        try:  # the loss's own argument checks, before any data is read
            one = jnp.ones(1)
            dpo(one, one, one, one, **self._options(one, one, one, one))
        except ValueError as e:
            raise errors.ConfigError(f"dpo: {e} (--algo.loss-type / --algo.*)") from None

    def _options(self, chosen_nll, chosen_lengths, rejected_lengths, pair_weights):
        c = self.cfg
        return dict(
            beta=c.beta, loss_type=_names(c.loss_type), label_smoothing=c.label_smoothing,
            loss_weights=_floats(c.loss_weights), chosen_nll=chosen_nll,
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
            f_divergence_type=c.f_divergence_type,
            f_alpha_divergence_coef=c.f_alpha_divergence_coef, discopop_tau=c.discopop_tau,
            pair_weights=pair_weights if c.use_weighting else None)

    def _ld(self, lp):
        """(chosen, rejected) summed log-probs, LD-DPO's shared + ld_alpha * tail when set."""
        a = self.cfg.ld_alpha
        if a is None:
            return lp["chosen"], lp["rejected"]
        cs, ct, rs, rt = ld_split(lp["chosen_tokens"], lp["rejected_tokens"], lp["chosen_mask"],
                                  lp["rejected_mask"])
        return cs + a * ct, rs + a * rt

    def loss(self, module, batch, reference=None):
        c = self.cfg
        lp = self.pair_logps(module, batch)
        chosen, rejected = self._ld(lp)
        if self.reference_mode == "precompute":
            ref_c, ref_r = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
            if c.ld_alpha is not None:  # cached: the whole sums and the tails
                ref_c = ref_c - (1.0 - c.ld_alpha) * batch["ref_chosen_tail_logps"]
                ref_r = ref_r - (1.0 - c.ld_alpha) * batch["ref_rejected_tail_logps"]
        else:
            ref_c, ref_r = self._ld(self.reference_pair(module, reference, batch))
        weights = None
        if c.use_weighting:
            weights = (wpo_weights(lp["chosen_tokens"], lp["chosen_lss"], lp["chosen_mask"])
                       * wpo_weights(lp["rejected_tokens"], lp["rejected_lss"],
                                     lp["rejected_mask"]))
        return dpo(chosen, rejected, ref_c, ref_r, **self._options(
            self.chosen_nll(batch, lp), lp["chosen_len"], lp["rejected_len"], weights))

    def inputs(self, run, params):
        if self.reference_mode != "precompute" or self.cfg.ld_alpha is None:
            return super().inputs(run, params)
        from nnx_posttrain.algorithms import reference
        from nnx_posttrain.algorithms.base import DatasetBatches, Inputs, eval_loss_batches

        cache = reference.precomputed(run, _CacheKey(self, "dpo_ld"), params)
        return Inputs(DatasetBatches(self, run, cache["train"]),
                      eval_loss_batches(self, run, cache["eval"]))

    def reference_logps(self, module, batch):
        lp = self.pair_logps(module, batch, with_log_sum_sq=False)
        out = {"ref_chosen_logps": lp["chosen"], "ref_rejected_logps": lp["rejected"]}
        if self.cfg.ld_alpha is not None:
            _, ct, _, rt = ld_split(lp["chosen_tokens"], lp["rejected_tokens"],
                                    lp["chosen_mask"], lp["rejected_mask"])
            out.update(ref_chosen_tail_logps=ct, ref_rejected_tail_logps=rt)
        return out


@register
class SimPO(PairAlgorithm):
    name = "simpo"
    Config = SimPOConfig
    defaults = merged(USER_DATA, optim=dict(learning_rate=1e-6))  # TRL's CPOTrainer (SimPO)

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        c = self.cfg
        return pl.simpo(
            lp["chosen_avg"], lp["rejected_avg"], beta=c.beta, gamma=c.gamma,
            gamma_beta_ratio=c.gamma_beta_ratio, nll_weight=c.nll_weight,
            chosen_nll=self.chosen_nll(batch, lp) if c.nll_weight else None,
            label_smoothing=c.label_smoothing, alpha=c.alpha,
        )


@register
class CPO(PairAlgorithm):
    """TRL's CPOTrainer: summed log-probs for sigmoid / hinge, averaged for ipo and simpo;
    ``alphapo`` is simpo with nll_weight 0 (TRL's shorthand)."""

    name = "cpo"
    Config = CPOConfig
    defaults = merged(USER_DATA, optim=dict(learning_rate=1e-6))  # TRL's CPOTrainer

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        c = self.cfg
        if c.loss_type in ("simpo", "alphapo"):
            nll_weight = 0.0 if c.loss_type == "alphapo" else c.nll_weight
            return pl.simpo(
                lp["chosen_avg"], lp["rejected_avg"], beta=c.beta, gamma=c.simpo_gamma,
                nll_weight=nll_weight, chosen_nll=self.chosen_nll(batch, lp) if nll_weight else None,
                label_smoothing=c.label_smoothing, alpha=c.alpha)
        key = "_avg" if c.loss_type == "ipo" else ""
        return pl.cpo(
            lp["chosen" + key], lp["rejected" + key], beta=c.beta, loss_type=c.loss_type,
            label_smoothing=c.label_smoothing, chosen_nll=self.chosen_nll(batch, lp),
            nll_weight=c.nll_weight, alpha=c.alpha,
        )


@register
class ORPO(PairAlgorithm):
    """TRL's ORPOTrainer takes the chosen NLL over every attended token of the chosen row (prompt
    and answer; ``nll_tokens``), so those positions go through the vocabulary projection too."""

    name = "orpo"
    Config = ORPOConfig
    defaults = merged(USER_DATA, optim=dict(learning_rate=1e-6))  # TRL's ORPOTrainer

    def nll_mask(self, batch):
        if self.cfg.nll_tokens == "completion":
            return batch["chosen_loss_mask"]
        mask = np.array(batch["chosen_attention_mask"], copy=True)
        mask[:, 0] = 0  # the first token has no prediction
        return mask

    def prepare_pairs(self, batch):
        if self.cfg.nll_tokens == "completion" or "chosen_loss_mask" not in batch:
            return super().prepare_pairs(batch)
        nll = self.nll_mask(batch)
        # project the vocabulary at the NLL tokens; the loss masks stay the completions'
        prepared = super().prepare_pairs(dict(batch, chosen_loss_mask=nll))
        return dict(prepared, chosen_loss_mask=batch["chosen_loss_mask"], chosen_nll_mask=nll)

    def loss(self, module, batch, reference=None):
        lp = self.pair_logps(module, batch)
        if self.cfg.nll_tokens == "completion":
            nll = self.chosen_nll(batch, lp)
        else:
            mask = batch["chosen_nll_mask"].astype(jnp.float32)
            nll = nll_terms(batch, -jnp.sum(lp["chosen_tokens"] * mask, axis=-1), mask.sum(-1))
        return pl.orpo(lp["chosen_avg"], lp["rejected_avg"], nll, beta=self.cfg.beta)
