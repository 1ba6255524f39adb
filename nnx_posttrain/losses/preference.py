"""Reference-free and unpaired preference losses, and reward modelling: SimPO, CPO, ORPO, KTO,
Bradley-Terry. Pure JAX functions of arrays; no model, no I/O (DPO and its family: :mod:`.dpo`).

Conventions (``(total, weight, metrics)``, which losses take summed and which averaged
log-probs, numerics): see :mod:`nnx_posttrain.losses.common`.

The definitions follow TRL 1.16.0: ``trl/experimental/cpo/cpo_trainer.py`` (``CPOTrainer.cpo_loss``,
``get_batch_loss_metrics``), ``trl/experimental/orpo/orpo_trainer.py`` (``odds_ratio_loss``,
``concatenated_forward``), ``trl/trainer/kto_trainer.py`` (the ``loss_type`` branches of
``KTOTrainer._compute_loss``), ``trl/trainer/reward_trainer.py`` (``compute_loss``). Where TRL
versions differ, the docstring says which one is followed and how to get the other. The NLL
terms (``chosen_nll``) are per-pair arrays whose mean is the term: TRL's token mean over the
batch is :func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example NLL sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import (
    Metrics,
    _count,
    _f32,
    _is_python_number,
    _mean_metric,
    _pair_metrics,
    _smoothed_sigmoid,
    log1mexp,
)

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
_EXP_MAX = 80.0


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


# ----------------------------------------------------------------------------------------------
# Reference-free pairwise losses: SimPO, CPO, ORPO
# ----------------------------------------------------------------------------------------------


def _reference_free(per_pair, chosen, rejected, beta, chosen_nll, nll_weight, uses_nll, rc, rr):
    """The common end of SimPO and CPO: the optional NLL term, TRL's metrics (rewards are beta
    times the (AlphaPO-shaped) policy log-probs ``rc``, ``rr``), the (sum, weight, metrics)."""
    if uses_nll:
        per_pair = per_pair + _f32(nll_weight) * _f32(chosen_nll)
    metrics = _pair_metrics(beta * rc, beta * rr, chosen, rejected, per_pair)
    if chosen_nll is not None:
        metrics["nll_loss"] = _mean_metric(jnp.broadcast_to(_f32(chosen_nll), chosen.shape))
    return jnp.sum(per_pair), _count(chosen), metrics


def simpo(
    policy_chosen_avg,
    policy_rejected_avg,
    *,
    beta: float = 2.0,
    gamma: float | None = None,
    gamma_beta_ratio: float | None = None,
    nll_weight: float = 0.0,
    chosen_nll=None,
    label_smoothing: float = 0.0,
    alpha: float = 0.0,
):
    r"""SimPO: reference-free, length-normalised logistic loss with a target reward margin.

        loss = -(1-eps) log s(z) - eps log s(-z) + nll_weight * chosen_nll,
        z = beta * (R(y_c) - R(y_r)) - gamma,   R(y) = avg log pi(y|x)

    "SimPO: Simple Preference Optimization with a Reference-Free Reward" (Meng, Xia, Chen,
    arXiv:2405.14734), eq. 6. Inputs are *length-averaged* log-probs of the completions. Pure SimPO
    by default (``nll_weight=0``); ``nll_weight > 0`` adds the chosen NLL, which is CPO-SimPO
    (TRL's CPOTrainer with ``loss_type="simpo"`` and ``cpo_alpha > 0``). ``label_smoothing`` is
    TRL's / the SimPO repo's conservative variant (0 in the paper). ``alpha`` != 0 is AlphaPO
    (:func:`alphapo_rewards`: R = (1 - p^(-alpha)) / alpha of the averaged log-prob; TRL's
    CPOTrainer ``alpha`` with ``loss_type="simpo"``, or ``"alphapo"``, which also sets
    ``cpo_alpha=0``).

    The margin comes in two parameterisations; give exactly one (both raises ``ValueError``):

    - ``gamma``: the margin in the paper's equation. TRL's ``CPOConfig.simpo_gamma`` *is* this
      gamma: TRL computes ``logits = (c - r) - simpo_gamma / beta`` and
      ``-logsigmoid(beta * logits)``, i.e. ``beta (c - r) - simpo_gamma``; the division by beta
      inside TRL cancels and does not make ``simpo_gamma`` a ratio.
    - ``gamma_beta_ratio``: gamma / beta, the knob of the SimPO repository (princeton-nlp/SimPO,
      ``SimPOConfig.gamma_beta_ratio``, default 0.25) and of the paper's hyper-parameter tables.
      gamma = gamma_beta_ratio * beta.

    With neither, gamma_beta_ratio = 0.25 (the SimPO repository's default), which with the default
    beta = 2.0 is gamma = 0.5 (also TRL's default ``simpo_gamma``).

    Metrics as TRL's CPOTrainer: ``rewards/chosen`` = beta * avg logp chosen, ``rewards/rejected``,
    ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (the averaged
    log-probs), ``loss``, and ``nll_loss`` when ``chosen_nll`` is given.
    """
    if gamma is not None and gamma_beta_ratio is not None:
        raise ValueError(
            "give either gamma or gamma_beta_ratio, not both (gamma = gamma_beta_ratio * beta)"
        )
    if gamma is None:
        gamma = (0.25 if gamma_beta_ratio is None else gamma_beta_ratio) * beta
    uses_nll = not (_is_python_number(nll_weight) and nll_weight == 0)
    if uses_nll and chosen_nll is None:
        raise ValueError("nll_weight != 0 (CPO-SimPO) needs chosen_nll")

    chosen, rejected = _f32(policy_chosen_avg), _f32(policy_rejected_avg)
    rc, rr = alphapo_rewards(chosen, alpha), alphapo_rewards(rejected, alpha)
    beta = _f32(beta)
    logits = beta * (rc - rr) - _f32(gamma)
    per_pair = _smoothed_sigmoid(logits, label_smoothing)
    return _reference_free(per_pair, chosen, rejected, beta, chosen_nll, nll_weight, uses_nll,
                           rc, rr)


def cpo(
    policy_chosen,
    policy_rejected,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_nll=None,
    nll_weight: float = 1.0,
    alpha: float = 0.0,
):
    r"""CPO: a reference-free DPO-style preference loss plus the NLL of the chosen completion.

        d = R(y_c) - R(y_r),  R(y) = log pi(y|x) (AlphaPO: (1 - pi^(-alpha)) / alpha),  b = beta
        sigmoid: -(1-eps) log s(b d) - eps log s(-b d)
        hinge:   max(0, 1 - b d)
        ipo:     (d - 1/(2 b))^2
        loss = preference loss + nll_weight * chosen_nll

    "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine
    Translation" (Xu et al., arXiv:2401.08417), eq. 3 (DPO with the reference model dropped, as
    beta -> 0) plus the behaviour-cloning NLL term; as TRL's CPOTrainer, where ``nll_weight`` is
    ``cpo_alpha`` (default 1.0). As in TRL, ``sigmoid``/``hinge`` take *summed* log-probs and
    ``ipo`` takes *length-averaged* ones (TRL averages for ``ipo`` and ``simpo``). For TRL's
    ``loss_type="simpo"`` use :func:`simpo` with ``nll_weight=cpo_alpha``.

    ``chosen_nll``: the per-pair NLL term of the chosen completion (needed unless ``nll_weight
    == 0``); TRL's is the token-mean cross-entropy over all chosen completion tokens of the
    batch: pass :func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example NLL sums.
    ``alpha`` != 0 reshapes the rewards as AlphaPO (:func:`alphapo_rewards`), as TRL's ``alpha``.

    Metrics as TRL's CPOTrainer: ``rewards/chosen`` = b R(y_c) (policy only, no reference),
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``,
    ``logps/rejected``, ``nll_loss`` (when ``chosen_nll`` is given), ``loss``.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(
            f"unknown CPO loss_type {loss_type!r}; expected one of {CPO_LOSS_TYPES} "
            "(for 'simpo' use nnx_posttrain.losses.preference.simpo)"
        )
    uses_nll = not (_is_python_number(nll_weight) and nll_weight == 0)
    if uses_nll and chosen_nll is None:
        raise ValueError("cpo needs chosen_nll unless nll_weight == 0")

    chosen, rejected = _f32(policy_chosen), _f32(policy_rejected)
    rc, rr = alphapo_rewards(chosen, alpha), alphapo_rewards(rejected, alpha)
    beta = _f32(beta)
    delta = rc - rr
    if loss_type == "sigmoid":
        per_pair = _smoothed_sigmoid(beta * delta, label_smoothing)
    elif loss_type == "hinge":
        per_pair = jax.nn.relu(1.0 - beta * delta)
    else:  # ipo
        per_pair = jnp.square(delta - 1.0 / (2.0 * beta))
    return _reference_free(per_pair, chosen, rejected, beta, chosen_nll, nll_weight, uses_nll,
                           rc, rr)


def orpo(policy_chosen_avg, policy_rejected_avg, chosen_nll, *, beta: float = 0.1):
    r"""ORPO: NLL on the chosen completion plus an odds-ratio preference term, no reference model.

        log odds(y|x) = l - log(1 - exp(l)),   l = average log pi(y|x) over completion tokens
        z = log odds(y_c|x) - log odds(y_r|x)
        loss = chosen_nll - beta * log s(z)

    "ORPO: Monolithic Preference Optimization without Reference Model" (Hong, Lee, Thorne,
    arXiv:2403.07691), eqs. 4-7 (beta is the paper's lambda). Inputs are *length-averaged*
    log-probs (TRL's ORPOTrainer averages), which are < 0; log(1 - exp(l)) is :func:`log1mexp`,
    the same branch at -log 2 as TRL 1.16's ``log1mexp`` (exact near 0 and for very negative l),
    with one difference: an average log-prob of exactly 0 is treated as -1e-12 (finite, where
    TRL's gives -inf).

    ``chosen_nll``: the per-pair NLL term. TRL's ORPOTrainer takes the token-mean cross-entropy
    of the chosen rows over *the prompt and the completion* (every attended token, "orpo chosen
    nll loss is computed over the full prompt and response"): pass
    :func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example sums over those
    tokens (the ORPO algorithm does; ``nll_tokens="completion"`` restricts it to the completion).

    Metrics as TRL's ORPOTrainer: ``nll_loss``; ``log_odds_ratio`` = mean log s(z) (TRL logs the
    log-sigmoid of the log odds ratio under this name); ``log_odds_chosen`` = mean z;
    ``rewards/chosen`` = beta * l_c, ``rewards/rejected`` = beta * l_r, ``rewards/margins``,
    ``rewards/accuracies``; ``logps/chosen``, ``logps/rejected`` (averaged log-probs); ``loss``.
    """
    chosen, rejected = _f32(policy_chosen_avg), _f32(policy_rejected_avg)
    nll = jnp.broadcast_to(_f32(chosen_nll), chosen.shape)
    beta = _f32(beta)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    log_sigmoid_odds = jax.nn.log_sigmoid(log_odds)
    per_pair = nll - beta * log_sigmoid_odds
    metrics = _pair_metrics(beta * chosen, beta * rejected, chosen, rejected, per_pair)
    metrics["nll_loss"] = _mean_metric(nll)
    metrics["log_odds_ratio"] = _mean_metric(log_sigmoid_odds)
    metrics["log_odds_chosen"] = _mean_metric(log_odds)
    return jnp.sum(per_pair), _count(chosen), metrics


# ----------------------------------------------------------------------------------------------
# Unpaired: KTO
# ----------------------------------------------------------------------------------------------


def kto(
    policy_logps,
    ref_logps,
    labels,
    kl_policy_logps,
    kl_ref_logps,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl=None,
    loss_type: str = "kto",
):
    r"""KTO: unpaired desirable / undesirable examples against a KL reference point.

        rho = log pi(y|x) - log pi_ref(y|x)
        z0  = max(0, mean_j [log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)]), no gradient
        desirable   (label 1): lambda_D * (1 - s(beta (rho - z0)))
        undesirable (label 0): lambda_U * (1 - s(beta (z0 - rho)))

    "KTO: Model Alignment as Prospect Theoretic Optimization" (Ethayarajh et al.,
    arXiv:2402.01306), eq. 7, as TRL's KTOTrainer (``loss_type="kto"``). Inputs are *summed*
    log-probs, ``[batch]``; ``labels`` is 1/True for desirable and 0/False for undesirable. The
    KL reference point z0 is estimated from mismatched completions y'_j (each prompt paired with
    another example's completion: TRL shifts the completions by one within the batch):
    ``kl_policy_logps`` and ``kl_ref_logps`` are their policy and reference log-probs.

    TRL computes z0 per process as the mean over its micro-batch, detached, gathers the
    per-process means, averages them (equal to the global mean when every process has the same
    batch size) and clamps at 0. Under JAX SPMD a ``[global batch]`` array already gives that
    global mean. Pass ``kl`` to override the estimate (e.g. one shared over all micro-batches of a
    step, which makes the accumulation exact); it is also detached and clamped at 0. With
    ``kl_policy_logps``/``kl_ref_logps`` both None and no ``kl``, z0 = 0 (TRL's
    ``calculate_KL=False``).

    The paper recommends weights with lambda_D n_D / (lambda_U n_U) in [1, 4/3].

    ``loss_type="apo_zero_unpaired"`` (TRL's KTOTrainer): the unpaired APO-zero loss of "Anchored
    Preference Optimization and Contrastive Revisions" (arXiv:2408.06266, eq. 7), without a
    reference point: desirable lambda_D (1 - s(beta rho)), undesirable lambda_U s(beta rho); no
    KL rows are needed (TRL's ``calculate_KL=False``), z0 is 0.

    Metrics: ``kl`` = (z0, 1) per call (TRL logs the per-batch z0 and averages the logged
    values); ``rewards/chosen`` = beta rho over desirable examples, ``rewards/rejected`` over
    undesirable ones, ``logps/chosen``, ``logps/rejected`` likewise (so counts differ: the number
    of desirable vs undesirable examples, exactly as TRL's ``*_sum`` / ``count/*`` bookkeeping;
    a count may be 0); ``loss`` over all examples. TRL's ``rewards/margins`` is the difference of
    the two reward means, computed when logging.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    policy, ref = _f32(policy_logps), _f32(ref_logps)
    desirable = (jnp.asarray(labels) > 0).astype(jnp.float32)
    beta = _f32(beta)
    if loss_type == "apo_zero_unpaired":
        kl = 0.0
    if kl is None:
        if kl_policy_logps is None and kl_ref_logps is None:
            kl = jnp.zeros((), jnp.float32)
        else:
            kl = jnp.mean(_f32(kl_policy_logps) - _f32(kl_ref_logps))
    kl = jax.lax.stop_gradient(jnp.maximum(_f32(kl), 0.0))

    logratios = policy - ref
    # 1 - s(x) = s(-x): no cancellation when s(x) is close to 1.
    # (1 - s(beta (rho - z0))) and (1 - s(beta (z0 - rho))); apo_zero_unpaired has z0 = 0, the
    # same expressions as TRL's 1 - s(beta rho) and s(beta rho)
    desirable_loss = jax.nn.sigmoid(-beta * (logratios - kl))
    undesirable_loss = jax.nn.sigmoid(-beta * (kl - logratios))
    per_example = jnp.where(
        desirable > 0,
        _f32(desirable_weight) * desirable_loss,
        _f32(undesirable_weight) * undesirable_loss,
    )
    undesirable = 1.0 - desirable
    rewards = beta * logratios
    metrics: Metrics = {
        "loss": _mean_metric(per_example),
        "kl": (kl, jnp.ones((), jnp.float32)),
        "rewards/chosen": _mean_metric(rewards, desirable),
        "rewards/rejected": _mean_metric(rewards, undesirable),
        "logps/chosen": _mean_metric(policy, desirable),
        "logps/rejected": _mean_metric(policy, undesirable),
    }
    return jnp.sum(per_example), _count(policy), metrics


# ----------------------------------------------------------------------------------------------
# Reward modelling
# ----------------------------------------------------------------------------------------------


def reward_bt(rewards_chosen, rewards_rejected, *, margin=None, center_rewards_coefficient=None):
    r"""Bradley-Terry pairwise loss for a reward model, as TRL's RewardTrainer.

        loss = -log s(r_c - r_r - m) + coef * (r_c + r_r)^2

    Bradley and Terry, "Rank Analysis of Incomplete Block Designs" (Biometrika, 1952), as used for
    RLHF reward models in "Training language models to follow instructions with human feedback"
    (Ouyang et al., arXiv:2203.02155), eq. 1. The optional per-pair ``margin`` m (TRL's ``margin``
    column) is Llama 2's preference-strength margin ("Llama 2: Open Foundation and Fine-Tuned Chat
    Models", arXiv:2307.09288, eq. 2). The optional centering term with
    ``center_rewards_coefficient`` (TRL's ``RewardConfig.center_rewards_coefficient``) pushes
    rewards to mean zero ("Helping or Herding? Reward Model Ensembles Mitigate but do not Eliminate
    Reward Hacking", Eisenstein et al., arXiv:2312.09244); TRL adds coef * mean((r_c + r_r)^2),
    which is the per-pair term above averaged.

    Inputs: scalar rewards ``[batch]`` (a trailing axis of size 1, as a score head gives, is
    dropped). Metrics: ``accuracy`` (r_c > r_r, ties wrong, margin not applied; TRL's name),
    ``margin`` = mean(r_c - r_r) (TRL's name), ``mean_reward`` over chosen and rejected,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``loss``. TRL's ``min_reward`` /
    ``max_reward`` are not sums, so they are not returned.
    """

    def vector(x):
        x = _f32(x)
        return x[..., 0] if x.ndim == 2 and x.shape[-1] == 1 else x

    chosen, rejected = vector(rewards_chosen), vector(rewards_rejected)
    diff = chosen - rejected
    logits = diff if margin is None else diff - vector(margin)
    per_pair = -jax.nn.log_sigmoid(logits)
    if center_rewards_coefficient is not None:
        per_pair = per_pair + _f32(center_rewards_coefficient) * jnp.square(chosen + rejected)
    both = jnp.concatenate([chosen, rejected])
    metrics: Metrics = {
        "loss": _mean_metric(per_pair),
        "accuracy": _mean_metric((chosen > rejected).astype(jnp.float32)),
        "margin": _mean_metric(diff),
        "mean_reward": _mean_metric(both),
        "rewards/chosen": _mean_metric(chosen),
        "rewards/rejected": _mean_metric(rejected),
        "rewards/margins": _mean_metric(diff),
    }
    return jnp.sum(per_pair), _count(chosen), metrics
