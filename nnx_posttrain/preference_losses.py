"""Preference-optimisation losses: pure JAX functions of arrays. No model, no I/O.

Same conventions as :mod:`nnx_posttrain.losses`. Every loss returns ``(total, weight, metrics)``:

- ``total``: the loss *summed* over pairs (or over examples for the unpaired KTO);
- ``weight``: the number of pairs / examples (float32), so ``total / weight`` is the batch mean;
- ``metrics``: TRL metric name -> ``(sum, count)``.

Summing ``total``, ``weight`` and every metric's ``sum`` and ``count`` over micro-batches and then
dividing gives exactly the large-batch mean (for KTO, when the KL estimate is shared; see
:func:`kto`). A metric whose count is 0 (e.g. ``rewards/rejected`` in a KTO batch with only
desirable examples) has no value for that batch: skip it rather than dividing 0 by 0.

Inputs are per-sequence log-probabilities, float32 arrays of shape ``[batch]``: the log-probability
of the completion given the prompt, either summed over the completion tokens or averaged over them
(:func:`sequence_logps` computes both from per-token log-probs and a 0/1 mask). Which one a loss
expects is stated in its docstring; it follows what TRL's trainer feeds it, so that numbers are
comparable with TRL runs:

================  ==========================================================================
loss              per-sequence log-probs
================  ==========================================================================
``dpo``           summed (TRL's DPOTrainer); ``ipo`` and ``sigmoid_norm`` divide by the
                  completion lengths given in ``chosen_lengths`` / ``rejected_lengths``
``cpo``           summed for ``sigmoid`` / ``hinge``, averaged for ``ipo`` (TRL's CPOTrainer)
``simpo``         averaged
``orpo``          averaged
``kto``           summed
================  ==========================================================================

The definitions were checked against TRL's trainers (DPOTrainer ``loss_type`` branches,
CPOTrainer ``cpo_loss``, ORPOTrainer ``odds_ratio_loss``, KTOTrainer ``kto_loss``,
RewardTrainer ``compute_loss``). Where TRL versions differ, the docstring says which one is
followed and how to get the other.

Numerics: everything is computed in float32 with ``log_sigmoid`` / ``softplus`` / ``log1mexp``
forms, so equal log-probs, huge margins (|x| ~ 1e4) and very negative log-probs give finite
losses and finite gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Metrics = dict[str, tuple[jax.Array, jax.Array]]

DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "robust",
    "bco_pair",
    "sppo_hard",
    "nca_pair",
    "apo_zero",
    "apo_down",
    "sigmoid_norm",
    "sft",
)
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")

# log1mexp(x) = log(1 - exp(x)) is -inf at x = 0 (probability 1, infinite odds). Inputs are
# clamped to at most this value so ORPO stays finite for a sequence the model is certain of;
# it changes nothing for any average log-prob below -1e-12.
_LOG1MEXP_MAX_INPUT = -1e-12


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _count(x: jax.Array) -> jax.Array:
    return jnp.asarray(x.shape[0], dtype=jnp.float32)


def _mean_metric(values: jax.Array, where: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` of ``values`` (optionally only where the 0/1 float ``where`` is 1)."""
    values = jax.lax.stop_gradient(_f32(values))
    if where is None:
        return jnp.sum(values), _count(values)
    return jnp.sum(jnp.where(where > 0, values, 0.0)), jnp.sum(where)


def _is_python_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _lengths(x) -> jax.Array:
    # TRL clamps completion lengths to at least 1 (``mask.sum(dim=1).clamp(min=1.0)``).
    return jnp.maximum(_f32(x), 1.0)


def sequence_logps(token_logps, mask, average: bool) -> jax.Array:
    """Per-sequence log-probability from per-token log-probs ``[batch, length]`` and a 0/1 mask.

    average=False: sum_t mask_t * logp_t                       (the sequence log-likelihood)
    average=True:  sum_t mask_t * logp_t / max(sum_t mask_t, 1) (the per-token average)

    Positions with mask 0 contribute nothing, whatever their value (even -inf or NaN), and get
    zero gradient. A sequence with no masked-in token gives 0.
    """
    mask = _f32(mask)
    token_logps = _f32(token_logps)
    total = jnp.sum(jnp.where(mask > 0, token_logps, 0.0) * mask, axis=-1)
    if not average:
        return total
    return total / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def log1mexp(x) -> jax.Array:
    """log(1 - exp(x)) for x <= 0, accurate in float32 over the whole range.

    Mächler's rule ("Accurately Computing log(1 - exp(-|a|))", 2012): for -log 2 < x <= 0 use
    log(-expm1(x)) (exact near 0, where 1 - exp(x) cancels), otherwise log1p(-exp(x)) (exact for
    very negative x, where exp(x) underflows). Each branch only ever sees inputs from its own
    range, so neither produces inf/NaN that ``jnp.where`` would leak into the gradient. Inputs are
    clamped to at most -1e-12 so the result (and its gradient) stays finite at x = 0.
    """
    x = jnp.minimum(_f32(x), _LOG1MEXP_MAX_INPUT)
    near_zero = x > -jnp.log(2.0).astype(jnp.float32)
    x_near = jnp.where(near_zero, x, -1.0)
    x_far = jnp.where(near_zero, -1.0, x)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(x_near)), jnp.log1p(-jnp.exp(x_far)))


def _pair_metrics(
    chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, per_pair_loss
) -> Metrics:
    """The metrics TRL's DPO / CPO / ORPO trainers log, as ``(sum, count)`` over pairs."""
    return {
        "loss": _mean_metric(per_pair_loss),
        "rewards/chosen": _mean_metric(chosen_rewards),
        "rewards/rejected": _mean_metric(rejected_rewards),
        "rewards/margins": _mean_metric(chosen_rewards - rejected_rewards),
        "rewards/accuracies": _mean_metric((chosen_rewards > rejected_rewards).astype(jnp.float32)),
        "logps/chosen": _mean_metric(policy_chosen),
        "logps/rejected": _mean_metric(policy_rejected),
    }


def _smoothed_sigmoid(logits, label_smoothing) -> jax.Array:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the (conservative) logistic loss."""
    loss = -jax.nn.log_sigmoid(logits)
    if _is_python_number(label_smoothing) and label_smoothing == 0:
        return loss
    eps = _f32(label_smoothing)
    return (1.0 - eps) * loss - eps * jax.nn.log_sigmoid(-logits)


# ----------------------------------------------------------------------------------------------
# DPO and its variants
# ----------------------------------------------------------------------------------------------


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

    the per-pair loss of each ``loss_type`` is

    ``sigmoid``      -(1-eps) log s(b d) - eps log s(-b d)
        DPO: "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
        (Rafailov et al., arXiv:2305.18290), eq. 7. With eps > 0 it is conservative DPO (cDPO,
        E. Mitchell, "A note on DPO with noisy preferences & relationship to IPO", 2023, a note
        without an arXiv id). TRL 0.x applies eps here; TRL >= 1.0 ignores label_smoothing for
        ``sigmoid`` (it only uses it for ``robust``/``exo_pair``): with eps = 0 (the default) both
        agree.
    ``hinge``        max(0, 1 - b d)
        SLiC-HF ("SLiC-HF: Sequence Likelihood Calibration with Human Feedback", arXiv:2305.10425)
        and RSO ("Statistical Rejection Sampling Improves Preference Optimization",
        arXiv:2309.06657); 1/beta is the margin.
    ``ipo``          (d_n - 1/(2 b))^2,  d_n = c / |y_c| - r / |y_r|
        IPO: "A General Theoretical Paradigm to Understand Learning from Human Preferences"
        (Azar et al., arXiv:2310.12036), eq. 17, beta is the paper's tau. TRL length-normalises the
        IPO log-ratios (TRL 0.x by averaging the log-probs, TRL >= 1.0 by dividing the summed
        log-ratios by the completion token counts, "confirmed with the IPO authors"). Pass
        ``chosen_lengths`` and ``rejected_lengths`` with summed log-probs; without lengths the
        log-probs are used as given (pass length-averaged log-probs then).
    ``robust``       (-(1-eps) log s(b d) + eps log s(-b d)) / (1 - 2 eps),  0 <= eps < 0.5
        Robust DPO: "Provably Robust DPO: Aligning Language Models with Noisy Feedback"
        (Chowdhury et al., arXiv:2403.00409); eps is the label-flip rate.
    ``bco_pair``     -log s(b c - delta) - log s(-(b r - delta))
        BCO: "Binary Classifier Optimization for Large Language Model Alignment" (Jung et al.,
        arXiv:2404.04656). delta = ``bco_delta`` is the running mean of the implicit rewards
        b c and b r, maintained by the caller (it is a constant here: no gradient flows into it).
        TRL 0.x keeps it in a ``RunningMoments``: before each micro-batch's loss it adds that
        micro-batch's mean reward mean(cat(b c, b r)) (gathered over processes, one observation per
        process) and uses the cumulative average of all such batch means as delta. This function
        returns the batch's reward sum and count as metric ``bco/reward_mean``; after the step,
        update with :func:`bco_update_delta` (which reproduces that cumulative average, lagging
        TRL by the current batch: TRL includes the current batch in its own delta). TRL >= 1.0
        dropped the running mean (delta = 0): ``bco_delta=0.0``, the default, reproduces that.
    ``sppo_hard``    (c - 1/(2 b))^2 + (r + 1/(2 b))^2
        SPPO: "Self-Play Preference Optimization for Language Model Alignment" (Wu et al.,
        arXiv:2405.00675), eq. 4.7 with hard winner/loser probabilities 1 and 0 (as TRL).
    ``nca_pair``     -log s(b c) - 1/2 log s(-b c) - 1/2 log s(-b r)
        NCA: "Noise Contrastive Alignment of Language Models with Explicit Rewards" (Chen et al.,
        arXiv:2402.05369).
    ``apo_zero``     (1 - s(b c)) + s(b r)
    ``apo_down``     s(b c) + (1 - s(b d))
        APO: "Anchored Preference Optimization and Contrastive Revisions: Addressing
        Underspecification in Alignment" (D'Oosterlinck et al., arXiv:2408.06266), eqs. 7 and 8.
    ``sigmoid_norm`` -log s(b (c / |y_c| - r / |y_r|))
        Length-normalised DPO of Tülu 3 ("Tülu 3: Pushing Frontiers in Open Language Model
        Post-Training", arXiv:2411.15124, eq. 6), after SimPO's length normalisation (arXiv:
        2405.14734) but keeping the reference model. TRL added it as ``sigmoid_norm`` in PR #5406
        (2026): the summed log-ratios divided by the completion token counts, clamped to >= 1.
        Requires ``chosen_lengths`` and ``rejected_lengths`` (typical beta: 2 to 5, not 0.1).
    ``sft``          ``chosen_nll``
        The negative log-likelihood of the chosen completion (RPO, "Iterative Reasoning Preference
        Optimization", arXiv:2404.19733; the generation term of MPO). Pass the per-example NLL of
        the chosen completion; TRL's ``sft`` term is the token-mean cross-entropy over all chosen
        tokens of the batch, which equals the mean of per-example *length-averaged* NLLs when the
        chosen completions have equal lengths: pass ``sequence_logps(..., average=True)`` negated
        to be closest to TRL, or the summed NLL for a per-sequence weighting.

    (s is the logistic sigmoid.) A sequence of loss types is combined with ``loss_weights``
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

    def term(name: str) -> jax.Array:
        if name == "sigmoid":
            return _smoothed_sigmoid(beta * delta, label_smoothing)
        if name == "hinge":
            return jax.nn.relu(1.0 - beta * delta)
        if name == "ipo":
            return jnp.square(normalised_delta - 1.0 / (2.0 * beta))
        if name == "robust":
            eps = _f32(label_smoothing)
            clean = -(1.0 - eps) * jax.nn.log_sigmoid(beta * delta)
            flipped = -eps * jax.nn.log_sigmoid(-beta * delta)
            return (clean - flipped) / (1.0 - 2.0 * eps)
        if name == "bco_pair":
            shift = jax.lax.stop_gradient(_f32(bco_delta))
            return -jax.nn.log_sigmoid(chosen_rewards - shift) - jax.nn.log_sigmoid(
                -(rejected_rewards - shift)
            )
        if name == "sppo_hard":
            half_inv_beta = 0.5 / beta
            return jnp.square(chosen_logratios - half_inv_beta) + jnp.square(
                rejected_logratios + half_inv_beta
            )
        if name == "nca_pair":
            return (
                -jax.nn.log_sigmoid(chosen_rewards)
                - 0.5 * jax.nn.log_sigmoid(-chosen_rewards)
                - 0.5 * jax.nn.log_sigmoid(-rejected_rewards)
            )
        if name == "apo_zero":
            return jax.nn.sigmoid(-chosen_rewards) + jax.nn.sigmoid(rejected_rewards)
        if name == "apo_down":
            return jax.nn.sigmoid(chosen_rewards) + jax.nn.sigmoid(-beta * delta)
        if name == "sigmoid_norm":
            return -jax.nn.log_sigmoid(beta * normalised_delta)
        if name == "sft":
            return jnp.broadcast_to(_f32(chosen_nll), delta.shape)
        raise AssertionError(name)

    per_pair = jnp.zeros_like(delta)
    extra: Metrics = {}
    for name, weight in zip(loss_types, weights):
        value = term(name)
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


def bco_update_delta(delta, num_batches, reward_mean_metric):
    """Update BCO's reward baseline after a step; returns ``(new_delta, new_num_batches)``.

    delta_k = delta_{k-1} + (m_k - delta_{k-1}) / k,  m_k = sum / count of ``bco/reward_mean``

    i.e. the cumulative average of the per-batch mean rewards, which is what TRL 0.x's
    ``RunningMoments`` (initial count 1e-24, so the first batch sets it) computes for
    ``loss_type="bco_pair"``. Start from ``delta=0.0, num_batches=0``; pass the metric summed over
    the step's micro-batches (and devices). Keep both numbers in the training state so a resumed
    run continues exactly.
    """
    total, count = reward_mean_metric
    batch_mean = _f32(total) / jnp.maximum(_f32(count), 1.0)
    num_batches = _f32(num_batches) + 1.0
    delta = _f32(delta)
    return delta + (batch_mean - delta) / num_batches, num_batches


# ----------------------------------------------------------------------------------------------
# Reference-free pairwise losses: SimPO, CPO, ORPO
# ----------------------------------------------------------------------------------------------


def _reference_free(per_pair, chosen, rejected, beta, chosen_nll, nll_weight, uses_nll):
    """The common end of SimPO and CPO: the optional NLL term, TRL's metrics (rewards are beta
    times the policy log-probs), the (sum, weight, metrics) triple."""
    if uses_nll:
        per_pair = per_pair + _f32(nll_weight) * _f32(chosen_nll)
    metrics = _pair_metrics(beta * chosen, beta * rejected, chosen, rejected, per_pair)
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
):
    r"""SimPO: reference-free, length-normalised logistic loss with a target reward margin.

        loss = -(1-eps) log s(z) - eps log s(-z) + nll_weight * chosen_nll,
        z = beta * (avg log pi(y_c|x) - avg log pi(y_r|x)) - gamma

    "SimPO: Simple Preference Optimization with a Reference-Free Reward" (Meng, Xia, Chen,
    arXiv:2405.14734), eq. 6. Inputs are *length-averaged* log-probs of the completions. Pure SimPO
    by default (``nll_weight=0``); ``nll_weight > 0`` adds the chosen NLL, which is CPO-SimPO
    (TRL's CPOTrainer with ``loss_type="simpo"`` and ``cpo_alpha > 0``). ``label_smoothing`` is
    TRL's / the SimPO repo's conservative variant (0 in the paper).

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
    beta = _f32(beta)
    logits = beta * (chosen - rejected) - _f32(gamma)
    per_pair = _smoothed_sigmoid(logits, label_smoothing)
    return _reference_free(per_pair, chosen, rejected, beta, chosen_nll, nll_weight, uses_nll)


def cpo(
    policy_chosen,
    policy_rejected,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_nll=None,
    nll_weight: float = 1.0,
):
    r"""CPO: a reference-free DPO-style preference loss plus the NLL of the chosen completion.

        d = log pi(y_c|x) - log pi(y_r|x),   b = beta
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

    ``chosen_nll`` is the per-example NLL of the chosen completion (needed unless
    ``nll_weight == 0``). TRL uses the token-mean cross-entropy over all chosen tokens of the batch;
    per-example length-averaged NLLs match it when chosen lengths are equal.

    Metrics as TRL's CPOTrainer: ``rewards/chosen`` = b log pi(y_c|x) (policy only, no reference),
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``,
    ``logps/rejected``, ``nll_loss`` (when ``chosen_nll`` is given), ``loss``.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(
            f"unknown CPO loss_type {loss_type!r}; expected one of {CPO_LOSS_TYPES} "
            "(for 'simpo' use preference_losses.simpo)"
        )
    uses_nll = not (_is_python_number(nll_weight) and nll_weight == 0)
    if uses_nll and chosen_nll is None:
        raise ValueError("cpo needs chosen_nll unless nll_weight == 0")

    chosen, rejected = _f32(policy_chosen), _f32(policy_rejected)
    beta = _f32(beta)
    delta = chosen - rejected
    if loss_type == "sigmoid":
        per_pair = _smoothed_sigmoid(beta * delta, label_smoothing)
    elif loss_type == "hinge":
        per_pair = jax.nn.relu(1.0 - beta * delta)
    else:  # ipo
        per_pair = jnp.square(delta - 1.0 / (2.0 * beta))
    return _reference_free(per_pair, chosen, rejected, beta, chosen_nll, nll_weight, uses_nll)


def orpo(policy_chosen_avg, policy_rejected_avg, chosen_nll, *, beta: float = 0.1):
    r"""ORPO: NLL on the chosen completion plus an odds-ratio preference term, no reference model.

        log odds(y|x) = l - log(1 - exp(l)),   l = average log pi(y|x) over completion tokens
        z = log odds(y_c|x) - log odds(y_r|x)
        loss = chosen_nll - beta * log s(z)

    "ORPO: Monolithic Preference Optimization without Reference Model" (Hong, Lee, Thorne,
    arXiv:2403.07691), eqs. 4-7 (beta is the paper's lambda). Inputs are *length-averaged*
    log-probs (TRL's ORPOTrainer averages), which are < 0; log(1 - exp(l)) is :func:`log1mexp`,
    exact near 0 and for very negative l (TRL writes log1p(-exp(l)), which loses precision near 0
    and gives inf at 0; here an average log-prob of exactly 0 is treated as -1e-12).

    ``chosen_nll`` is the per-example NLL of the chosen completion; TRL uses the token-mean
    cross-entropy over the batch's chosen tokens (equal to the mean of per-example averaged NLLs
    when the chosen lengths are equal).

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

    Metrics: ``kl`` = (z0, 1) per call (TRL logs the per-batch z0 and averages the logged
    values); ``rewards/chosen`` = beta rho over desirable examples, ``rewards/rejected`` over
    undesirable ones, ``logps/chosen``, ``logps/rejected`` likewise (so counts differ: the number
    of desirable vs undesirable examples, exactly as TRL's ``*_sum`` / ``count/*`` bookkeeping;
    a count may be 0); ``loss`` over all examples. TRL's ``rewards/margins`` is the difference of
    the two reward means, computed when logging.
    """
    policy, ref = _f32(policy_logps), _f32(ref_logps)
    desirable = (jnp.asarray(labels) > 0).astype(jnp.float32)
    beta = _f32(beta)
    if kl is None:
        if kl_policy_logps is None and kl_ref_logps is None:
            kl = jnp.zeros((), jnp.float32)
        else:
            kl = jnp.mean(_f32(kl_policy_logps) - _f32(kl_ref_logps))
    kl = jax.lax.stop_gradient(jnp.maximum(_f32(kl), 0.0))

    logratios = policy - ref
    # 1 - s(x) = s(-x): no cancellation when s(x) is close to 1.
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
