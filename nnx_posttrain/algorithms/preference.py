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

from nnx_posttrain import config as config_lib, model
from nnx_posttrain.algorithms.pairs import (  # noqa: F401  (pair_logps, sequence_logps: re-exported)
    PairAlgorithm,
    nll_terms,
    pair_logps,
    sequence_logps,
)
from nnx_posttrain.algorithms.reference import Reference
from nnx_posttrain.losses.common import Pairs
from nnx_posttrain.losses.dpo import DPOOptions, DPOPairs, dpo, ld_split, wpo_weights
from nnx_posttrain.losses.router import RouterOptions, with_router_aux
from nnx_posttrain.losses.preference import CPOOptions, ORPOOptions, SimPOOptions, cpo, orpo, simpo


# ----------------------------------------------------------------------------- configs
# Each is its loss family's options (nnx_posttrain.losses: the fields, TRL's defaults, the
# checks) plus what the algorithm itself reads.


@dataclasses.dataclass(frozen=True)
class DPOConfig(DPOOptions, RouterOptions):
    """Direct Preference Optimization and its TRL 1.16 variants (a mixture-of-experts policy
    adds its router load-balancing loss, as TRL's DPOTrainer; not the reference's)."""

    def problems(self) -> list[str]:
        return DPOOptions.problems(self) + RouterOptions.problems(self)

    reference: Reference = "auto"
    """lora_base (LoRA on), copy (full fine-tuning), or precompute; auto picks the first two."""


@dataclasses.dataclass
class DPORunConfig(config_lib.Config):
    """A DPO run's settings: the common ones, DPO's own under ``algo``."""

    algo: DPOConfig = dataclasses.field(default_factory=DPOConfig)


@dataclasses.dataclass(frozen=True)
class SimPOConfig(SimPOOptions, RouterOptions):
    """SimPO: reference-free, length-normalised margin loss."""

    def problems(self) -> list[str]:
        return SimPOOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class SimPORunConfig(config_lib.Config):
    """A SimPO run's settings: the common ones, SimPO's own under ``algo``."""

    algo: SimPOConfig = dataclasses.field(default_factory=SimPOConfig)


@dataclasses.dataclass(frozen=True)
class CPOConfig(CPOOptions, RouterOptions):
    """Contrastive Preference Optimization: reference-free preference loss + NLL on chosen."""

    def problems(self) -> list[str]:
        return CPOOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class CPORunConfig(config_lib.Config):
    """A CPO run's settings: the common ones, CPO's own under ``algo``."""

    algo: CPOConfig = dataclasses.field(default_factory=CPOConfig)


@dataclasses.dataclass(frozen=True)
class ORPOConfig(ORPOOptions, RouterOptions):
    """Odds Ratio Preference Optimization: NLL + beta * odds-ratio term, reference-free."""

    def problems(self) -> list[str]:
        return ORPOOptions.problems(self) + RouterOptions.problems(self)

    nll_tokens: Literal["prompt_and_completion", "completion"] = "prompt_and_completion"
    """Tokens of the chosen NLL term: TRL's (every token of prompt and answer) or the answer's."""


@dataclasses.dataclass
class ORPORunConfig(config_lib.Config):
    """An ORPO run's settings: the common ones, ORPO's own under ``algo``."""

    algo: ORPOConfig = dataclasses.field(default_factory=ORPOConfig)


# ----------------------------------------------------------------------------- pairwise


class _CacheKey:
    """``algorithm`` as ``reference.precomputed`` sees it, under another name: LD-DPO's cached
    reference log-probs carry the tails, so they must not share a cache with plain DPO's."""

    def __init__(self, algorithm, name):
        self._algorithm, self.name = algorithm, name

    def __getattr__(self, key):
        return getattr(self._algorithm, key)


def policy_pairs(algorithm, module, batch) -> tuple:
    """The policy's pair log-probs (``pair_logps``) and, for a mixture of experts, its router
    logits for the load-balancing loss (``losses.router``; the reference's are never taken)."""
    with model.routers_captured(module, algorithm.cfg.router_aux_loss_coef) as routers:
        lp = algorithm.pair_logps(module, batch)
    return lp, routers.routed()


class DPO(PairAlgorithm):
    """DPO and TRL 1.16's variants (``losses.dpo``). LD-DPO (``ld_alpha``) splits each side's
    per-token log-probs at the pair's shared length; WPO (``use_weighting``) also asks the policy
    forward for log sum_v p_v^2 per position; both come from the one concatenated forward."""

    name = "dpo"
    Config = DPOConfig
    RunConfig = DPORunConfig
    defaults = dict(optim=dict(learning_rate=1e-6))  # TRL's DPOTrainer

    def setup(self, module):
        super().setup(module)
        self.with_log_sum_sq = self.cfg.use_weighting

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
        lp, routed = policy_pairs(self, module, batch)
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
        return with_router_aux(dpo(DPOPairs(chosen, rejected, ref_c, ref_r,
                                            self.chosen_nll(batch, lp), lp["chosen_len"],
                                            lp["rejected_len"], weights), c), routed)

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


class SimPO(PairAlgorithm):
    name = "simpo"
    Config = SimPOConfig
    RunConfig = SimPORunConfig
    defaults = dict(optim=dict(learning_rate=1e-6))  # TRL's CPOTrainer (SimPO)

    def loss(self, module, batch, reference=None):
        lp, routed = policy_pairs(self, module, batch)
        nll = self.chosen_nll(batch, lp) if self.cfg.nll_weight else None
        return with_router_aux(simpo(Pairs(lp["chosen_avg"], lp["rejected_avg"], nll), self.cfg),
                               routed)


class CPO(PairAlgorithm):
    """TRL's CPOTrainer: summed log-probs for sigmoid / hinge, averaged for ipo and simpo;
    ``alphapo`` is simpo with nll_weight 0 (TRL's shorthand)."""

    name = "cpo"
    Config = CPOConfig
    RunConfig = CPORunConfig
    defaults = dict(optim=dict(learning_rate=1e-6))  # TRL's CPOTrainer

    def loss(self, module, batch, reference=None):
        lp, routed = policy_pairs(self, module, batch)
        key = "_avg" if self.cfg.averaged else ""
        nll = self.chosen_nll(batch, lp) if self.cfg.wants_nll else None
        return with_router_aux(cpo(Pairs(lp["chosen" + key], lp["rejected" + key], nll), self.cfg),
                               routed)


class ORPO(PairAlgorithm):
    """TRL's ORPOTrainer takes the chosen NLL over every attended token of the chosen row (prompt
    and answer; ``nll_tokens``), so those positions go through the vocabulary projection too."""

    name = "orpo"
    Config = ORPOConfig
    RunConfig = ORPORunConfig
    defaults = dict(optim=dict(learning_rate=1e-6))  # TRL's ORPOTrainer

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
        lp, routed = policy_pairs(self, module, batch)
        if self.cfg.nll_tokens == "completion":
            nll = self.chosen_nll(batch, lp)
        else:
            mask = batch["chosen_nll_mask"].astype(jnp.float32)
            nll = nll_terms(batch, -jnp.sum(lp["chosen_tokens"] * mask, axis=-1), mask.sum(-1))
        return with_router_aux(orpo(Pairs(lp["chosen_avg"], lp["rejected_avg"], nll), self.cfg),
                               routed)
