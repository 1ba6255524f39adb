"""DPO and the DPO-family losses of TRL's DPOTrainer, as a table of per-pair terms.

Each ``loss_type`` is a small function of :class:`DPOInputs` (the log-ratios, their difference,
beta, ...) registered in :data:`DPO_TERMS`, with its formula and paper in its docstring;
:func:`dpo` validates the arguments, builds the inputs once, sums the weighted terms and builds
TRL's metrics. Conventions (``(total, weight, metrics)``, summed log-probs): see
:mod:`nnx_posttrain.losses.common`. Imports jax only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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
    _smoothed_sigmoid,
)


class DPOInputs(NamedTuple):
    """What every DPO term is a function of: float32 ``[batch]`` arrays unless noted.

    c = log pi(y_c|x) - log pi_ref(y_c|x), r likewise for the rejected completion, d = c - r,
    b = beta, eps = label_smoothing.
    """

    c: jax.Array  # chosen log-ratio
    r: jax.Array  # rejected log-ratio
    d: jax.Array  # c - r
    d_norm: jax.Array  # c / |y_c| - r / |y_r| when lengths are given, else d
    beta: jax.Array  # float32 scalar
    eps: Any  # label_smoothing as given (a Python 0 skips the smoothed half of ``sigmoid``)
    chosen_rewards: jax.Array  # b c
    rejected_rewards: jax.Array  # b r
    chosen_nll: Any  # per-example NLL of the chosen completion, or None
    bco_delta: Any  # BCO's reward shift (a constant)


def _sigmoid(x: DPOInputs) -> jax.Array:
    """``sigmoid``      -(1-eps) log s(b d) - eps log s(-b d)

    DPO: "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
    (Rafailov et al., arXiv:2305.18290), eq. 7. With eps > 0 it is conservative DPO (cDPO,
    E. Mitchell, "A note on DPO with noisy preferences & relationship to IPO", 2023, a note
    without an arXiv id). TRL 0.x applies eps here; TRL >= 1.0 ignores label_smoothing for
    ``sigmoid`` (it only uses it for ``robust``/``exo_pair``): with eps = 0 (the default) both
    agree.
    """
    return _smoothed_sigmoid(x.beta * x.d, x.eps)


def _hinge(x: DPOInputs) -> jax.Array:
    """``hinge``        max(0, 1 - b d)

    SLiC-HF ("SLiC-HF: Sequence Likelihood Calibration with Human Feedback", arXiv:2305.10425)
    and RSO ("Statistical Rejection Sampling Improves Preference Optimization",
    arXiv:2309.06657); 1/beta is the margin.
    """
    return jax.nn.relu(1.0 - x.beta * x.d)


def _ipo(x: DPOInputs) -> jax.Array:
    """``ipo``          (d_n - 1/(2 b))^2,  d_n = c / |y_c| - r / |y_r|

    IPO: "A General Theoretical Paradigm to Understand Learning from Human Preferences"
    (Azar et al., arXiv:2310.12036), eq. 17, beta is the paper's tau. TRL length-normalises the
    IPO log-ratios (TRL 0.x by averaging the log-probs, TRL >= 1.0 by dividing the summed
    log-ratios by the completion token counts, "confirmed with the IPO authors"). Pass
    ``chosen_lengths`` and ``rejected_lengths`` with summed log-probs; without lengths the
    log-probs are used as given (pass length-averaged log-probs then).
    """
    return jnp.square(x.d_norm - 1.0 / (2.0 * x.beta))


def _robust(x: DPOInputs) -> jax.Array:
    """``robust``       (-(1-eps) log s(b d) + eps log s(-b d)) / (1 - 2 eps),  0 <= eps < 0.5

    Robust DPO: "Provably Robust DPO: Aligning Language Models with Noisy Feedback"
    (Chowdhury et al., arXiv:2403.00409); eps is the label-flip rate.
    """
    eps = _f32(x.eps)
    clean = -(1.0 - eps) * jax.nn.log_sigmoid(x.beta * x.d)
    flipped = -eps * jax.nn.log_sigmoid(-x.beta * x.d)
    return (clean - flipped) / (1.0 - 2.0 * eps)


def _bco_pair(x: DPOInputs) -> jax.Array:
    """``bco_pair``     -log s(b c - delta) - log s(-(b r - delta))

    BCO: "Binary Classifier Optimization for Large Language Model Alignment" (Jung et al.,
    arXiv:2404.04656). delta = ``bco_delta`` is a reward shift, a constant here (no gradient
    flows into it). TRL >= 1.0 uses delta = 0, which is the default ``bco_delta=0.0``. (TRL 0.x
    used a running mean of the implicit rewards b c and b r instead, updated with each
    micro-batch's mean reward before its loss; a caller that wants that keeps the mean itself
    and passes it as ``bco_delta``: the metric ``bco/reward_mean`` gives the batch's reward sum
    and count.)
    """
    shift = jax.lax.stop_gradient(_f32(x.bco_delta))
    return -jax.nn.log_sigmoid(x.chosen_rewards - shift) - jax.nn.log_sigmoid(
        -(x.rejected_rewards - shift)
    )


def _sppo_hard(x: DPOInputs) -> jax.Array:
    """``sppo_hard``    (c - 1/(2 b))^2 + (r + 1/(2 b))^2

    SPPO: "Self-Play Preference Optimization for Language Model Alignment" (Wu et al.,
    arXiv:2405.00675), eq. 4.7 with hard winner/loser probabilities 1 and 0 (as TRL).
    """
    half_inv_beta = 0.5 / x.beta
    return jnp.square(x.c - half_inv_beta) + jnp.square(x.r + half_inv_beta)


def _nca_pair(x: DPOInputs) -> jax.Array:
    """``nca_pair``     -log s(b c) - 1/2 log s(-b c) - 1/2 log s(-b r)

    NCA: "Noise Contrastive Alignment of Language Models with Explicit Rewards" (Chen et al.,
    arXiv:2402.05369).
    """
    return (
        -jax.nn.log_sigmoid(x.chosen_rewards)
        - 0.5 * jax.nn.log_sigmoid(-x.chosen_rewards)
        - 0.5 * jax.nn.log_sigmoid(-x.rejected_rewards)
    )


def _apo_zero(x: DPOInputs) -> jax.Array:
    """``apo_zero``     (1 - s(b c)) + s(b r)

    APO: "Anchored Preference Optimization and Contrastive Revisions: Addressing
    Underspecification in Alignment" (D'Oosterlinck et al., arXiv:2408.06266), eq. 7.
    """
    return jax.nn.sigmoid(-x.chosen_rewards) + jax.nn.sigmoid(x.rejected_rewards)


def _apo_down(x: DPOInputs) -> jax.Array:
    """``apo_down``     s(b c) + (1 - s(b d))

    APO: "Anchored Preference Optimization and Contrastive Revisions: Addressing
    Underspecification in Alignment" (D'Oosterlinck et al., arXiv:2408.06266), eq. 8.
    """
    return jax.nn.sigmoid(x.chosen_rewards) + jax.nn.sigmoid(-x.beta * x.d)


def _sigmoid_norm(x: DPOInputs) -> jax.Array:
    """``sigmoid_norm`` -log s(b (c / |y_c| - r / |y_r|))

    Length-normalised DPO of Tülu 3 ("Tülu 3: Pushing Frontiers in Open Language Model
    Post-Training", arXiv:2411.15124, eq. 6), after SimPO's length normalisation (arXiv:
    2405.14734) but keeping the reference model. TRL added it as ``sigmoid_norm`` in PR #5406
    (2026): the summed log-ratios divided by the completion token counts, clamped to >= 1.
    Requires ``chosen_lengths`` and ``rejected_lengths`` (typical beta: 2 to 5, not 0.1).
    """
    return -jax.nn.log_sigmoid(x.beta * x.d_norm)


def _sft(x: DPOInputs) -> jax.Array:
    """``sft``          ``chosen_nll``

    The negative log-likelihood of the chosen completion (RPO, "Iterative Reasoning Preference
    Optimization", arXiv:2404.19733; the generation term of MPO). Pass the per-example NLL of
    the chosen completion; TRL's ``sft`` term is the token-mean cross-entropy over all chosen
    tokens of the batch, which equals the mean of per-example *length-averaged* NLLs when the
    chosen completions have equal lengths: pass the negated length-averaged log-probs of the
    chosen completions to be closest to TRL, or the summed NLL for a per-sequence weighting.
    """
    return jnp.broadcast_to(_f32(x.chosen_nll), x.d.shape)


DPO_TERMS: dict[str, Callable[[DPOInputs], jax.Array]] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "robust": _robust,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "nca_pair": _nca_pair,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "sigmoid_norm": _sigmoid_norm,
    "sft": _sft,
}
DPO_LOSS_TYPES = tuple(DPO_TERMS)


def _check(loss_type, loss_weights, label_smoothing, chosen_nll, chosen_lengths, rejected_lengths):
    """Validate :func:`dpo`'s arguments; returns ``(loss_types, weights)`` as tuples."""
    loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not loss_types:
        raise ValueError("loss_type must name at least one loss")
    for name in loss_types:
        if name not in DPO_LOSS_TYPES:
            raise ValueError(f"unknown DPO loss_type {name!r}; expected one of {DPO_LOSS_TYPES}")
    if len(set(loss_types)) != len(loss_types):
        raise ValueError(f"loss_type lists a loss twice: {loss_types}")
    if loss_weights is None:
        weights = (1.0,) * len(loss_types)
    else:
        weights = tuple(loss_weights)
        if len(weights) != len(loss_types):
            raise ValueError(
                f"loss_weights has {len(weights)} entries for {len(loss_types)} loss types"
            )
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    if "sigmoid_norm" in loss_types and chosen_lengths is None:
        raise ValueError("loss_type 'sigmoid_norm' needs chosen_lengths and rejected_lengths")
    if "sft" in loss_types and chosen_nll is None:
        raise ValueError("loss_type 'sft' needs chosen_nll (per-example NLL of the chosen answer)")
    if "robust" in loss_types and _is_python_number(label_smoothing):
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    return loss_types, weights


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
):
    r"""DPO and the DPO-family losses of TRL's DPOTrainer, alone or as a weighted combination.

    Inputs: policy and reference log-probs of the chosen and rejected completions, ``[batch]``,
    summed over completion tokens (as TRL's DPOTrainer). With

        c = log pi(y_c|x) - log pi_ref(y_c|x)        (chosen log-ratio)
        r = log pi(y_r|x) - log pi_ref(y_r|x)        (rejected log-ratio)
        d = c - r,  b = beta,  eps = label_smoothing

    the per-pair loss of each ``loss_type`` is ``DPO_TERMS[loss_type]`` (its docstring gives the
    paper and how TRL's versions differ):

    ``sigmoid``      -(1-eps) log s(b d) - eps log s(-b d)           DPO; cDPO with eps > 0
    ``hinge``        max(0, 1 - b d)                                 SLiC-HF, RSO
    ``ipo``          (d_n - 1/(2 b))^2,  d_n = c / |y_c| - r / |y_r| IPO (d_n = d without lengths)
    ``robust``       (-(1-eps) log s(b d) + eps log s(-b d)) / (1 - 2 eps)   robust DPO
    ``bco_pair``     -log s(b c - delta) - log s(-(b r - delta))     BCO, delta = ``bco_delta``
                     (TRL >= 1.0: delta = 0, the default)
    ``sppo_hard``    (c - 1/(2 b))^2 + (r + 1/(2 b))^2               SPPO
    ``nca_pair``     -log s(b c) - 1/2 log s(-b c) - 1/2 log s(-b r) NCA
    ``apo_zero``     (1 - s(b c)) + s(b r)                           APO-zero
    ``apo_down``     s(b c) + (1 - s(b d))                           APO-down
    ``sigmoid_norm`` -log s(b (c / |y_c| - r / |y_r|))               Tülu 3; needs the lengths
    ``sft``          ``chosen_nll``                                  RPO / MPO's generation term

    (s is the logistic sigmoid; lengths come from ``chosen_lengths`` / ``rejected_lengths``,
    clamped to >= 1 as TRL.) A sequence of loss types is combined with ``loss_weights``
    (default all 1) as sum_k w_k loss_k per pair, as TRL's ``loss_type=[...]``/``loss_weights``;
    MPO ("Enhancing the Reasoning Ability of Multimodal Large Language Models via Mixed Preference
    Optimization", arXiv:2411.10442) is ``loss_type=("sigmoid", "bco_pair", "sft")`` with
    ``loss_weights=(0.8, 0.2, 1.0)``.

    Metrics (TRL names, ``(sum, count)`` over pairs): ``loss``; ``rewards/chosen`` = b c,
    ``rewards/rejected`` = b r, ``rewards/margins``, ``rewards/accuracies`` (chosen reward >
    rejected reward, ties count as wrong); ``logps/chosen``, ``logps/rejected`` (policy log-probs
    as given); ``bco/reward_mean`` with ``bco_pair``; ``loss/<type>`` for each term of a
    combination.
    """
    loss_types, weights = _check(
        loss_type, loss_weights, label_smoothing, chosen_nll, chosen_lengths, rejected_lengths
    )

    policy_chosen, policy_rejected = _f32(policy_chosen), _f32(policy_rejected)
    chosen_logratios = policy_chosen - _f32(ref_chosen)
    rejected_logratios = policy_rejected - _f32(ref_rejected)
    delta = chosen_logratios - rejected_logratios
    beta = _f32(beta)
    chosen_rewards = beta * chosen_logratios
    rejected_rewards = beta * rejected_logratios
    if chosen_lengths is not None:
        chosen_normalised = chosen_logratios / _lengths(chosen_lengths)
        normalised_delta = chosen_normalised - rejected_logratios / _lengths(rejected_lengths)
    else:
        normalised_delta = delta
    inputs = DPOInputs(
        c=chosen_logratios, r=rejected_logratios, d=delta, d_norm=normalised_delta, beta=beta,
        eps=label_smoothing, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
        chosen_nll=chosen_nll, bco_delta=bco_delta,
    )

    per_pair = jnp.zeros_like(delta)
    extra: Metrics = {}
    for name, weight in zip(loss_types, weights):
        value = DPO_TERMS[name](inputs)
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
