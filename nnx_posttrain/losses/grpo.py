"""GRPO's policy losses (every ``loss_type`` of TRL 1.16's GRPOTrainer) and their options, the
loss types a table registered by name (``LOSS_TYPES``). Pure JAX functions of arrays; imports jax
and ``nnx_posttrain.errors`` only.

Written from TRL 1.16.0's ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``,
``get_high_entropy_mask``, ``get_off_policy_mask``, ``get_gamma_weights``). Shapes and the
``(total, weight, metrics)`` convention: see :mod:`nnx_posttrain.losses.rl`.

How each aggregation accumulates over micro-batches (the step divides the summed totals by the
summed weights): ``grpo``, ``sapo``, ``luspo`` weigh each sequence once (exact: the mean over all
sequences of the step); ``dapo``, ``cispo``, ``vespo`` weigh each token once (exact: the token
mean of the whole step, TRL's ``num_items_in_batch``); ``dr_grpo`` divides by sequences x
``max_completion_length`` (exact); ``bnpo`` is the token mean of each micro-batch, averaged over
micro-batches (TRL's definition, "local batch"). ``top_entropy_quantile``'s threshold is the
quantile of the micro-batch's tokens (TRL: of the micro-batch gathered over processes, which the
global micro-batch here is).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import Options, flag, out_of_range

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclasses.dataclass(frozen=True)
class GRPOOptions(Options):
    """GRPO's options: TRL 1.16 GRPOConfig's names and defaults (``--algo.*`` of ``grpo``, with
    the sampling options of every online algorithm)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo",
                       "vespo"] = "dapo"
    """grpo (per-sequence mean), bnpo (per micro-batch token mean), dr_grpo (sum / (sequences x max length)), dapo (token mean over the batch; TRL's default), cispo (clipped IS weight), sapo (soft gate), luspo (per-sequence sum), vespo (gamma-weighted sequence ratio)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = (
        "sum_then_normalize")
    """Several reward functions: sum the weighted rewards then normalise per group, or normalise each function per group, sum, then normalise over the batch (GDPO)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sequence (mean log-ratio; GSPO)."""
    epsilon: float = 0.2
    """Lower clipping range of the ratio."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher, e.g. 0.28; cispo's weight cap, e.g. 5.0); default: epsilon."""
    delta: float | None = None
    """Two-sided clipping: cap the unclipped ratio at delta (INTELLECT-2; > 1 + epsilon_high)."""
    beta: float = 0.0
    """Weight of the KL penalty (k3 estimator) to the reference; 0 needs no reference."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the importance ratio (DeepSeek-V3.2's unbiased KL gradient; TRL's default)."""
    top_entropy_quantile: float = 1.0
    """Keep the policy loss only on the top quantile of tokens by entropy (0.2 in the paper; 1 = all)."""
    off_policy_mask_threshold: float | None = None
    """Drop sequences with negative advantage whose mean KL(old || current) exceeds this (DeepSeek-V3.2)."""
    sapo_temperature_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    sapo_temperature_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages."""
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # dr_grpo's denominator (sequences x this); an online algorithm's config has it among its
    # sampling options (``max_completion_length``, TRL's), which its field takes the place of
    max_completion_length: int | None = None

    @property
    def eps_high(self) -> float:
        """The upper clipping range: ``epsilon_high``, default ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def problems(self) -> list[str]:
        out = []
        for name, allowed in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                              ("multi_objective_aggregation", AGGREGATIONS),
                              ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)):
            if getattr(self, name) not in allowed:
                out.append(f"{flag(name)} must be one of {', '.join(allowed)}, got "
                           f"{getattr(self, name)!r}")
        out += out_of_range(self, "top_entropy_quantile", 0 <= self.top_entropy_quantile <= 1,
                            "in [0, 1]")
        out += out_of_range(self, "epsilon", self.epsilon >= 0, ">= 0")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length or 0) >= 1:
            out.append(f"{flag('loss_type')} dr_grpo needs {flag('max_completion_length')} >= 1")
        return out


class PolicyInputs(NamedTuple):
    """The arrays of a policy loss, ``[B, T]`` aligned as ``model.token_logprobs`` returns them
    unless noted: the policy's log-probs, those of the policy that generated the completions
    (``stop_gradient(logps)`` with one optimisation iteration per generation: the ratio is 1),
    the advantages ``[B]``, the 0/1 loss mask, the reference's log-probs (the KL term; None
    without), the policy's per-token entropies (metrics, ``top_entropy_quantile``; None
    without)."""

    logps: jax.Array
    old_logps: jax.Array
    advantages: jax.Array
    mask: jax.Array
    ref_logps: jax.Array | None = None
    entropies: jax.Array | None = None


class _Ratios(NamedTuple):
    """What every loss type reads, computed once from the inputs."""

    m: jax.Array  # the float mask [B, T]
    adv: jax.Array  # advantages [B, 1]
    tokens: jax.Array  # masked tokens
    rows: jax.Array  # sequences
    seq_tokens: jax.Array  # masked tokens per sequence, >= 1, [B, 1]
    log_ratio: jax.Array  # logp - old, per token
    coef: jax.Array  # the importance weight w, per token or [B, 1] (before ``delta`` caps it)
    by_sequence: bool  # one importance weight per sequence


def _ratios(x: PolicyInputs, options: GRPOOptions) -> _Ratios:
    m = x.mask.astype(jnp.float32)
    seq_tokens = jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    log_ratio = x.logps - x.old_logps
    by_sequence = options.importance_sampling_level == "sequence"
    log_w = (log_ratio * m).sum(-1, keepdims=True) / seq_tokens if by_sequence else log_ratio
    return _Ratios(m, jnp.asarray(x.advantages, jnp.float32)[:, None], m.sum(),
                   jnp.asarray(m.shape[0], jnp.float32), seq_tokens, log_ratio, jnp.exp(log_w),
                   by_sequence)


def k3_kl(logps, ref_logps):
    """Per-token KL(pi || ref) estimate of Schulman (k3): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logps - logps
    return jnp.exp(d) - d - 1.0


def high_entropy_mask(entropies, mask, threshold):
    """TRL's ``get_high_entropy_mask``: 1 where a token's entropy is >= the ``threshold``
    quantile (linear interpolation, as ``torch.quantile``) of the entropies of the tokens where
    ``mask`` is 1; 0 elsewhere (all 0 when no token is masked in)."""
    m = mask > 0
    flat = jnp.where(m, jax.lax.stop_gradient(entropies), jnp.inf).reshape(-1)
    ordered = jnp.sort(flat)
    n = m.sum()
    pos = threshold * jnp.maximum(n - 1, 0).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    low_v, high_v = ordered[lo], ordered[hi]
    value = low_v + (pos - lo) * jnp.where(hi > lo, high_v - low_v, 0.0)
    return ((entropies >= value) & m & (n > 0)).astype(jnp.float32)


# ----------------------------------------------------------------------------- the loss types


class _Counts(NamedTuple):
    """What the clip-ratio metrics count over."""

    m: jax.Array  # the float mask [B, T]
    tokens: jax.Array
    rows: jax.Array
    by_sequence: bool  # one importance weight per sequence: every row counts once, as TRL


def _clip_metrics(coef, adv, counts: _Counts, bounds: tuple[float, float]):
    """TRL's clip ratios, ``bounds`` = (e_l, e_h): token means over the masked tokens, or
    sequence means when the importance weight is one per sequence (``by_sequence``: the option
    decides, never the shape: a completion of one token has a [B, 1] token-level weight too)."""
    eps_low, eps_high = bounds
    low = ((coef < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32)
    high = ((coef > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)
    if counts.by_sequence:  # every row counts once, as TRL
        count, low, high = counts.rows, low[:, 0], high[:, 0]
    else:
        count, low, high = counts.tokens, low * counts.m, high * counts.m
    return {
        "clip_ratio/low_mean": (low.sum(), count),
        "clip_ratio/high_mean": (high.sum(), count),
        "clip_ratio/region_mean": ((low + high).sum(), count),
    }


def _counts(r: _Ratios) -> _Counts:
    return _Counts(r.m, r.tokens, r.rows, r.by_sequence)


def _clipped(x: PolicyInputs, r: _Ratios, o: GRPOOptions):
    """grpo, bnpo, dr_grpo, dapo, luspo: l_t = -min(w A, clip(w, 1 - e_l, 1 + e_h) A) (PPO's
    clipped surrogate; DAPO's clip-higher when e_h > e_l, Yu et al., arXiv:2503.14476). With
    ``delta`` (two-sided clipping, INTELLECT-2, arXiv:2505.07291) the unclipped w is also capped
    at ``delta`` (recommended > 1 + e_h)."""
    coef_2 = jnp.clip(r.coef, 1.0 - o.epsilon, 1.0 + o.eps_high)
    coef_1 = r.coef if o.delta is None else jnp.minimum(r.coef, o.delta)
    per_token = -jnp.minimum(coef_1 * r.adv, coef_2 * r.adv)
    return per_token, {}, _clip_metrics(coef_1, r.adv, _counts(r), (o.epsilon, o.eps_high))


def _cispo(x: PolicyInputs, r: _Ratios, o: GRPOOptions):
    """cispo: l_t = -sg(min(w, e_h)) A logp_t (MiniMax-M1, arXiv:2506.13585: the weight is
    clipped, not the update; recommended e_h = 5.0, TRL's default e_h = e_l applies otherwise)."""
    per_token = -jax.lax.stop_gradient(jnp.minimum(r.coef, o.eps_high)) * r.adv * x.logps
    clipped = ((r.coef > o.eps_high) & (r.adv > 0)).astype(jnp.float32)
    ratio = ((clipped[:, 0].sum(), r.rows) if r.by_sequence
             else ((clipped * r.m).sum(), r.tokens))
    return per_token, {}, {"cispo_clip_ratio": ratio}


def _sapo(x: PolicyInputs, r: _Ratios, o: GRPOOptions):
    """sapo: l_t = -(4 / tau) s(tau (w - 1)) A, tau = ``sapo_temperature_pos`` if A > 0 else
    ``sapo_temperature_neg`` (Soft Adaptive Policy Optimization, arXiv:2511.20347)."""
    tau = jnp.where(r.adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
    return -jax.nn.sigmoid(tau * (r.coef - 1.0)) * 4.0 / tau * r.adv, {}, {}


def _vespo_weights(r: _Ratios, o: GRPOOptions):
    """TRL's ``get_gamma_weights`` without vLLM's importance ratio: phi(w) = e^lambda w^k
    e^(-lambda w), w = exp(sum_t clamp(log ratio_t, +-20)) clamped to [1e-8, e^20]; detached."""
    lower = math.log(1e-8)
    seq = jnp.sum(jnp.clip(r.log_ratio, -20.0, 20.0) * r.m, axis=-1, keepdims=True)
    log_w = jnp.clip(seq, lower, 20.0)
    nonneg = r.adv >= 0
    k = jnp.where(nonneg, o.vespo_k_pos, o.vespo_k_neg)
    lam = jnp.maximum(jnp.where(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def _vespo(x: PolicyInputs, r: _Ratios, o: GRPOOptions):
    """vespo: l_t = -phi(W) A logp_t, phi(W) = e^lambda W^k e^(-lambda W), W the sequence's
    product of token ratios, (k, lambda) by the sign of A, phi detached (VESPO,
    arXiv:2602.10693)."""
    phi = _vespo_weights(r, o)
    return -phi * r.adv * x.logps, {"vespo/phi_seq_mean": (phi.sum(), r.rows)}, {}


def _sequence_mean(masked, r: _Ratios, o: GRPOOptions):
    """grpo, sapo: each sequence's token mean, then the mean over sequences (Shao et al.,
    arXiv:2402.03300)."""
    return (masked.sum(-1) / r.seq_tokens[:, 0]).sum(), r.rows


def _micro_batch_token_mean(masked, r: _Ratios, o: GRPOOptions):
    """bnpo: the token mean of each micro-batch, averaged over micro-batches."""
    return masked.sum() / jnp.maximum(r.tokens, 1.0), jnp.ones((), jnp.float32)


def _max_length_mean(masked, r: _Ratios, o: GRPOOptions):
    """dr_grpo: token sum / (sequences x ``max_completion_length``) (arXiv:2503.20783)."""
    return masked.sum(), r.rows * o.max_completion_length


def _sequence_sum_mean(masked, r: _Ratios, o: GRPOOptions):
    """luspo: each sequence's token *sum*, then the mean over sequences (arXiv:2602.05261;
    with ``importance_sampling_level="sequence"`` as the paper)."""
    return masked.sum(), r.rows


def _token_mean(masked, r: _Ratios, o: GRPOOptions):
    """dapo, cispo, vespo: the token mean over the whole (accumulated) batch."""
    return masked.sum(), r.tokens


class LossType(NamedTuple):
    """A GRPO loss type: its per-token policy term ``term(inputs, ratios, options) ->
    (per_token, metrics before the loss, metrics after it)`` and its aggregation over the masked
    tokens ``aggregate(masked, ratios, options) -> (total, weight)``."""

    term: Callable
    aggregate: Callable


GRPO_LOSSES: dict[str, LossType] = {
    "grpo": LossType(_clipped, _sequence_mean),
    "bnpo": LossType(_clipped, _micro_batch_token_mean),
    "dr_grpo": LossType(_clipped, _max_length_mean),
    "dapo": LossType(_clipped, _token_mean),
    "cispo": LossType(_cispo, _token_mean),
    "sapo": LossType(_sapo, _sequence_mean),
    "luspo": LossType(_clipped, _sequence_sum_mean),
    "vespo": LossType(_vespo, _token_mean),
}
LOSS_TYPES = tuple(GRPO_LOSSES)


# ----------------------------------------------------------------------------- the loss


def _masked(per_token, x: PolicyInputs, r: _Ratios, o: GRPOOptions):
    """The policy term with TRL's masks: sequences with A < 0 and mean_t(old_t - logp_t) >
    ``off_policy_mask_threshold`` dropped (DeepSeek-V3.2's off-policy sequence mask,
    arXiv:2512.02556); with ``top_entropy_quantile`` rho < 1, only the tokens whose entropy is in
    the top rho quantile of the micro-batch kept ("Beyond the 80/20 Rule", arXiv:2506.01939)."""
    per_token = jnp.broadcast_to(per_token, r.m.shape)
    if o.off_policy_mask_threshold is not None:
        kl_old = (((x.old_logps - jax.lax.stop_gradient(x.logps)) * r.m).sum(-1, keepdims=True)
                  / r.seq_tokens)
        keep = (r.adv >= 0) | (kl_old <= o.off_policy_mask_threshold)
        per_token = per_token * keep.astype(jnp.float32)
    if o.top_entropy_quantile < 1.0:
        per_token = per_token * high_entropy_mask(x.entropies, r.m, 1.0 - o.top_entropy_quantile)
    return per_token


def _with_kl(per_token, x: PolicyInputs, r: _Ratios, o: GRPOOptions, metrics: dict):
    """With a reference: the k3 KL, k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, times w
    when ``use_bias_correction_kl`` (w before ``delta`` caps it, as TRL), logged as ``kl`` and
    added as beta k3_t."""
    if x.ref_logps is None:
        return per_token
    kl = k3_kl(x.logps, x.ref_logps)
    if o.use_bias_correction_kl:
        kl = kl * r.coef
    metrics["kl"] = ((kl * r.m).sum(), r.tokens)
    return per_token + o.beta * kl if o.beta else per_token


def clipped_policy_loss(inputs: PolicyInputs, options: GRPOOptions):
    r"""GRPO's policy loss, every ``loss_type`` of TRL 1.16 (``GRPO_LOSSES``; defaults TRL's).

    The importance weight w is per token, w_t = exp(logp_t - old_t) (``importance_sampling_level
    ="token"``), or one per sequence, w = exp(mean_t (logp_t - old_t)) (``"sequence"``: GSPO,
    "Group Sequence Policy Optimization", Zheng et al., arXiv:2507.18071). With A the advantage,
    e_l = ``epsilon``, e_h = ``epsilon_high`` (default e_l), each loss type's per-token term
    (``_clipped``: grpo, bnpo, dr_grpo, dapo, luspo; ``_cispo``, ``_sapo``, ``_vespo``) is masked
    as TRL (``_masked``: off-policy sequences, ``top_entropy_quantile``, which needs
    ``inputs.entropies``), gets the reference's KL (``_with_kl``: with ``beta`` > 0, the k3 KL
    times w when ``use_bias_correction_kl``, TRL's default: the unbiased reverse-KL gradient of
    DeepSeek-V3.2; w is differentiable, so this changes the gradient even where w = 1) and is
    aggregated over the masked tokens by the loss type (``_sequence_mean``: grpo, sapo;
    ``_micro_batch_token_mean``: bnpo; ``_max_length_mean``: dr_grpo; ``_sequence_sum_mean``:
    luspo; ``_token_mean``: dapo, cispo, vespo); returned as ``(total, weight)``, see the module
    docstring for accumulation.

    With one optimisation iteration per generation, pass ``old_logps = stop_gradient(logps)``:
    w is 1 and the gradient is the plain policy gradient. Metrics (TRL's names, ``(sum,
    count)``): ``loss``, ``kl`` (with a reference: the (corrected) k3 token mean), ``entropy``,
    ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (clipped loss types; per token, or
    per sequence at the sequence level), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``.
    """
    if options.top_entropy_quantile < 1.0 and inputs.entropies is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
    r = _ratios(inputs, options)
    loss = GRPO_LOSSES[options.loss_type]
    per_token, metrics, after = loss.term(inputs, r, options)
    per_token = _with_kl(_masked(per_token, inputs, r, options), inputs, r, options, metrics)
    total, weight = loss.aggregate(per_token * r.m, r, options)
    metrics["loss"] = (total, weight)
    metrics.update(after)
    if inputs.entropies is not None:
        metrics["entropy"] = ((inputs.entropies * r.m).sum(), r.tokens)
    return total, weight, metrics
