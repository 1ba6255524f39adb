"""Online RL advantages, whitening, GAE, and PPO's options, rewards and loss: pure functions of
arrays. No model, no I/O. The GRPO-family policy losses and their options are in :mod:`.grpo`,
RLOO's in :mod:`.rloo` (both re-exported here).

Shapes: ``B`` completions (``num_generations`` consecutive rows per prompt), ``T`` positions.
Per-token arrays (``logps``, ``old_logps``, ``ref_logps``, ``mask``) are aligned as
``model.token_logprobs`` returns them (position t holds log p(x_t | x_<t)); ``mask`` is 1 on the
completion tokens that carry loss. Losses return ``(total, weight, metrics)`` as every loss of
:mod:`nnx_posttrain.losses` (see :mod:`nnx_posttrain.losses.common`).

Definitions follow TRL 1.16's GRPOTrainer / RLOOTrainer (``trl/trainer/grpo_trainer.py``,
``rloo_trainer.py``) and TRL's last PPOTrainer (``trl/experimental/ppo/ppo_trainer.py``, TRL
0.2x; TRL 1.16 ships no PPO trainer), so metrics are comparable.

Rewards may be NaN: a completion that every reward function declined to score (TRL's
"unscorable" rows, all functions returned None). NaN rewards are left out of the group
statistics and get advantage 0, as TRL.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import Options, flag
from nnx_posttrain.losses.grpo import (  # noqa: F401  (re-exported: the RL losses in one place)
    AGGREGATIONS,
    GRPO_LOSSES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    SCALE_REWARDS,
    GRPOOptions,
    PolicyInputs,
    clipped_policy_loss,
    high_entropy_mask,
    k3_kl,
)
from nnx_posttrain.losses.rloo import RLOOOptions, rloo_loss  # noqa: F401  (re-exported)

KL_ESTIMATORS = ("k1", "k3")


# ----------------------------------------------------------------------------- NaN-aware stats


def _nanmean(x, axis=None, keepdims=False):
    finite = ~jnp.isnan(x)
    n = finite.sum(axis=axis, keepdims=keepdims)
    return jnp.where(finite, x, 0.0).sum(axis=axis, keepdims=keepdims) / jnp.where(n > 0, n, 1)


def _nanstd(x, axis=None, keepdims=False):
    """Unbiased standard deviation ignoring NaNs; NaN with fewer than 2 values (TRL's ``nanstd``,
    ``trl/trainer/utils.py``)."""
    finite = ~jnp.isnan(x)
    n = finite.sum(axis=axis, keepdims=True).astype(jnp.float32)
    mean = _nanmean(x, axis=axis, keepdims=True)
    sq = jnp.where(finite, (x - mean) ** 2, 0.0).sum(axis=axis, keepdims=True)
    std = jnp.where(n > 1, jnp.sqrt(sq / jnp.maximum(n - 1.0, 1.0)), jnp.nan)
    return std if keepdims else (std.reshape(()) if axis is None else std.squeeze(axis))


def _shifted(r, axis=None):
    """``r`` minus one of its own (finite) values, per ``axis``: the statistics below are computed
    on the shifted values, so a group of equal rewards is exactly 0 before any mean is taken (a
    float32 mean of 8 copies of 1000.1 is not 1000.1, and dividing the residue by a std of ~0
    turned it into advantages of up to 0.5). Shifting changes neither the centred values nor
    the standard deviation."""
    shift = jnp.nanmin(r, axis=axis, keepdims=True)
    return r - jnp.where(jnp.isnan(shift), 0.0, shift)


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size: int, scale_rewards: str, eps: float = 1e-4):
    """GRPO group-relative advantages (Shao et al., "DeepSeekMath", arXiv:2402.03300, eq. 3).

        A_i = (r_i - mean(r_group)) / (std + eps)

    ``scale_rewards``: 'group' divides by the group's standard deviation, 'batch' by the whole
    batch's (PPO Lite, arXiv:2508.08221), 'none' does not divide (Dr. GRPO, Liu et al.,
    arXiv:2503.20783). Standard deviations are unbiased (n - 1), as torch's; eps = 1e-4 as TRL
    (``GRPOTrainer._generate_and_score_completions``, ``multi_objective_aggregation=
    "sum_then_normalize"``). A group whose rewards are all equal gets advantage exactly 0, for
    any values and group sizes (see ``_shifted``); NaN rewards (unscorable completions) are left
    out of the mean and std and get 0. ``scale_rewards`` is one of ``SCALE_REWARDS``
    (``GRPOOptions`` checks it).
    """
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    d = _shifted(r, axis=1)
    centred = d - _nanmean(d, axis=1, keepdims=True)
    if scale_rewards == "group":
        centred = centred / (_nanstd(d, axis=1, keepdims=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (_nanstd(_shifted(r)) + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    # an equal group is exactly 0 above; a group with a single scored completion has NaN std
    return jnp.nan_to_num(centred.reshape(-1), nan=0.0)


def normalize_then_sum_advantages(rewards_per_func, weights, group_size: int, eps: float = 1e-4):
    """GDPO's multi-reward advantages (TRL's ``multi_objective_aggregation="normalize_then_sum"``;
    "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
    Optimization", arXiv:2601.05242):

        z_ik = (r_ik - mean_group(r_k)) / (std_group(r_k) + eps)      per reward function k
        s_i  = sum_k w_k z_ik                                           (NaN-ignoring)
        A_i  = (s_i - mean_batch(s)) / (std_batch(s) + eps)

    ``rewards_per_func`` [B, K] (NaN where a function returned None), ``weights`` [K]. A row that
    every function left unscored gets advantage 0 (TRL's ``unscorable_mask``).
    """
    r = jnp.asarray(rewards_per_func, jnp.float32)
    k = r.shape[1]
    grouped = r.reshape(-1, group_size, k)
    d = _shifted(grouped, axis=1)
    std = (_nanstd(d, axis=1, keepdims=True) if group_size > 1
           else jnp.zeros_like(d[:, :1]))
    z = ((d - _nanmean(d, axis=1, keepdims=True)) / (std + eps)).reshape(-1, k)
    w = jnp.asarray(weights, jnp.float32)[None, :]
    s = jnp.where(jnp.isnan(z), 0.0, z * w).sum(axis=1)
    s = jnp.where(jnp.isnan(r).all(axis=1), jnp.nan, s)
    ds = _shifted(s)
    adv = (ds - _nanmean(ds)) / (_nanstd(ds) + eps)
    return jnp.nan_to_num(adv, nan=0.0)


def leave_one_out_advantages(rewards, group_size: int, nan_to_zero: bool = True):
    """RLOO ("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", Ahmadian et al., arXiv:2402.14740, eq. 6; Kool et al. 2019): each
    completion's baseline is the mean reward of the *other* completions of its prompt.

        A_i = r_i - (sum_j r_j - r_i) / (k - 1)

    As TRL 1.16 (``RLOOTrainer._generate_and_score_completions``): NaN rewards (unscorable) are
    left out of the sums and the count k, and get advantage 0, as does a completion without a
    scored sibling (``nan_to_zero=False`` leaves those NaN, for :func:`normalize_advantages`).
    """
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 generations per prompt")
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    scored = (~jnp.isnan(r)).sum(axis=1, keepdims=True).astype(jnp.float32)
    d = _shifted(r, axis=1)  # equal rewards give exactly 0, as for GRPO
    total = jnp.where(jnp.isnan(d), 0.0, d).sum(axis=1, keepdims=True)
    baseline = (total - d) / (scored - 1.0)
    adv = jnp.where(jnp.isfinite(baseline), d - baseline, jnp.nan).reshape(-1)
    return jnp.nan_to_num(adv, nan=0.0) if nan_to_zero else adv


def normalize_advantages(advantages, eps: float = 1e-4):
    """RLOO's ``normalize_advantages``: (A - mean) / (std + 1e-4) over the batch (unbiased std,
    NaN-ignoring), as TRL 1.16's RLOOTrainer."""
    a = jnp.asarray(advantages, jnp.float32)
    d = _shifted(a)
    return jnp.nan_to_num((d - _nanmean(d)) / (_nanstd(d) + eps), nan=0.0)


def whiten(values, mask=None, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) * rsqrt(var + eps) over the entries where ``mask`` is 1 (all when None);
    unbiased variance. ``shift_mean=False`` adds the mean back (only the scale changes). TRL's
    ``masked_whiten`` (PPO: advantages, and rewards with ``whiten_rewards``)."""
    x = jnp.asarray(values, jnp.float32)
    m = jnp.ones_like(x) if mask is None else mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / jnp.maximum(n - 1.0, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    return out if shift_mean else out + mean


def kl_penalty(logps, ref_logps, estimator: str):
    """Per-token KL(pi || ref) estimate of PPO's reward penalty (Schulman, "Approximating KL
    Divergence", http://joschu.net/blog/kl-approx.html), as TRL's PPOTrainer ``kl_estimator``:

        k1 = log pi - log pi_ref                       unbiased, can be negative
        k3 = (r - 1) - log r,  r = pi_ref / pi         unbiased, >= 0, lower variance
    """
    logr = ref_logps - logps
    if estimator == "k1":
        return -logr
    if estimator == "k3":
        return jnp.expm1(logr) - logr
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def ppo_rewards(scores, logps, ref_logps, mask, options: PPOOptions):
    """PPO's per-token rewards (Ziegler et al., arXiv:1909.08593; TRL's ``PPOTrainer.train``,
    "4. compute rewards"): -kl_coef * kl_t on every completion token (``kl_estimator``), plus
    the sequence's score on its last completion token (TRL puts it one position later, on the
    first padding position, which ``whiten_rewards`` then also covers; here the score sits on the
    last token the policy produced and whitening covers the completion tokens). ``ref_logps``
    None: no KL. Returns (rewards [B, T], kl [B, T] masked)."""
    m = jnp.asarray(mask, jnp.float32)
    if ref_logps is None:
        kl = jnp.zeros_like(m)
    else:
        kl = kl_penalty(jnp.asarray(logps, jnp.float32), jnp.asarray(ref_logps, jnp.float32),
                        options.kl_estimator) * m
    rewards = -options.kl_coef * kl
    width = m.shape[1]
    last = jnp.maximum(width - 1 - jnp.argmax(m[:, ::-1], axis=1), 0)
    score = jnp.asarray(scores, jnp.float32) * (m.sum(axis=1) > 0)
    rewards = rewards.at[jnp.arange(m.shape[0]), last].add(score)
    return rewards, kl


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438) over the masked
    positions.

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


# ----------------------------------------------------------------------------- PPO


@dataclasses.dataclass(frozen=True)
class PPOOptions(Options):
    """PPO's options: the names and defaults of TRL's last PPOConfig (``--algo.*`` of ``ppo``,
    with the sampling options of every online algorithm)."""

    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    kl_coef: float = 0.05
    """Per-token KL penalty in the reward."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimate in the reward: k1 = log pi - log pi_ref, k3 = (r - 1) - log r (r = pi_ref / pi; >= 0, lower variance)."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (scale only, the mean kept) over the completion tokens before GAE."""
    whiten_advantages: bool = True
    missing_eos_penalty: float | None = None
    """Subtracted from the score of a completion with no stop token."""

    def problems(self) -> list[str]:
        if self.kl_estimator not in KL_ESTIMATORS:
            return [f"{flag('kl_estimator')} must be one of {', '.join(KL_ESTIMATORS)}, got "
                    f"{self.kl_estimator!r}"]
        return []


class PPOInputs(NamedTuple):
    """The arrays of :func:`ppo_loss`, ``[B, T]``: the policy's log-probs and values, those of the
    policy that generated the rollout (``old_*``), GAE's advantages and returns, the loss mask,
    the policy's entropies (None: no entropy metric)."""

    logps: jax.Array
    old_logps: jax.Array
    advantages: jax.Array
    returns: jax.Array
    values: jax.Array
    old_values: jax.Array
    mask: jax.Array
    entropies: jax.Array | None = None


def ppo_loss(inputs: PPOInputs, options: PPOOptions):
    """PPO (Schulman et al., arXiv:1707.06347) with a clipped value loss, as TRL's PPOTrainer
    (``PPOTrainer.train``); token means over the (accumulated) batch (c = ``cliprange``, c_v =
    ``cliprange_value``).

        pg_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - c, 1 + c))
        vf_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old - c_v, V_old + c_v) - R_t)^2)
        loss = mean(pg) + vf_coef * mean(vf)
    """
    x, c, c_v = inputs, options.cliprange, options.cliprange_value
    m = x.mask.astype(jnp.float32)
    tokens = m.sum()
    log_ratio = x.logps - x.old_logps
    ratio = jnp.exp(log_ratio)
    pg1 = -x.advantages * ratio
    pg2 = -x.advantages * jnp.clip(ratio, 1.0 - c, 1.0 + c)
    pg = jnp.maximum(pg1, pg2)
    v_clipped = jnp.clip(x.values, x.old_values - c_v, x.old_values + c_v)
    vf1 = (x.values - x.returns) ** 2
    vf2 = (v_clipped - x.returns) ** 2
    vf = 0.5 * jnp.maximum(vf1, vf2)
    pg_sum, vf_sum = (pg * m).sum(), (vf * m).sum()
    total = pg_sum + options.vf_coef * vf_sum
    metrics = {
        "loss": (total, tokens),
        "loss/policy_avg": (pg_sum, tokens),
        "loss/value_avg": (vf_sum, tokens),
        "policy/clipfrac_avg": (((pg2 > pg1).astype(jnp.float32) * m).sum(), tokens),
        "val/clipfrac_avg": (((vf2 > vf1).astype(jnp.float32) * m).sum(), tokens),
        "policy/approxkl_avg": ((0.5 * log_ratio**2 * m).sum(), tokens),
        "val/ratio": ((ratio * m).sum(), tokens),
    }
    if x.entropies is not None:
        metrics["policy/entropy_avg"] = ((x.entropies * m).sum(), tokens)
    return total, tokens, metrics
