"""Reference-free pairwise preference losses: SimPO, CPO, ORPO, and AlphaPO's reward shape. Pure
JAX functions of arrays and their options; no model, no I/O (DPO and its family: :mod:`.dpo`;
KTO: :mod:`.kto`; reward modelling: :mod:`.reward`).

Conventions (``(total, weight, metrics)``, which losses take summed and which averaged
log-probs, numerics, options): see :mod:`nnx_posttrain.losses.common`.

The definitions follow TRL 1.16.0: ``trl/experimental/cpo/cpo_trainer.py`` (``CPOTrainer.cpo_loss``,
``get_batch_loss_metrics``), ``trl/experimental/orpo/orpo_trainer.py`` (``odds_ratio_loss``,
``concatenated_forward``). Where TRL versions differ, the docstring says which one is followed
and how to get the other. The NLL terms (``Pairs.chosen_nll``) are per-pair arrays whose mean is
the term: TRL's token mean over the batch is
:func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example NLL sums.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import (
    Options,
    Pairs,
    _count,
    _f32,
    _is_python_number,
    _mean_metric,
    _pair_metrics,
    _smoothed_sigmoid,
    _uses,
    flag,
    log1mexp,
)

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")
_EXP_MAX = 80.0
# SimPO's margin when neither gamma nor gamma_beta_ratio is given: the SimPO repository's
# gamma_beta_ratio (with the default beta 2.0, gamma 0.5: TRL's default simpo_gamma)
_GAMMA_BETA_RATIO = 0.25


def alphapo_rewards(logps, alpha) -> jax.Array:
    """AlphaPO's reward shape ("AlphaPO: Reward Shape Matters for LLM Alignment", Gupta et al.,
    arXiv:2501.03884): r = (1 - p^(-alpha)) / alpha = -expm1(-alpha log p) / alpha, which tends
    to log p as alpha -> 0 (returned as is for alpha == 0, TRL's CPOTrainer default). The
    exponent is capped at 80 so very negative summed log-probs stay finite (TRL overflows)."""
    logps = _f32(logps)
    if _is_python_number(alpha) and alpha == 0:
        return logps
    alpha = _f32(alpha)
    return -jnp.expm1(jnp.minimum(-alpha * logps, _EXP_MAX)) / alpha


def _reference_free(per_pair, pairs: Pairs, rewards, beta, nll_weight):
    """The common end of SimPO and CPO: the optional NLL term, TRL's metrics (rewards are beta
    times the (AlphaPO-shaped) policy log-probs ``rewards``), the (sum, weight, metrics)."""
    chosen, rejected = _f32(pairs.chosen), _f32(pairs.rejected)
    if _uses(nll_weight):
        per_pair = per_pair + _f32(nll_weight) * _f32(pairs.chosen_nll)
    metrics = _pair_metrics(beta * rewards[0], beta * rewards[1], chosen, rejected, per_pair)
    if pairs.chosen_nll is not None:
        metrics["nll_loss"] = _mean_metric(jnp.broadcast_to(_f32(pairs.chosen_nll), chosen.shape))
    return jnp.sum(per_pair), _count(chosen), metrics


def _margin_loss(pairs: Pairs, beta, gamma, label_smoothing, alpha):
    """SimPO's per-pair loss -(1-eps) log s(z) - eps log s(-z), z = beta (R_c - R_r) - gamma, and
    the rewards (R_c, R_r) (AlphaPO-shaped averaged log-probs)."""
    rc, rr = alphapo_rewards(_f32(pairs.chosen), alpha), alphapo_rewards(_f32(pairs.rejected), alpha)
    logits = _f32(beta) * (rc - rr) - _f32(gamma)
    return _smoothed_sigmoid(logits, label_smoothing), (rc, rr)


# ----------------------------------------------------------------------------------------------
# SimPO
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SimPOOptions(Options):
    """SimPO's options (``--algo.*`` of ``simpo``). The margin comes in two parameterisations;
    give at most one:

    - ``gamma``: the margin in the paper's equation. TRL's ``CPOConfig.simpo_gamma`` *is* this
      gamma: TRL computes ``logits = (c - r) - simpo_gamma / beta`` and
      ``-logsigmoid(beta * logits)``, i.e. ``beta (c - r) - simpo_gamma``; the division by beta
      inside TRL cancels and does not make ``simpo_gamma`` a ratio.
    - ``gamma_beta_ratio``: gamma / beta, the knob of the SimPO repository (princeton-nlp/SimPO,
      ``SimPOConfig.gamma_beta_ratio``, default 0.25) and of the paper's hyper-parameter tables.

    With neither, gamma_beta_ratio = 0.25 (the SimPO repository's default), which with the
    default beta = 2.0 is gamma = 0.5 (also TRL's default ``simpo_gamma``)."""

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

    @property
    def margin(self) -> float:
        """gamma: given, or gamma_beta_ratio (default 0.25) times beta."""
        if self.gamma is not None:
            return self.gamma
        ratio = _GAMMA_BETA_RATIO if self.gamma_beta_ratio is None else self.gamma_beta_ratio
        return ratio * self.beta

    def problems(self) -> list[str]:
        if self.gamma is not None and self.gamma_beta_ratio is not None:
            return [f"give either {flag('gamma')} or {flag('gamma_beta_ratio')}, not both "
                    f"(gamma = gamma_beta_ratio * beta; got {self.gamma} and "
                    f"{self.gamma_beta_ratio})"]
        return []


def simpo(pairs: Pairs, options: SimPOOptions):
    r"""SimPO: reference-free, length-normalised logistic loss with a target reward margin.

        loss = -(1-eps) log s(z) - eps log s(-z) + nll_weight * chosen_nll,
        z = beta * (R(y_c) - R(y_r)) - gamma,   R(y) = avg log pi(y|x)

    "SimPO: Simple Preference Optimization with a Reference-Free Reward" (Meng, Xia, Chen,
    arXiv:2405.14734), eq. 6. ``pairs`` holds *length-averaged* log-probs of the completions.
    Pure SimPO by default (``nll_weight=0``); ``nll_weight > 0`` adds the chosen NLL (needs
    ``pairs.chosen_nll``), which is CPO-SimPO (TRL's CPOTrainer with ``loss_type="simpo"`` and
    ``cpo_alpha > 0``). ``label_smoothing`` is TRL's / the SimPO repo's conservative variant (0 in
    the paper). ``alpha`` != 0 is AlphaPO (:func:`alphapo_rewards`: R = (1 - p^(-alpha)) / alpha
    of the averaged log-prob; TRL's CPOTrainer ``alpha`` with ``loss_type="simpo"``, or
    ``"alphapo"``, which also sets ``cpo_alpha=0``). gamma: :attr:`SimPOOptions.margin`.

    Metrics as TRL's CPOTrainer: ``rewards/chosen`` = beta * avg logp chosen, ``rewards/rejected``,
    ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (the averaged
    log-probs), ``loss``, and ``nll_loss`` when ``chosen_nll`` is given.
    """
    if _uses(options.nll_weight) and pairs.chosen_nll is None:
        raise ValueError("nll_weight != 0 (CPO-SimPO) needs chosen_nll")
    per_pair, rewards = _margin_loss(pairs, options.beta, options.margin,
                                     options.label_smoothing, options.alpha)
    return _reference_free(per_pair, pairs, rewards, _f32(options.beta), options.nll_weight)


# ----------------------------------------------------------------------------------------------
# CPO
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CPOOptions(Options):
    """CPO's options: TRL's CPOConfig names (``nll_weight`` is its ``cpo_alpha``) and defaults
    (``--algo.*`` of ``cpo``)."""

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

    @property
    def averaged(self) -> bool:
        """Whether the loss takes length-averaged log-probs (ipo, simpo, alphapo; as TRL)."""
        return self.loss_type in ("ipo", "simpo", "alphapo")

    @property
    def used_nll_weight(self) -> float:
        """The NLL term's weight: ``nll_weight``, but 0 for alphapo (TRL's shorthand)."""
        return 0.0 if self.loss_type == "alphapo" else self.nll_weight

    @property
    def wants_nll(self) -> bool:
        """Whether the loss reads (and logs) the chosen NLL: always, but for simpo / alphapo
        without its term."""
        return self.loss_type not in ("simpo", "alphapo") or bool(self.used_nll_weight)

    def problems(self) -> list[str]:
        if self.loss_type not in CPO_LOSS_TYPES:
            return [f"{flag('loss_type')}: unknown CPO loss_type {self.loss_type!r}; expected "
                    f"one of {', '.join(CPO_LOSS_TYPES)}"]
        return []


def _cpo_terms(delta, options: CPOOptions, beta):
    """CPO's per-pair preference term of ``options.loss_type`` (d = R_c - R_r)."""
    if options.loss_type == "sigmoid":
        return _smoothed_sigmoid(beta * delta, options.label_smoothing)
    if options.loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * delta)
    return jnp.square(delta - 1.0 / (2.0 * beta))  # ipo


def cpo(pairs: Pairs, options: CPOOptions):
    r"""CPO: a reference-free DPO-style preference loss plus the NLL of the chosen completion.

        d = R(y_c) - R(y_r),  R(y) = log pi(y|x) (AlphaPO: (1 - pi^(-alpha)) / alpha),  b = beta
        sigmoid: -(1-eps) log s(b d) - eps log s(-b d)
        hinge:   max(0, 1 - b d)
        ipo:     (d - 1/(2 b))^2
        simpo:   SimPO's -(1-eps) log s(b d - simpo_gamma) (:func:`simpo`); alphapo: the same
                 without the NLL term
        loss = preference loss + nll_weight * chosen_nll

    "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine
    Translation" (Xu et al., arXiv:2401.08417), eq. 3 (DPO with the reference model dropped, as
    beta -> 0) plus the behaviour-cloning NLL term; as TRL's CPOTrainer, where ``nll_weight`` is
    ``cpo_alpha`` (default 1.0). As in TRL, ``sigmoid``/``hinge`` take *summed* log-probs and
    ``ipo``, ``simpo``, ``alphapo`` take *length-averaged* ones (``CPOOptions.averaged``).

    ``pairs.chosen_nll``: the per-pair NLL term of the chosen completion (needed unless its
    weight is 0); TRL's is the token-mean cross-entropy over all chosen completion tokens of the
    batch: pass :func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example NLL sums.
    ``alpha`` != 0 reshapes the rewards as AlphaPO (:func:`alphapo_rewards`), as TRL's ``alpha``.

    Metrics as TRL's CPOTrainer: ``rewards/chosen`` = b R(y_c) (policy only, no reference),
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``,
    ``logps/rejected``, ``nll_loss`` (when ``chosen_nll`` is given), ``loss``.
    """
    nll_weight = options.used_nll_weight
    if _uses(nll_weight) and pairs.chosen_nll is None:
        raise ValueError("cpo needs chosen_nll unless nll_weight == 0")
    if options.loss_type in ("simpo", "alphapo"):
        per_pair, rewards = _margin_loss(pairs, options.beta, options.simpo_gamma,
                                         options.label_smoothing, options.alpha)
        return _reference_free(per_pair, pairs, rewards, _f32(options.beta), nll_weight)
    rewards = (alphapo_rewards(_f32(pairs.chosen), options.alpha),
               alphapo_rewards(_f32(pairs.rejected), options.alpha))
    beta = _f32(options.beta)
    per_pair = _cpo_terms(rewards[0] - rewards[1], options, beta)
    return _reference_free(per_pair, pairs, rewards, beta, nll_weight)


# ----------------------------------------------------------------------------------------------
# ORPO
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ORPOOptions(Options):
    """ORPO's options: TRL's ORPOConfig (``--algo.*`` of ``orpo``)."""

    beta: float = 0.1
    """TRL's beta (the paper's lambda)."""


def orpo(pairs: Pairs, options: ORPOOptions):
    r"""ORPO: NLL on the chosen completion plus an odds-ratio preference term, no reference model.

        log odds(y|x) = l - log(1 - exp(l)),   l = average log pi(y|x) over completion tokens
        z = log odds(y_c|x) - log odds(y_r|x)
        loss = chosen_nll - beta * log s(z)

    "ORPO: Monolithic Preference Optimization without Reference Model" (Hong, Lee, Thorne,
    arXiv:2403.07691), eqs. 4-7 (beta is the paper's lambda). ``pairs`` holds *length-averaged*
    log-probs (TRL's ORPOTrainer averages), which are < 0; log(1 - exp(l)) is :func:`log1mexp`,
    the same branch at -log 2 as TRL 1.16's ``log1mexp`` (exact near 0 and for very negative l),
    with one difference: an average log-prob of exactly 0 is treated as -1e-12 (finite, where
    TRL's gives -inf).

    ``pairs.chosen_nll`` (required): the per-pair NLL term. TRL's ORPOTrainer takes the
    token-mean cross-entropy of the chosen rows over *the prompt and the completion* (every
    attended token, "orpo chosen nll loss is computed over the full prompt and response"): pass
    :func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example sums over those
    tokens (the ORPO algorithm does; ``nll_tokens="completion"`` restricts it to the completion).

    Metrics as TRL's ORPOTrainer: ``nll_loss``; ``log_odds_ratio`` = mean log s(z) (TRL logs the
    log-sigmoid of the log odds ratio under this name); ``log_odds_chosen`` = mean z;
    ``rewards/chosen`` = beta * l_c, ``rewards/rejected`` = beta * l_r, ``rewards/margins``,
    ``rewards/accuracies``; ``logps/chosen``, ``logps/rejected`` (averaged log-probs); ``loss``.
    """
    chosen, rejected = _f32(pairs.chosen), _f32(pairs.rejected)
    nll = jnp.broadcast_to(_f32(pairs.chosen_nll), chosen.shape)
    beta = _f32(options.beta)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    log_sigmoid_odds = jax.nn.log_sigmoid(log_odds)
    per_pair = nll - beta * log_sigmoid_odds
    metrics = _pair_metrics(beta * chosen, beta * rejected, chosen, rejected, per_pair)
    metrics["nll_loss"] = _mean_metric(nll)
    metrics["log_odds_ratio"] = _mean_metric(log_sigmoid_odds)
    metrics["log_odds_chosen"] = _mean_metric(log_odds)
    return jnp.sum(per_pair), _count(chosen), metrics
