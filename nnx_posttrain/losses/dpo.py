"""DPO and the DPO-family losses of TRL 1.16's DPOTrainer: the table of terms
(:mod:`.dpo_terms`), the f-divergence scores, WPO's pair weights and LD-DPO's split of the
log-probs. Conventions (``(total, weight, metrics)``, summed log-probs): see
:mod:`nnx_posttrain.losses.common`. Imports jax only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import (
    Metrics,
    _count,
    _f32,
    _is_python_number,
    _lengths,
    _mean_metric,
    _pair_metrics,
)
from nnx_posttrain.losses.dpo_terms import (  # noqa: F401  (re-exported)
    BATCH_COUPLED_LOSS_TYPES,
    DPO_LOSS_TYPES,
    DPO_TERMS,
    F_DIVERGENCE_LOSS_TYPES,
    DPOInputs,
)

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
_EXP_MAX = 80.0  # TRL's clamp for the alpha divergence's exponent (float32)


def f_divergence_scores(logratios, f_divergence_type: str = "reverse_kl", alpha: float = 0.5):
    """f'(pi / pi_ref) of f-DPO ("Beyond Reverse KL: Generalizing Direct Preference Optimization
    with Diverse Divergence Constraints", Wang et al., arXiv:2309.16240, Table 1), as a function
    of the log-ratio u = log pi - log pi_ref (TRL 1.16, ``DPOTrainer._compute_loss``):

        reverse_kl        u                        (DPO)
        forward_kl        1 - e^(-u)
        js_divergence     log 2 + log s(u)
        alpha_divergence  (e^((alpha - 1) u) - 1) / (alpha - 1)   (u when |alpha - 1| < 1e-6)

    Exponents are capped at 80 (TRL caps the alpha divergence's; the same cap keeps forward KL
    finite for log-ratios below -80).
    """
    u = _f32(logratios)
    if f_divergence_type == "reverse_kl":
        return u
    if f_divergence_type == "forward_kl":
        return -jnp.expm1(jnp.minimum(-u, _EXP_MAX))
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + jax.nn.log_sigmoid(u)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return u
        return jnp.expm1(jnp.minimum((alpha - 1.0) * u, _EXP_MAX)) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}; expected one of "
                     f"{F_DIVERGENCES}")


def wpo_weights(token_logps, log_sum_sq, mask):
    """WPO's per-sequence weight ("WPO: Enhancing RLHF with Weighted Preference Optimization",
    Zhou et al., arXiv:2406.11827, eq. 2, TRL's ``use_weighting``), without gradient:

        w(y) = exp(mean_t [log p(y_t | y_<t) - log sum_v p(v | y_<t)^2])

    (the length-normalised probability of the sequence, each token's aligned by the
    distribution's own sum of squares). A pair is weighted by w(y_c) w(y_r). ``token_logps``,
    ``log_sum_sq``, ``mask``: [batch, length] (``model.token_logprobs(...,
    with_log_sum_sq=True)``, the completion's loss mask)."""
    m = _f32(mask)
    aligned = (_f32(token_logps) - _f32(log_sum_sq)) * m
    mean = aligned.sum(-1) / jnp.maximum(m.sum(-1), 1.0)
    return jax.lax.stop_gradient(jnp.exp(mean))


def ld_split(chosen_token_logps, rejected_token_logps, chosen_mask, rejected_mask):
    """LD-DPO's split of each completion at the pair's shared length ("Length Desensitization in
    Direct Preference Optimization", Liu et al., arXiv:2409.06411; TRL's ``ld_alpha``): the
    first min(|y_c|, |y_r|) completion tokens are the shared part, the rest the verbose tail.
    Returns the summed log-probs ``(chosen_shared, chosen_tail, rejected_shared,
    rejected_tail)``; LD-DPO's log-prob is shared + ld_alpha * tail."""
    cm, rm = _f32(chosen_mask), _f32(rejected_mask)
    shared = jnp.minimum(cm.sum(-1), rm.sum(-1))[:, None]

    def split(tokens, m):
        pos = jnp.cumsum(m, axis=-1) * m  # 1, 2, ... on the completion tokens, 0 elsewhere
        head = (pos > 0) & (pos <= shared)
        tail = pos > shared
        tokens = _f32(tokens)
        return (jnp.where(head, tokens, 0.0).sum(-1), jnp.where(tail, tokens, 0.0).sum(-1))

    return (*split(chosen_token_logps, cm), *split(rejected_token_logps, rm))


def _check(loss_types, weights, label_smoothing, chosen_nll, chosen_lengths, rejected_lengths,
           f_divergence_type, pair_weights):
    for name in loss_types:
        if name not in DPO_LOSS_TYPES:
            raise ValueError(f"unknown DPO loss_type {name!r}; expected one of {DPO_LOSS_TYPES}")
    if not loss_types:
        raise ValueError("loss_type must name at least one loss")
    if len(set(loss_types)) != len(loss_types):
        raise ValueError(f"loss_type lists a loss twice: {loss_types}")
    if len(weights) != len(loss_types):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(loss_types)} loss types")
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    if "sigmoid_norm" in loss_types and chosen_lengths is None:
        raise ValueError("loss_type 'sigmoid_norm' needs chosen_lengths and rejected_lengths")
    if "sft" in loss_types and chosen_nll is None:
        raise ValueError("loss_type 'sft' needs chosen_nll (the NLL term of the chosen answer)")
    smoothing = label_smoothing if _is_python_number(label_smoothing) else None
    if "robust" in loss_types and smoothing is not None and not 0.0 <= smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    if "exo_pair" in loss_types and smoothing is not None and not 0.0 < smoothing < 1.0:
        raise ValueError(f"exo_pair needs 0 < label_smoothing < 1 (EXO's epsilon, e.g. 1e-3), "
                         f"got {label_smoothing}")
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}; expected one of "
                         f"{F_DIVERGENCES}")
    if f_divergence_type != "reverse_kl" and not set(loss_types) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise ValueError(f"f_divergence_type {f_divergence_type!r} only applies to the loss types "
                         f"built on the chosen - rejected score difference "
                         f"{F_DIVERGENCE_LOSS_TYPES}; got {loss_types}")
    if pair_weights is not None and set(loss_types) & set(BATCH_COUPLED_LOSS_TYPES):
        raise ValueError("WPO weighting does not apply to 'aot' / 'aot_unpaired' (they sort the "
                         "pairs, which would misalign the per-pair weights; TRL refuses it too)")


def dpo(
    policy_chosen,
    policy_rejected,
    ref_chosen,
    ref_rejected,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    chosen_nll=None,
    chosen_lengths=None,
    rejected_lengths=None,
    bco_delta=0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    pair_weights=None,
):
    r"""DPO and the DPO-family losses of TRL 1.16's DPOTrainer, alone or weighted together.

    Inputs: policy and reference log-probs of the chosen and rejected completions, ``[batch]``,
    summed over completion tokens (as TRL; for LD-DPO, the ``ld_split`` combination). With
    c = log pi(y_c|x) - log pi_ref(y_c|x), r likewise, s_c = f'(c), s_r = f'(r) the scores of
    ``f_divergence_type`` (:func:`f_divergence_scores`; s = the log-ratio by default),
    d = s_c - s_r, b = beta, eps = label_smoothing, the per-pair loss of each ``loss_type`` is
    ``DPO_TERMS[loss_type]`` (docstrings in :mod:`.dpo_terms`):

    ``sigmoid``      -log s(b d)                                 DPO (ignores eps, as TRL 1.x)
    ``cdpo``         -(1-eps) log s(b d) - eps log s(-b d)       cDPO (TRL 0.x's smoothed sigmoid)
    ``hinge``        max(0, 1 - b d)                             SLiC-HF, RSO
    ``ipo``          (d_n - 1/(2 b))^2, d_n = s_c/|y_c| - s_r/|y_r|  IPO (d_n = d without lengths)
    ``exo_pair``     q_w log(q_w/(1-eps)) + q_l log(q_l/eps), q_w = s(b d)   EXO (eps > 0)
    ``nca_pair``     -log s(b c) - 1/2 log s(-b c) - 1/2 log s(-b r)        NCA
    ``robust``       (-(1-eps) log s(b d) + eps log s(-b d)) / (1 - 2 eps)  robust DPO
    ``bco_pair``     -log s(b c - delta) - log s(-(b r - delta))           BCO (delta = bco_delta)
    ``sppo_hard``    (c - 1/(2 b))^2 + (r + 1/(2 b))^2                      SPPO
    ``aot``          smoothed -log s(b (sort(policy margins) - sort(ref margins)))  AOT
    ``aot_unpaired`` smoothed -log s(b (sort(c) - sort(r)))                 AOT, unpaired
    ``apo_zero``     (1 - s(b c)) + s(b r)                                   APO-zero
    ``apo_down``     s(b c) + (1 - s(b (c - r)))                             APO-down
    ``discopop``     (1 - m) (-log s(b d)) + m e^(-b d), m = s(b d / tau)    DiscoPOP
    ``sft``          ``chosen_nll``                                         RPO / MPO's NLL term
    ``sigmoid_norm`` -log s(b d_n)                                           Tülu 3; needs lengths

    (lengths come from ``chosen_lengths`` / ``rejected_lengths``, clamped to >= 1 as TRL). A
    sequence of loss types is combined with ``loss_weights`` (default all 1) as sum_k w_k
    loss_k per pair, as TRL's ``loss_type=[...]``/``loss_weights``; MPO ("Enhancing the
    Reasoning Ability of Multimodal Large Language Models via Mixed Preference Optimization",
    arXiv:2411.10442) is ``("sigmoid", "bco_pair", "sft")`` with weights ``(0.8, 0.2, 1.0)``.
    ``f_divergence_type`` other than reverse KL applies only to the terms built on d (TRL's rule;
    others raise). ``pair_weights`` [batch] (WPO: :func:`wpo_weights` of chosen times rejected)
    multiplies every term per pair, as TRL's ``use_weighting``; the ``sft`` term becomes w_i times
    the batch's NLL term (TRL multiplies its scalar token mean by the per-pair weights).

    Accumulation: every term is a per-pair value summed with weight = pairs, so micro-batches
    add up to the large-batch mean exactly, except (1) ``aot`` / ``aot_unpaired``, which sort
    within the batch they are given: under gradient accumulation each micro-batch is sorted on
    its own, which is what TRL does (it sorts each device's micro-batch) and not the large
    batch's sort; (2) ``sft`` with ``pair_weights``: the product of the weights' mean and the NLL
    token mean does not decompose over micro-batches (the same holds for TRL); exact with one
    micro-batch.

    Metrics (TRL names, ``(sum, count)`` over pairs): ``loss``; ``rewards/chosen`` = b c,
    ``rewards/rejected`` = b r, ``rewards/margins``, ``rewards/accuracies`` (chosen reward >
    rejected reward, ties count as wrong); ``logps/chosen``, ``logps/rejected`` (policy log-probs
    as given); ``bco/reward_mean`` with ``bco_pair``; ``loss/<type>`` for each term of a
    combination.
    """
    loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    weights = (1.0,) * len(loss_types) if loss_weights is None else tuple(loss_weights)
    _check(loss_types, weights, label_smoothing, chosen_nll, chosen_lengths, rejected_lengths,
           f_divergence_type, pair_weights)

    policy_chosen, policy_rejected = _f32(policy_chosen), _f32(policy_rejected)
    ref_chosen, ref_rejected = _f32(ref_chosen), _f32(ref_rejected)
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type,
                                          f_alpha_divergence_coef)
    delta = chosen_scores - rejected_scores
    beta = _f32(beta)
    chosen_rewards = beta * chosen_logratios
    rejected_rewards = beta * rejected_logratios
    if chosen_lengths is not None:
        normalised_delta = (chosen_scores / _lengths(chosen_lengths)
                            - rejected_scores / _lengths(rejected_lengths))
    else:
        normalised_delta = delta
    inputs = DPOInputs(
        c=chosen_logratios, r=rejected_logratios, d=delta, d_norm=normalised_delta, beta=beta,
        eps=label_smoothing, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
        chosen_nll=chosen_nll, bco_delta=bco_delta,
        policy_margin=policy_chosen - policy_rejected, ref_margin=ref_chosen - ref_rejected,
        discopop_tau=discopop_tau,
    )

    per_pair = jnp.zeros_like(delta)
    extra: Metrics = {}
    for name, weight in zip(loss_types, weights):
        value = DPO_TERMS[name](inputs)
        if pair_weights is not None:
            w = jax.lax.stop_gradient(_f32(pair_weights))
            value = w * (jnp.mean(value) if name == "sft" else value)
        per_pair = per_pair + _f32(weight) * value
        if len(loss_types) > 1:
            extra[f"loss/{name}"] = _mean_metric(value)

    metrics = _pair_metrics(
        chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, per_pair
    )
    if "bco_pair" in loss_types:
        rewards = jax.lax.stop_gradient(jnp.concatenate([chosen_rewards, rejected_rewards]))
        metrics["bco/reward_mean"] = (jnp.sum(rewards), _count(rewards))
    metrics.update(extra)
    return jnp.sum(per_pair), _count(delta), metrics
