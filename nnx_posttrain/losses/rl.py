"""Online RL losses and advantages: pure functions of arrays. No model, no I/O.

Shapes: ``B`` completions (``num_generations`` consecutive rows per prompt), ``T`` positions.
Per-token arrays (``logps``, ``old_logps``, ``ref_logps``, ``mask``) are aligned as
``model.token_logprobs`` returns them (position t holds log p(x_t | x_<t)); ``mask`` is 1 on the
completion tokens that carry loss. Losses return ``(total, weight, metrics)`` as every loss of
:mod:`nnx_posttrain.losses` (see :mod:`nnx_posttrain.losses.common`): summing ``total`` and
``weight`` over micro-batches before dividing gives the large-batch loss exactly.

Definitions follow TRL's GRPOTrainer / RLOOTrainer / PPOTrainer, so metrics are comparable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size: int, scale_rewards: str = "group", eps: float = 1e-4):
    """GRPO (Shao et al. 2024, DeepSeekMath) group-relative advantages.

        A_i = (r_i - mean(r_group)) / (std + eps)

    ``scale_rewards``: 'group' divides by the group's standard deviation, 'batch' by the whole
    batch's, 'none' does not divide (Dr. GRPO, Liu et al. 2025). Standard deviations are unbiased
    (n - 1), as torch's. A group whose rewards are all equal gets advantage 0 (never NaN).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale_rewards == "group":
        centred = centred / (_std(r, axis=1, keepdims=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (_std(r) + eps)
    return centred.reshape(-1)


def leave_one_out_advantages(rewards, group_size: int):
    """RLOO (Ahmadian et al. 2024): each completion's baseline is the mean reward of the *other*
    completions of its prompt.

        A_i = r_i - (sum_j r_j - r_i) / (k - 1)
    """
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 generations per prompt")
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    baseline = (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
    return (r - baseline).reshape(-1)


def whiten(values, mask=None, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / std over the entries where ``mask`` is 1 (all when None); unbiased variance."""
    x = jnp.asarray(values, jnp.float32)
    m = jnp.ones_like(x) if mask is None else mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / jnp.maximum(n - 1.0, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    return out if shift_mean else out + mean


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation (Schulman et al. 2016) over the masked positions.

        delta_t = r_t + gamma * V_{t+1} - V_t;   A_t = delta_t + gamma * lam * A_{t+1}

    Positions outside ``mask`` (prompt, padding after the completion) have V = r = A = 0, so the
    value after the last completion token is 0. Returns (advantages, returns = A + V)."""
    m = mask.astype(jnp.float32)
    r, v = rewards * m, values * m

    def back(carry, x):
        next_value, next_adv = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_value - v_t
        adv = (delta + gamma * lam * next_adv) * m_t
        return (jnp.where(m_t > 0, v_t, next_value), jnp.where(m_t > 0, adv, next_adv)), adv

    zeros = jnp.zeros(r.shape[0], jnp.float32)
    _, adv = jax.lax.scan(back, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    return adv, adv + v


# ----------------------------------------------------------------------------- losses


def k3_kl(logps, ref_logps):
    """Per-token KL(pi || ref) estimate of Schulman (k3): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logps - logps
    return jnp.exp(d) - d - 1.0


def clipped_policy_loss(logps, old_logps, advantages, mask, *, epsilon: float = 0.2,
                        epsilon_high: float | None = None, beta: float = 0.0, ref_logps=None,
                        loss_type: str = "grpo", max_completion_length: int | None = None,
                        entropies=None):
    """GRPO's clipped surrogate with an optional KL penalty (and RLOO's, with its advantages).

        ratio_t = exp(logp_t - old_logp_t)
        l_t = -min(ratio_t * A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3_t

    ``loss_type`` chooses the aggregation over tokens (TRL's names):
    - 'grpo': each sequence's token mean, then the mean over sequences (Shao et al. 2024);
    - 'bnpo': the token mean of each micro-batch, averaged over micro-batches;
    - 'dr_grpo': the token sum divided by (sequences x ``max_completion_length``) (Liu et al. 2025);
    - 'dapo': the token mean over the whole (accumulated) batch (Yu et al. 2025).
    With one optimisation iteration per generation, pass ``old_logps = stop_gradient(logps)``:
    the ratio is 1 and the gradient is the plain policy gradient.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    m = mask.astype(jnp.float32)
    adv = advantages[:, None].astype(jnp.float32)
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    tokens = m.sum()
    metrics = {}
    if beta:
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * m).sum(), tokens)
    elif ref_logps is not None:
        metrics["kl"] = ((k3_kl(logps, ref_logps) * m).sum(), tokens)
    masked = per_token * m
    rows = jnp.asarray(m.shape[0], jnp.float32)
    if loss_type == "grpo":
        total, weight = (masked.sum(-1) / jnp.maximum(m.sum(-1), 1.0)).sum(), rows
    elif loss_type == "bnpo":
        total, weight = masked.sum() / jnp.maximum(tokens, 1.0), jnp.ones((), jnp.float32)
    elif loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("dr_grpo needs max_completion_length")
        total, weight = masked.sum(), rows * max_completion_length
    else:  # dapo
        total, weight = masked.sum(), tokens
    low = ((ratio < 1.0 - eps_low) & (adv < 0)).astype(jnp.float32) * m
    high = ((ratio > 1.0 + eps_high) & (adv > 0)).astype(jnp.float32) * m
    metrics.update({
        "loss": (total, weight),
        "clip_ratio/low_mean": (low.sum(), tokens),
        "clip_ratio/high_mean": (high.sum(), tokens),
        "clip_ratio/region_mean": ((low + high).sum(), tokens),
    })
    if entropies is not None:
        metrics["entropy"] = ((entropies * m).sum(), tokens)
    return total, weight, metrics


def ppo_loss(logps, old_logps, advantages, returns, values, old_values, mask, *,
             cliprange: float = 0.2, cliprange_value: float = 0.2, vf_coef: float = 0.1,
             entropies=None):
    """PPO (Schulman et al. 2017) with a clipped value loss, as in TRL's PPOTrainer; token means
    over the (accumulated) batch.

        pg_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - c, 1 + c))
        vf_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old - c_v, V_old + c_v) - R_t)^2)
        loss = mean(pg) + vf_coef * mean(vf)
    """
    m = mask.astype(jnp.float32)
    tokens = m.sum()
    log_ratio = logps - old_logps
    ratio = jnp.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg = jnp.maximum(pg1, pg2)
    v_clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    vf1 = (values - returns) ** 2
    vf2 = (v_clipped - returns) ** 2
    vf = 0.5 * jnp.maximum(vf1, vf2)
    pg_sum, vf_sum = (pg * m).sum(), (vf * m).sum()
    total = pg_sum + vf_coef * vf_sum
    metrics = {
        "loss": (total, tokens),
        "loss/policy_avg": (pg_sum, tokens),
        "loss/value_avg": (vf_sum, tokens),
        "policy/clipfrac_avg": (((pg2 > pg1).astype(jnp.float32) * m).sum(), tokens),
        "val/clipfrac_avg": (((vf2 > vf1).astype(jnp.float32) * m).sum(), tokens),
        "policy/approxkl_avg": ((0.5 * log_ratio**2 * m).sum(), tokens),
        "val/ratio": ((ratio * m).sum(), tokens),
    }
    if entropies is not None:
        metrics["policy/entropy_avg"] = ((entropies * m).sum(), tokens)
    return total, tokens, metrics


def _std(x, axis=None, keepdims=False):
    n = x.size if axis is None else x.shape[axis]
    mean = x.mean(axis=axis, keepdims=True)
    var = ((x - mean) ** 2).sum(axis=axis, keepdims=keepdims) / max(n - 1, 1)
    return jnp.sqrt(var)
