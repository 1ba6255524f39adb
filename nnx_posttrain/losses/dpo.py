"""DPO and the DPO-family losses of TRL 1.16's DPOTrainer: their options (:class:`DPOOptions`),
the table of terms (:mod:`.dpo_terms`), the f-divergence scores, WPO's pair weights and LD-DPO's
split of the log-probs. Conventions (``(total, weight, metrics)``, summed log-probs): see
:mod:`nnx_posttrain.losses.common`. Imports jax and ``nnx_posttrain.errors`` only.

With c = log pi(y_c|x) - log pi_ref(y_c|x), r likewise, s_c = f'(c), s_r = f'(r) the scores of
``f_divergence_type`` (s = the log-ratio by default), d = s_c - s_r, b = beta, eps =
label_smoothing, s(.) the logistic sigmoid, the per-pair loss of each ``loss_type``:

================  ==========================================================  ===============
``sigmoid``       -log s(b d)                                                  DPO (ignores eps)
``cdpo``          -(1-eps) log s(b d) - eps log s(-b d)                        cDPO
``hinge``         max(0, 1 - b d)                                              SLiC-HF, RSO
``ipo``           (d_n - 1/(2 b))^2, d_n = s_c/|y_c| - s_r/|y_r|               IPO
``exo_pair``      q_w log(q_w/(1-eps)) + q_l log(q_l/eps), q_w = s(b d)        EXO (eps > 0)
``nca_pair``      -log s(b c) - 1/2 log s(-b c) - 1/2 log s(-b r)              NCA
``robust``        (-(1-eps) log s(b d) + eps log s(-b d)) / (1 - 2 eps)        robust DPO
``bco_pair``      -log s(b c - delta) - log s(-(b r - delta))                  BCO
``sppo_hard``     (c - 1/(2 b))^2 + (r + 1/(2 b))^2                            SPPO
``aot``           smoothed -log s(b (sort(policy margins) - sort(ref margins)))  AOT
``aot_unpaired``  smoothed -log s(b (sort(c) - sort(r)))                       AOT, unpaired
``apo_zero``      (1 - s(b c)) + s(b r)                                        APO-zero
``apo_down``      s(b c) + (1 - s(b (c - r)))                                  APO-down
``discopop``      (1 - m) (-log s(b d)) + m e^(-b d), m = s(b d / tau)         DiscoPOP
``sft``           ``chosen_nll``                                               RPO / MPO's NLL
``sigmoid_norm``  -log s(b d_n)                                                Tülu 3
================  ==========================================================  ===============

(IPO without lengths uses d as given; ``sigmoid_norm`` needs the lengths.) Papers and details:
each term's docstring in :mod:`.dpo_terms`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import (
    Metrics,
    Options,
    _count,
    _f32,
    _lengths,
    _mean_metric,
    _pair_metrics,
    flag,
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


def _names(value) -> tuple[str, ...]:
    """Comma-separated names (``"sigmoid,bco_pair,sft"``) or a sequence of them, as a tuple."""
    parts = value.split(",") if isinstance(value, str) else value
    return tuple(x.strip() for x in parts if x.strip())


@dataclasses.dataclass(frozen=True)
class DPOOptions(Options):
    """DPO's options: TRL 1.16 DPOConfig's names and defaults (``--algo.*`` of ``dpo``).
    ``loss_type`` and ``loss_weights`` are comma-separated text (as on the command line) or, in
    Python, sequences (TRL's lists)."""

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

    @property
    def loss_types(self) -> tuple[str, ...]:
        """``loss_type`` as a tuple of names (a string is comma-separated)."""
        return _names(self.loss_type)

    @property
    def weights(self) -> tuple[float, ...]:
        """The weight of each of ``loss_types`` (``loss_weights``, comma-separated or a sequence
        of numbers; default all 1)."""
        weights = self.loss_weights
        if not weights:
            return (1.0,) * len(self.loss_types)
        return tuple(float(x) for x in (_names(weights) if isinstance(weights, str) else weights))

    def problems(self) -> list[str]:
        types, out = self.loss_types, []
        unknown = [name for name in types if name not in DPO_TERMS]
        if unknown or not types:
            out.append(f"{flag('loss_type')}: unknown DPO loss_type {self.loss_type!r}; expected "
                       f"one or more (comma-separated) of {', '.join(DPO_LOSS_TYPES)}")
        if len(set(types)) != len(types):
            out.append(f"{flag('loss_type')} lists a loss twice: {self.loss_type!r}")
        try:
            weights = self.weights
        except ValueError:
            weights = None
            out.append(f"{flag('loss_weights')} must be numbers separated by commas, got "
                       f"{self.loss_weights!r}")
        if weights is not None and len(weights) != len(types):
            out.append(f"{flag('loss_weights')} has {len(weights)} entries for "
                       f"{len(types)} loss types ({self.loss_type!r}): give one weight per type")
        return out + self._smoothing_problems() + self._divergence_problems() + [
            problem for problem, bad in (
                (f"{flag('use_weighting')} (WPO) does not apply to 'aot' / 'aot_unpaired' (they "
                 "sort the pairs, which would misalign the per-pair weights; TRL refuses it "
                 "too)", self.use_weighting and set(types) & set(BATCH_COUPLED_LOSS_TYPES)),
                (f"{flag('ld_alpha')} must be in [0, 1], got {self.ld_alpha}",
                 self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0)) if bad]

    def _smoothing_problems(self) -> list[str]:
        eps, types, out = self.label_smoothing, self.loss_types, []
        if "robust" in types and not 0.0 <= eps < 0.5:
            out.append(f"robust DPO needs 0 <= label_smoothing < 0.5 ({flag('label_smoothing')}), "
                       f"got {eps}")
        if "exo_pair" in types and not 0.0 < eps < 1.0:
            out.append(f"exo_pair needs 0 < label_smoothing < 1 (EXO's epsilon, e.g. "
                       f"{flag('label_smoothing')} 1e-3), got {eps}")
        return out

    def _divergence_problems(self) -> list[str]:
        kind = self.f_divergence_type
        if kind not in F_DIVERGENCES:
            return [f"{flag('f_divergence_type')}: unknown f_divergence_type {kind!r}; expected "
                    f"one of {F_DIVERGENCES}"]
        if kind != "reverse_kl" and not set(self.loss_types) <= set(F_DIVERGENCE_LOSS_TYPES):
            return [f"{flag('f_divergence_type')} {kind!r} only applies to the loss types built "
                    f"on the chosen - rejected score difference {F_DIVERGENCE_LOSS_TYPES}; got "
                    f"{self.loss_type!r}"]
        return []


class DPOPairs(NamedTuple):
    """The arrays of :func:`dpo`: policy and reference log-probs of the chosen and rejected
    completions, ``[batch]``, summed over the completion tokens (LD-DPO: ``ld_split``'s
    combination); the per-pair NLL term of the chosen completion (the ``sft`` term); the
    completion lengths (``ipo`` and ``sigmoid_norm`` divide by them); WPO's per-pair weights
    (``use_weighting``: :func:`wpo_weights` of chosen times rejected); BCO's reward shift (a
    constant, or a running mean the caller keeps)."""

    policy_chosen: jax.Array
    policy_rejected: jax.Array
    ref_chosen: jax.Array
    ref_rejected: jax.Array
    chosen_nll: jax.Array | None = None
    chosen_lengths: jax.Array | None = None
    rejected_lengths: jax.Array | None = None
    pair_weights: jax.Array | None = None
    bco_delta: jax.Array | float = 0.0


def f_divergence_scores(logratios, options: DPOOptions):
    """f'(pi / pi_ref) of f-DPO ("Beyond Reverse KL: Generalizing Direct Preference Optimization
    with Diverse Divergence Constraints", Wang et al., arXiv:2309.16240, Table 1), as a function
    of the log-ratio u = log pi - log pi_ref (TRL 1.16, ``DPOTrainer._compute_loss``), for
    ``options.f_divergence_type`` (alpha: ``f_alpha_divergence_coef``):

        reverse_kl        u                        (DPO)
        forward_kl        1 - e^(-u)
        js_divergence     log 2 + log s(u)
        alpha_divergence  (e^((alpha - 1) u) - 1) / (alpha - 1)   (u when |alpha - 1| < 1e-6)

    Exponents are capped at 80 (TRL caps the alpha divergence's; the same cap keeps forward KL
    finite for log-ratios below -80).
    """
    u, kind, alpha = _f32(logratios), options.f_divergence_type, options.f_alpha_divergence_coef
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return u
    if kind == "forward_kl":
        return -jnp.expm1(jnp.minimum(-u, _EXP_MAX))
    if kind == "js_divergence":
        return math.log(2.0) + jax.nn.log_sigmoid(u)
    return jnp.expm1(jnp.minimum((alpha - 1.0) * u, _EXP_MAX)) / (alpha - 1.0)


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


def _check_arrays(pairs: DPOPairs, options: DPOOptions) -> None:
    """The arrays the options need (the options themselves were checked when made)."""
    types = options.loss_types
    if (pairs.chosen_lengths is None) != (pairs.rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    if "sigmoid_norm" in types and pairs.chosen_lengths is None:
        raise ValueError("loss_type 'sigmoid_norm' needs chosen_lengths and rejected_lengths")
    if "sft" in types and pairs.chosen_nll is None:
        raise ValueError("loss_type 'sft' needs chosen_nll (the NLL term of the chosen answer)")
    if options.use_weighting and pairs.pair_weights is None:
        raise ValueError("use_weighting (WPO) needs pair_weights (wpo_weights of both answers)")


def _inputs(pairs: DPOPairs, options: DPOOptions) -> DPOInputs:
    """What every term of ``DPO_TERMS`` reads, from the log-probs."""
    policy_chosen, policy_rejected = _f32(pairs.policy_chosen), _f32(pairs.policy_rejected)
    ref_chosen, ref_rejected = _f32(pairs.ref_chosen), _f32(pairs.ref_rejected)
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    chosen_scores = f_divergence_scores(chosen_logratios, options)
    rejected_scores = f_divergence_scores(rejected_logratios, options)
    delta = chosen_scores - rejected_scores
    beta = _f32(options.beta)
    if pairs.chosen_lengths is not None:
        normalised_delta = (chosen_scores / _lengths(pairs.chosen_lengths)
                            - rejected_scores / _lengths(pairs.rejected_lengths))
    else:
        normalised_delta = delta
    return DPOInputs(
        c=chosen_logratios, r=rejected_logratios, d=delta, d_norm=normalised_delta, beta=beta,
        eps=options.label_smoothing, chosen_rewards=beta * chosen_logratios,
        rejected_rewards=beta * rejected_logratios, chosen_nll=pairs.chosen_nll,
        bco_delta=pairs.bco_delta, policy_margin=policy_chosen - policy_rejected,
        ref_margin=ref_chosen - ref_rejected, discopop_tau=options.discopop_tau,
    )


def dpo(pairs: DPOPairs, options: DPOOptions):
    r"""DPO and the DPO-family losses of TRL 1.16's DPOTrainer, alone or weighted together.

    ``pairs`` (:class:`DPOPairs`): policy and reference log-probs of the chosen and rejected
    completions, ``[batch]``, summed over completion tokens. With c = log pi(y_c|x) -
    log pi_ref(y_c|x), r likewise, s_c = f'(c), s_r = f'(r) the scores of ``f_divergence_type``
    (:func:`f_divergence_scores`; s = the log-ratio by default), d = s_c - s_r, b = beta,
    eps = label_smoothing, the per-pair loss of each ``loss_type`` is ``DPO_TERMS[loss_type]``
    (formulas and papers in :mod:`.dpo_terms`): sigmoid (DPO), cdpo, hinge, ipo, exo_pair,
    nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft
    (the ``chosen_nll`` term: RPO, MPO) and sigmoid_norm (Tülu 3; needs the lengths, clamped to
    >= 1 as TRL). Several loss types are combined with ``loss_weights`` (default all 1) as
    sum_k w_k loss_k per pair, as TRL's ``loss_type=[...]``/``loss_weights``; MPO
    (arXiv:2411.10442) is ``"sigmoid,bco_pair,sft"`` with weights ``"0.8,0.2,1.0"``.
    ``f_divergence_type`` other than reverse KL applies only to the terms built on d (TRL's rule).
    ``use_weighting`` multiplies every term per pair by ``pairs.pair_weights`` (WPO), as TRL's;
    the ``sft`` term becomes w_i times the batch's NLL term (TRL multiplies its scalar token mean
    by the per-pair weights).

    Accumulation: every term is a per-pair value summed with weight = pairs, so micro-batches
    add up to the large-batch mean exactly, except (1) ``aot`` / ``aot_unpaired``, which sort
    within the batch they are given: under gradient accumulation each micro-batch is sorted on
    its own, which is what TRL does (it sorts each device's micro-batch) and not the large
    batch's sort; (2) ``sft`` with ``use_weighting``: the product of the weights' mean and the
    NLL token mean does not decompose over micro-batches (the same holds for TRL); exact with one
    micro-batch.

    Metrics (TRL names, ``(sum, count)`` over pairs): ``loss``; ``rewards/chosen`` = b c,
    ``rewards/rejected`` = b r, ``rewards/margins``, ``rewards/accuracies`` (chosen reward >
    rejected reward, ties count as wrong); ``logps/chosen``, ``logps/rejected`` (policy log-probs
    as given); ``bco/reward_mean`` with ``bco_pair``; ``loss/<type>`` for each term of a
    combination.
    """
    _check_arrays(pairs, options)
    inputs, types = _inputs(pairs, options), options.loss_types
    per_pair = jnp.zeros_like(inputs.d)
    extra: Metrics = {}
    for name, weight in zip(types, options.weights):
        value = DPO_TERMS[name](inputs)
        if options.use_weighting:
            w = jax.lax.stop_gradient(_f32(pairs.pair_weights))
            value = w * (jnp.mean(value) if name == "sft" else value)
        per_pair = per_pair + _f32(weight) * value
        if len(types) > 1:
            extra[f"loss/{name}"] = _mean_metric(value)

    metrics = _pair_metrics(inputs.chosen_rewards, inputs.rejected_rewards,
                            _f32(pairs.policy_chosen), _f32(pairs.policy_rejected), per_pair)
    if "bco_pair" in types:
        rewards = jax.lax.stop_gradient(jnp.concatenate([inputs.chosen_rewards,
                                                         inputs.rejected_rewards]))
        metrics["bco/reward_mean"] = (jnp.sum(rewards), _count(rewards))
    metrics.update(extra)
    return jnp.sum(per_pair), _count(inputs.d), metrics
