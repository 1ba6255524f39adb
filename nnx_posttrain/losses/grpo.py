"""GRPO's policy losses (every ``loss_type`` of TRL 1.16's GRPOTrainer) and RLOO's. Pure JAX
functions of arrays; imports jax only.

Written from TRL 1.16.0's ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``,
``get_high_entropy_mask``, ``get_off_policy_mask``, ``get_gamma_weights``) and
``trl/trainer/rloo_trainer.py`` (``RLOOTrainer._compute_loss``). Shapes and the ``(total,
weight, metrics)`` convention: see :mod:`nnx_posttrain.losses.rl`.

How each aggregation accumulates over micro-batches (the step divides the summed totals by the
summed weights): ``grpo``, ``sapo``, ``luspo`` and RLOO weigh each sequence once (exact: the
mean over all sequences of the step); ``dapo``, ``cispo``, ``vespo`` weigh each token once
(exact: the token mean of the whole step, TRL's ``num_items_in_batch``); ``dr_grpo`` divides by
sequences x ``max_completion_length`` (exact); ``bnpo`` is the token mean of each micro-batch,
averaged over micro-batches (TRL's definition, "local batch"). ``top_entropy_quantile``'s
threshold is the quantile of the micro-batch's tokens (TRL: of the micro-batch gathered over
processes, which the global micro-batch here is).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


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


def _vespo_weights(advantages, log_ratio, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """TRL's ``get_gamma_weights`` without vLLM's importance ratio: phi(w) = e^lambda w^k
    e^(-lambda w), w = exp(sum_t clamp(log ratio_t, +-20)) clamped to [1e-8, e^20]; detached."""
    lower = math.log(1e-8)
    seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * mask, axis=-1, keepdims=True)
    log_w = jnp.clip(seq, lower, 20.0)
    nonneg = advantages >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def clipped_policy_loss(logps, old_logps, advantages, mask, *, epsilon: float = 0.2,
                        epsilon_high: float | None = None, beta: float = 0.0, ref_logps=None,
                        loss_type: str = "dapo", max_completion_length: int | None = None,
                        entropies=None, importance_sampling_level: str = "token",
                        delta: float | None = None, top_entropy_quantile: float = 1.0,
                        use_bias_correction_kl: bool = True, off_policy_mask_threshold=None,
                        sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                        vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                        vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
    r"""GRPO's policy loss, every ``loss_type`` of TRL 1.16 (defaults are TRL's, ``dapo``).

    The importance weight w is per token, w_t = exp(logp_t - old_t) (``importance_sampling_level
    ="token"``), or one per sequence, w = exp(mean_t (logp_t - old_t)) (``"sequence"``: GSPO,
    "Group Sequence Policy Optimization", Zheng et al., arXiv:2507.18071). With A the advantage,
    e_l = ``epsilon``, e_h = ``epsilon_high`` (default e_l):

    - ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: l_t = -min(w A, clip(w, 1 - e_l,
      1 + e_h) A) (PPO's clipped surrogate; DAPO's clip-higher when e_h > e_l, Yu et al.,
      arXiv:2503.14476). With ``delta`` (two-sided clipping, INTELLECT-2, arXiv:2505.07291) the
      unclipped w is also capped at ``delta`` (recommended > 1 + e_h).
    - ``cispo``: l_t = -sg(min(w, e_h)) A logp_t (MiniMax-M1, arXiv:2506.13585: the weight is
      clipped, not the update; recommended e_h = 5.0, TRL's default e_h = e_l applies otherwise).
    - ``sapo``: l_t = -(4 / tau) s(tau (w - 1)) A, tau = ``sapo_temperature_pos`` if A > 0 else
      ``sapo_temperature_neg`` (Soft Adaptive Policy Optimization, arXiv:2511.20347).
    - ``vespo``: l_t = -phi(W) A logp_t, phi(W) = e^lambda W^k e^(-lambda W), W the sequence's
      product of token ratios, (k, lambda) by the sign of A, phi detached (VESPO,
      arXiv:2602.10693).

    Then (in TRL's order): sequences with A < 0 and mean_t(old_t - logp_t) >
    ``off_policy_mask_threshold`` are dropped (DeepSeek-V3.2's off-policy sequence mask,
    arXiv:2512.02556); with ``top_entropy_quantile`` rho < 1 only the tokens whose entropy is in
    the top rho quantile of the micro-batch keep their policy term ("Beyond the 80/20 Rule",
    arXiv:2506.01939; needs ``entropies``); with ``beta`` > 0 the k3 KL to the reference,
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, is added as beta k3_t, multiplied by w
    when ``use_bias_correction_kl`` (TRL's default: the unbiased reverse-KL gradient of
    DeepSeek-V3.2; w is differentiable, so this changes the gradient even where w = 1).

    Aggregation over the masked tokens (``loss_type``, TRL's names; returned as ``(total,
    weight)``, see the module docstring for accumulation):
    - ``grpo``, ``sapo``: each sequence's token mean, then the mean over sequences (Shao et al.,
      arXiv:2402.03300);
    - ``bnpo``: the token mean of each micro-batch, averaged over micro-batches;
    - ``dr_grpo``: token sum / (sequences x ``max_completion_length``) (arXiv:2503.20783);
    - ``dapo``, ``cispo``, ``vespo``: the token mean over the whole (accumulated) batch;
    - ``luspo``: each sequence's token *sum*, then the mean over sequences (arXiv:2602.05261;
      with ``importance_sampling_level="sequence"`` as the paper).

    With one optimisation iteration per generation, pass ``old_logps = stop_gradient(logps)``:
    w is 1 and the gradient is the plain policy gradient. Metrics (TRL's names, ``(sum,
    count)``): ``loss``, ``kl`` (with a reference: the (corrected) k3 token mean), ``entropy``,
    ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (clipped loss types; per token, or
    per sequence at the sequence level), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {importance_sampling_level!r}")
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    if top_entropy_quantile < 1.0 and entropies is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("dr_grpo needs max_completion_length")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    m = mask.astype(jnp.float32)
    adv = jnp.asarray(advantages, jnp.float32)[:, None]
    tokens, rows = m.sum(), jnp.asarray(m.shape[0], jnp.float32)
    seq_tokens = jnp.maximum(m.sum(-1, keepdims=True), 1.0)

    log_ratio = logps - old_logps
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = (log_ratio * m).sum(-1, keepdims=True) / seq_tokens
    coef_1 = jnp.exp(log_w)
    kl_weight = coef_1  # the bias-corrected KL uses w before ``delta`` caps it, as TRL

    metrics = {}
    if loss_type == "cispo":
        per_token = -jax.lax.stop_gradient(jnp.minimum(coef_1, eps_high)) * adv * logps
    elif loss_type in _CLIPPED:
        coef_2 = jnp.clip(coef_1, 1.0 - eps_low, 1.0 + eps_high)
        if delta is not None:
            coef_1 = jnp.minimum(coef_1, delta)
        per_token = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    elif loss_type == "sapo":
        tau = jnp.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -jax.nn.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau * adv
    else:  # vespo
        phi = _vespo_weights(adv, log_ratio, m, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                             vespo_lambda_neg)
        per_token = -phi * adv * logps
        metrics["vespo/phi_seq_mean"] = (phi.sum(), rows)
    per_token = jnp.broadcast_to(per_token, m.shape)

    if off_policy_mask_threshold is not None:
        kl_old = ((old_logps - jax.lax.stop_gradient(logps)) * m).sum(-1, keepdims=True) / seq_tokens
        keep = (adv >= 0) | (kl_old <= off_policy_mask_threshold)
        per_token = per_token * keep.astype(jnp.float32)
    if top_entropy_quantile < 1.0:
        per_token = per_token * high_entropy_mask(entropies, m, 1.0 - top_entropy_quantile)
    if ref_logps is not None:
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:
            kl = kl * kl_weight
        metrics["kl"] = ((kl * m).sum(), tokens)
        if beta:
            per_token = per_token + beta * kl

    masked = per_token * m
    if loss_type in ("grpo", "sapo"):
        total, weight = (masked.sum(-1) / seq_tokens[:, 0]).sum(), rows
    elif loss_type == "bnpo":
        total, weight = masked.sum() / jnp.maximum(tokens, 1.0), jnp.ones((), jnp.float32)
    elif loss_type == "dr_grpo":
        total, weight = masked.sum(), rows * max_completion_length
    elif loss_type == "luspo":
        total, weight = masked.sum(), rows
    else:  # dapo, cispo, vespo
        total, weight = masked.sum(), tokens
    metrics["loss"] = (total, weight)
    by_sequence = importance_sampling_level == "sequence"
    if loss_type in _CLIPPED:
        metrics.update(_clip_metrics(coef_1, adv, m, eps_low, eps_high, tokens, rows, by_sequence))
    elif loss_type == "cispo":
        clipped = ((coef_1 > eps_high) & (adv > 0)).astype(jnp.float32)
        metrics["cispo_clip_ratio"] = ((clipped[:, 0].sum(), rows) if by_sequence
                                       else ((clipped * m).sum(), tokens))
    if entropies is not None:
        metrics["entropy"] = ((entropies * m).sum(), tokens)
    return total, weight, metrics


def _clip_metrics(coef, adv, m, eps_low, eps_high, tokens, rows, by_sequence: bool):
    """TRL's clip ratios: token means over the masked tokens, or sequence means when the
    importance weight is one per sequence (``by_sequence``: the option decides, never the
    shape: a completion of one token has a [B, 1] token-level weight too)."""
    low = ((coef < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32)
    high = ((coef > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32)
    if by_sequence:  # every row counts once, as TRL
        count, low, high = rows, low[:, 0], high[:, 0]
    else:
        count, low, high = tokens, low * m, high * m
    return {
        "clip_ratio/low_mean": (low.sum(), count),
        "clip_ratio/high_mean": (high.sum(), count),
        "clip_ratio/region_mean": ((low + high).sum(), count),
    }


def rloo_loss(logps, old_logps, advantages, mask, *, epsilon: float = 0.2,
              epsilon_high: float | None = None, entropies=None):
    r"""RLOO's policy loss as TRL 1.16's ``RLOOTrainer._compute_loss``: one importance ratio per
    *sequence*, clipped, averaged over sequences.

        w_i = exp(sum_t logp_it - sum_t old_it)        (masked sums over the completion)
        l_i = -min(w_i A_i, clip(w_i, 1 - e_l, 1 + e_h) A_i),   loss = mean_i l_i

    REINFORCE Leave-One-Out (Ahmadian et al., arXiv:2402.14740) with PPO's clip for
    ``num_iterations`` > 1. ``(total, weight)`` = (sum of l_i, sequences): exact under
    accumulation. A sequence whose mask is all 0 (e.g. ``mask_truncated_completions``) has w = 1
    and no gradient, but counts in the mean, as TRL. Metrics: ``loss``, ``clip_ratio/low_mean``,
    ``/high_mean``, ``/region_mean`` (per sequence), ``entropy`` (token mean).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    m = mask.astype(jnp.float32)
    adv = jnp.asarray(advantages, jnp.float32)
    ratio = jnp.exp((logps * m).sum(-1) - (old_logps * m).sum(-1))
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + eps_high)
    per_seq = -jnp.minimum(ratio * adv, clipped * adv)
    rows, tokens = jnp.asarray(m.shape[0], jnp.float32), m.sum()
    total = per_seq.sum()
    metrics = {"loss": (total, rows)}
    metrics.update(_clip_metrics(ratio[:, None], adv[:, None], m, epsilon, eps_high, tokens, rows,
                                 by_sequence=True))
    if entropies is not None:
        metrics["entropy"] = ((entropies * m).sum(), tokens)
    return total, rows, metrics
