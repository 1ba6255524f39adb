"""The online RL losses and advantages against NumPy references written from TRL's source (TRL is
not called): every GRPO loss_type of TRL 1.16 with GSPO's sequence-level ratio, two-sided
clipping, entropy masking, the bias-corrected KL and the off-policy mask; GRPO's advantages
(equal groups exactly 0, unscorable rows, GDPO's aggregation); RLOO's loss and advantages; PPO's
KL estimators and reward whitening. Each test names the TRL file and function it transcribes."""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_calls import grpo_loss, rloo_loss
from nnx_posttrain.algorithms.online import GRPO, RLOO, GRPOConfig, RLOOConfig
from nnx_posttrain.losses import rl

RNG = np.random.default_rng(3)
B, T = 6, 7
# row 4 carries no loss: a truncated completion under mask_truncated_completions (TRL zeroes its
# completion mask; it still counts as a sequence for grpo / luspo / dr_grpo)
MASK = np.array([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0],
                 [1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]], np.float32)
LOGPS = RNG.normal(-1.5, 0.5, (B, T)).astype(np.float32)
OLD = (LOGPS + RNG.normal(0, 0.35, (B, T))).astype(np.float32)  # ratios on both sides of the clip
REF = (LOGPS + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
ENT = RNG.uniform(0.1, 3.0, (B, T)).astype(np.float32)
ADV = np.array([1.2, -0.7, 0.4, -1.5, 0.9, 0.0], np.float32)


def np_sig(x):
    return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------------------------------------
# NumPy transcription of trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (TRL 1.16.0),
# one process, no accumulation, no vLLM
# ---------------------------------------------------------------------------------------------


def trl_grpo(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, delta=None,
             importance_sampling_level="token", use_bias_correction_kl=True,
             top_entropy_quantile=1.0, off_policy_mask_threshold=None, sapo_temperature_pos=1.0,
             sapo_temperature_neg=1.05, vespo=(2.0, 3.0, 3.0, 2.0), max_completion_length=T,
             old=OLD):
    lp, old, ref, ent, mask = (x.astype(np.float64) for x in (LOGPS, old, REF, ENT, MASK))
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    adv = ADV.astype(np.float64)[:, None]
    entropy_mask = None
    if top_entropy_quantile < 1.0:  # get_high_entropy_mask
        local = ent[mask > 0]
        thr = np.quantile(local, 1 - top_entropy_quantile)
        entropy_mask = ((ent * mask) >= thr) & (mask > 0)
    if off_policy_mask_threshold is not None:  # get_off_policy_mask
        kl_div = old - lp
        avg = (kl_div * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1)
        off_policy_mask = ((adv >= 0) | (avg <= off_policy_mask_threshold)).astype(np.float64)
    log_ratio = lp - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
    coef_1 = np.exp(log_w)
    if beta != 0.0:
        per_token_kl = np.exp(ref - lp) - (ref - lp) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -np.minimum(coef_1, eps_high) * adv * lp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = np.minimum(coef_1, delta)
        per_token_loss = -np.minimum(coef_1 * adv, coef_2 * adv)
    elif loss_type == "sapo":
        temps = np.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -np_sig(temps * (coef_1 - 1)) * 4 / temps * adv
    else:  # vespo, get_gamma_weights
        k_pos, lambda_pos, k_neg, lambda_neg = vespo
        seq = (np.clip(log_ratio, -20, 20) * mask).sum(-1, keepdims=True)
        log_w_seq = np.clip(seq, math.log(1e-8), 20.0)
        nonneg = adv >= 0
        k = np.where(nonneg, k_pos, k_neg)
        lam = np.maximum(np.where(nonneg, lambda_pos, lambda_neg), 1e-4)
        phi = np.exp(lam + k * log_w_seq - lam * np.exp(log_w_seq))
        per_token_loss = -phi * adv * lp
    per_token_loss = np.broadcast_to(per_token_loss, mask.shape)
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)
    elif loss_type in ("cispo", "dapo", "vespo"):
        loss = (per_token_loss * mask).sum() / max(mask.sum(), 1.0)  # num_items_in_batch
    else:  # luspo
        loss = (per_token_loss * mask).sum(-1).mean()

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / max(mask.sum(), 1.0)

    metrics = {"entropy": global_masked_mean(ent)}
    if beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = (coef_1 < 1 - eps_low) & (adv < 0)
        high = (coef_1 > 1 + eps_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = global_masked_mean(low.astype(float))
        metrics["clip_ratio/high_mean"] = global_masked_mean(high.astype(float))
        metrics["clip_ratio/region_mean"] = global_masked_mean((low | high).astype(float))
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > eps_high) & (adv > 0)).astype(float))
    else:
        if loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = global_masked_mean(phi)
    return loss, metrics


def ours(old=OLD, **kw):
    kw.setdefault("max_completion_length", T)
    return grpo_loss(jnp.asarray(LOGPS), jnp.asarray(old), jnp.asarray(ADV),
                     jnp.asarray(MASK), ref_logps=jnp.asarray(REF),
                     entropies=jnp.asarray(ENT), **kw)


def check(kw, rtol=2e-5):
    want, want_metrics = trl_grpo(**kw)
    total, weight, metrics = ours(**kw)
    assert float(total) / float(weight) == pytest.approx(want, rel=rtol, abs=1e-6)
    for name, value in want_metrics.items():
        s, c = metrics[name]
        assert float(s) / float(c) == pytest.approx(value, rel=rtol, abs=1e-6), name
    return metrics


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
@pytest.mark.parametrize("level", rl.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_every_trl_grpo_loss_type(loss_type, level, beta):
    """GRPOTrainer._compute_loss: every loss_type TRL 1.16 lists (grpo, bnpo, dr_grpo, dapo,
    cispo, sapo, luspo, vespo) at the token and the sequence (GSPO) level, with and without the
    (bias-corrected, TRL's default) KL; loss and TRL's metrics."""
    check(dict(loss_type=loss_type, importance_sampling_level=level, beta=beta,
               epsilon_high=5.0 if loss_type == "cispo" else 0.28))


def test_the_fixture_exercises_both_clips():
    ratio = np.exp(LOGPS - OLD)
    assert (((ratio < 0.8) & (ADV[:, None] < 0)) * MASK).sum() > 0
    assert (((ratio > 1.28) & (ADV[:, None] > 0)) * MASK).sum() > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_sided_delta_clipping(loss_type):
    """GRPOTrainer._compute_loss, ``if self.args.delta is not None`` (INTELLECT-2): the unclipped
    ratio capped at delta; with negative advantages a large ratio no longer grows the loss."""
    metrics = check(dict(loss_type=loss_type, delta=1.1, epsilon_high=0.05))
    assert float(ours(loss_type=loss_type, delta=1.1, epsilon_high=0.05)[0]) != pytest.approx(
        float(ours(loss_type=loss_type, epsilon_high=0.05)[0]))
    assert "clip_ratio/region_mean" in metrics


@pytest.mark.slow
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_top_entropy_quantile(quantile):
    """get_high_entropy_mask (torch.quantile, linear) applied to the policy term only; the KL
    term stays on every token."""
    check(dict(loss_type="dapo", top_entropy_quantile=quantile, beta=0.04))
    mask = np.asarray(rl.high_entropy_mask(jnp.asarray(ENT), jnp.asarray(MASK), 1 - quantile))
    kept = mask.sum()
    assert kept == max(1, round(quantile * MASK.sum())) or abs(kept - quantile * MASK.sum()) <= 1
    assert (mask <= MASK).all()
    with pytest.raises(ValueError, match="entropies"):
        grpo_loss(LOGPS, OLD, ADV, MASK, top_entropy_quantile=0.5)


def test_bias_corrected_kl_changes_the_gradient_even_on_policy():
    """use_bias_correction_kl (TRL's default True): kl * coef_1; on-policy coef_1 is 1 in value
    but differentiable, so the loss value is the same and the gradient is not."""
    lp = jnp.asarray(LOGPS)

    def f(x, corrected):
        total, weight, _ = grpo_loss(
            x, jax.lax.stop_gradient(x), ADV, MASK, beta=0.1, ref_logps=REF,
            use_bias_correction_kl=corrected)
        return total / weight

    (v1, g1), (v0, g0) = (jax.value_and_grad(f)(lp, c) for c in (True, False))
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    kl = np.exp(REF - LOGPS) - (REF - LOGPS) - 1
    np.testing.assert_allclose(np.asarray(g1 - g0), 0.1 * kl * MASK / MASK.sum(), rtol=1e-4,
                               atol=1e-7)
    check(dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=False))


def test_off_policy_mask():
    """get_off_policy_mask (DeepSeek-V3.2): negative-advantage sequences whose mean
    KL(old || current) exceeds the threshold are dropped."""
    threshold = 0.05
    check(dict(loss_type="dapo", off_policy_mask_threshold=threshold))
    # on-policy (old = current): the KL is 0 and nothing is dropped
    on = grpo_loss(LOGPS, LOGPS, ADV, MASK, off_policy_mask_threshold=threshold)
    plain = grpo_loss(LOGPS, LOGPS, ADV, MASK)
    assert float(on[0]) == pytest.approx(float(plain[0]))


def test_default_loss_type_is_trls_dapo():
    """GRPOConfig.loss_type defaults to 'dapo' in TRL 1.16, and so do ours (the loss function and
    the algorithm's config)."""
    assert GRPOConfig().loss_type == "dapo"
    default = grpo_loss(LOGPS, OLD, ADV, MASK)
    dapo = grpo_loss(LOGPS, OLD, ADV, MASK, loss_type="dapo")
    assert float(default[0]) == float(dapo[0]) and float(default[1]) == MASK.sum()


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dapo", "cispo", "vespo",
                                       "dr_grpo"])
def test_sequence_and_token_weighted_types_accumulate_exactly(loss_type):
    """Two micro-batches summed and divided give the one-batch loss (TRL's normalisations:
    sequences, num_items_in_batch tokens, or sequences x max length)."""
    kw = dict(loss_type=loss_type, max_completion_length=T, beta=0.02, ref_logps=REF,
              importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    whole = grpo_loss(LOGPS, OLD, ADV, MASK, **kw)
    parts = [grpo_loss(LOGPS[s], OLD[s], ADV[s], MASK[s], **dict(kw, ref_logps=REF[s]))
             for s in (slice(0, 2), slice(2, None))]
    total, weight = sum(float(p[0]) for p in parts), sum(float(p[1]) for p in parts)
    assert total / weight == pytest.approx(float(whole[0]) / float(whole[1]), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# GRPO's advantages: GRPOTrainer._generate_and_score_completions (TRL 1.16.0)
# ---------------------------------------------------------------------------------------------


def np_nanstd(x, axis=None, keepdims=False):  # trl/trainer/utils.py, nanstd
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        var = var * np.where(count > 1, count / (count - 1), np.nan)
    std = np.sqrt(var)
    return std if keepdims else np.squeeze(std, axis=axis)


def trl_grpo_advantages(per_func, weights, g, scale_rewards="group",
                        aggregation="sum_then_normalize"):
    per_func = np.asarray(per_func, np.float64)
    w = np.asarray(weights, np.float64)
    unscorable = np.isnan(per_func).all(axis=1)
    with np.errstate(invalid="ignore"):
        if aggregation == "sum_then_normalize":
            rewards = np.nansum(per_func * w[None], axis=1)
            rewards[unscorable] = np.nan
            mean = np.repeat(np.nanmean(rewards.reshape(-1, g), axis=1), g)
            if scale_rewards in ("group", "none"):
                std = np.repeat(np_nanstd(rewards.reshape(-1, g), axis=1), g)
            else:
                std = np.broadcast_to(np_nanstd(rewards), rewards.shape)
            adv = rewards - mean
            if scale_rewards != "none":
                adv = adv / (std + 1e-4)
        else:
            grouped = per_func.reshape(-1, g, per_func.shape[1])
            mean_k = np.nanmean(grouped, axis=1, keepdims=True)
            std_k = np_nanstd(grouped, axis=1, keepdims=True)
            reward_k = ((grouped - mean_k) / (std_k + 1e-4)).reshape(-1, per_func.shape[1])
            rewards = np.nansum(reward_k * w[None], axis=1)
            rewards[unscorable] = np.nan
            adv = (rewards - np.nanmean(rewards)) / (np_nanstd(rewards) + 1e-4)
    return np.nan_to_num(adv, nan=0.0)


def grpo_algorithm(**cfg):
    return GRPO(GRPOConfig(**{"rewards": "exact_match", **cfg}), 8)


def rollouts(per_func, weights):
    return SimpleNamespace(rewards_per_func=np.asarray(per_func, np.float32),
                           reward_weights=np.asarray(weights, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("value", [0.7, 3.3, 1000.1, 1 / 3, -2.2e-3, 7.0])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_groups_have_exactly_zero_advantage(value, scale):
    """The bug: float32 group means of non-dyadic rewards are not exact on XLA:CPU and the
    division by std + 1e-4 magnified the residue (8 x 1000.1 gave advantages up to 0.37). TRL
    gives exactly 0; so must every group size."""
    for g in range(2, 17):
        adv = np.asarray(rl.group_advantages(np.full(3 * g, value, np.float32), g, scale))
        assert (adv == 0.0).all(), (g, np.abs(adv).max())
    # an equal group next to an unequal one: still exactly 0, the other one unchanged
    r = np.array([value] * 8 + [0.0, 1.0, 0.5, 0.25, 0.0, 1.0, 1.0, 0.0], np.float32)
    adv = np.asarray(rl.group_advantages(r, 8, scale))
    assert (adv[:8] == 0.0).all()
    want = trl_grpo_advantages(r[:, None], [1.0], 8, scale)
    np.testing.assert_allclose(adv[8:], want[8:], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_grpo_advantages_match_trl(scale, aggregation):
    """Two reward functions with weights, non-dyadic values, a function that returned None for
    some rows, and a row no function scored (TRL: excluded from the group statistics,
    advantage 0)."""
    per_func = np.array([[0.3, 1.0], [0.9, np.nan], [0.1, 0.0], [0.7, 1.0],
                         [np.nan, np.nan], [0.2, 0.0], [0.55, 1.0], [0.2, 0.0]], np.float32)
    weights = [1.0, 0.4]
    algo = grpo_algorithm(num_generations=4, scale_rewards=scale,
                          multi_objective_aggregation=aggregation)
    adv = np.asarray(algo.advantages(rollouts(per_func, weights)))
    want = trl_grpo_advantages(per_func, weights, 4, scale, aggregation)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert adv[4] == 0.0


# ---------------------------------------------------------------------------------------------
# RLOO: trl/trainer/rloo_trainer.py, RLOOTrainer (TRL 1.16.0)
# ---------------------------------------------------------------------------------------------


def trl_rloo_advantages(rewards, g, normalize=False, clip=None, kl=None, beta=0.0):
    """_generate_and_score_completions: reward clipping, the KL penalty in the reward, the
    NaN-aware leave-one-out baseline, normalize_advantages, nan_to_num."""
    rewards = np.asarray(rewards, np.float64).copy()
    if clip:
        rewards = np.clip(rewards, clip[0], clip[1])
    if kl is not None:
        rewards = rewards - beta * kl
    grouped = rewards.reshape(-1, g)
    with np.errstate(invalid="ignore", divide="ignore"):
        counts = (~np.isnan(grouped)).sum(1, keepdims=True)
        baselines = ((np.nansum(grouped, 1, keepdims=True) - grouped) / (counts - 1)).reshape(-1)
        adv = rewards - baselines
        if normalize:
            adv = (adv - np.nanmean(adv)) / (np_nanstd(adv) + 1e-4)
    return np.nan_to_num(adv, nan=0.0)


def trl_rloo_loss(logps, old_logps, adv, mask, eps_low=0.2, eps_high=0.2):
    """RLOOTrainer._compute_loss."""
    lp = (logps.astype(np.float64) * mask).sum(1)
    old = (old_logps.astype(np.float64) * mask).sum(1)
    coef_1 = np.exp(lp - old)
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_seq = -np.minimum(coef_1 * adv, coef_2 * adv)
    low = (coef_1 < 1 - eps_low) & (adv < 0)
    high = (coef_1 > 1 + eps_high) & (adv > 0)
    return per_seq.mean(), {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean(),
                            "clip_ratio/region_mean": (low | high).mean(),
                            "entropy": (ENT * mask).sum() / mask.sum()}


@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_rloo_loss_is_trls_sequence_level_loss(eps_high):
    """One ratio per sequence, exp(sum logp - sum old_logp), clipped, mean over sequences; the
    old per-token (GRPO) loss differs whenever lengths differ."""
    old = (LOGPS + RNG.normal(0, 0.15, (B, T))).astype(np.float32)
    total, weight, metrics = rloo_loss(LOGPS, old, ADV, MASK, epsilon_high=eps_high,
                                       entropies=ENT)
    want, want_metrics = trl_rloo_loss(LOGPS, old, ADV, MASK, 0.2, eps_high or 0.2)
    assert float(weight) == B
    assert float(total / weight) == pytest.approx(want, rel=1e-5)
    for name, value in want_metrics.items():
        assert float(metrics[name][0] / metrics[name][1]) == pytest.approx(value, rel=1e-5), name
    grpo = grpo_loss(LOGPS, old, ADV, MASK, epsilon_high=eps_high)
    assert abs(float(grpo[0] / grpo[1]) - want) > 1e-3


@pytest.mark.slow
def test_rloo_loss_by_hand():
    """Before / after (the report's hand example): two completions of 1 and 3 tokens, A = (1,
    -1), on-policy. TRL's RLOO loss is the mean over sequences of -A: 0; the GRPO-inherited
    dapo loss was the token mean (-1 * 1 + 1 * 3) / 4 = 0.5."""
    logps = jnp.array([[-0.5, 0.0, 0.0], [-0.2, -0.3, -0.4]])
    mask = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = jnp.array([1.0, -1.0])
    total, weight, _ = rloo_loss(logps, logps, adv, mask)
    assert float(total / weight) == 0.0
    total, weight, _ = grpo_loss(logps, logps, adv, mask, loss_type="dapo")
    assert float(total / weight) == pytest.approx(0.5)
    # the gradient: each sequence's summed log-prob weighted by -A / 2
    g = jax.grad(lambda x: rloo_loss(x, jax.lax.stop_gradient(x), adv, mask)[0] / 2)(logps)
    np.testing.assert_allclose(g, -np.array([[1.0, 0, 0], [-1, -1, -1]]) / 2)


def test_rloo_loss_clips_the_sequence_ratio_with_several_iterations():
    # log-ratio +0.5 summed over 2 tokens: w = e^1 > 1.2 and A > 0: clipped to 1.2
    logps, old = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, -1.5]])
    total, weight, m = rloo_loss(logps, old, jnp.array([2.0]), jnp.ones((1, 2)))
    assert float(total / weight) == pytest.approx(-2.4)
    assert float(m["clip_ratio/high_mean"][0]) == 1.0


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("clip", [None, (-0.5, 0.8)])
def test_rloo_advantages_match_trl(normalize, clip):
    """RLOOTrainer._generate_and_score_completions through the algorithm's make_batch: reward
    clipping, the KL penalty (sum over tokens of old - ref), leave-one-out, normalization by
    std + 1e-4 (not rsqrt(var + 1e-8)), unscorable rows 0; the logged kl is the token mean."""
    per_func = np.array([[0.3], [1.7], [np.nan], [-0.9], [0.25], [0.25], [0.25], [1.0]], np.float32)
    mask = MASK[[0, 1, 2, 3, 5, 0, 1, 3]]
    old, ref = LOGPS[[0, 1, 2, 3, 5, 0, 1, 3]], REF[[0, 1, 2, 3, 5, 0, 1, 3]]
    algo = RLOO(RLOOConfig(rewards="exact_match", num_generations=4, beta=0.1, normalize_advantages=normalize,
                           reward_clip_range=clip), 8)
    algo.reference_mode = "copy"
    fake = SimpleNamespace(rewards_per_func=per_func, reward_weights=np.ones(1, np.float32),
                           logps=lambda batch, state, with_old, with_ref: {"old_logps": old,
                                                                           "ref_logps": ref})
    batch, metrics = algo.make_batch({"loss_mask": mask}, None, None, fake, None)
    kl = ((old - ref) * mask).sum(1)
    want = trl_rloo_advantages(per_func[:, 0], 4, normalize, clip, kl, beta=0.1)
    np.testing.assert_allclose(batch["advantages"], want, rtol=1e-5, atol=1e-6)
    assert batch["advantages"][2] == 0.0
    assert metrics["kl"] == pytest.approx(((old - ref) * mask).sum() / mask.sum(), rel=1e-5)


@pytest.mark.slow
def test_leave_one_out_by_hand_and_equal_groups():
    # k = 3: baseline of the first = (2 + 4) / 2 = 3 -> 1 - 3 = -2
    np.testing.assert_allclose(rl.leave_one_out_advantages([1.0, 2.0, 4.0], 3),
                               [1 - 3, 2 - 2.5, 4 - 1.5])
    for g in range(2, 17):
        assert (np.asarray(rl.leave_one_out_advantages([1000.1] * g, g)) == 0).all()


# ---------------------------------------------------------------------------------------------
# PPO: trl/experimental/ppo/ppo_trainer.py, PPOTrainer.train (TRL 0.2x; not in TRL 1.16)
# ---------------------------------------------------------------------------------------------


def trl_masked_whiten(values, mask, shift_mean=True):  # masked_mean / masked_var / masked_whiten
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    out = (values - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


@pytest.mark.parametrize("estimator", rl.KL_ESTIMATORS)
@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_ppo_rewards_kl_estimators_and_whitening(estimator, whiten_rewards):
    """PPOTrainer.train, "4. compute rewards" / "5. whiten rewards": kl = -logr (k1) or
    (exp(logr) - 1) - logr (k3), logr = ref - logp; rewards = -kl_coef * kl plus the score;
    masked_whiten(rewards, shift_mean=False) then zeroed outside the mask. (The score sits on the
    last completion token here; see ``losses.rl.ppo_rewards``.)"""
    scores = np.array([1.0, -0.5, 2.0, 0.0, 0.3, 1.5], np.float32)
    rewards, kl = (np.asarray(x) for x in rl.ppo_rewards(
        scores, LOGPS, REF, MASK, rl.PPOOptions(kl_coef=0.05, kl_estimator=estimator)))
    logr = REF.astype(np.float64) - LOGPS
    want_kl = (-logr if estimator == "k1" else (np.exp(logr) - 1) - logr) * MASK
    want = -0.05 * want_kl
    for i in range(B):
        if MASK[i].sum():
            want[i, np.flatnonzero(MASK[i])[-1]] += scores[i]
    np.testing.assert_allclose(kl, want_kl, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(rewards, want, rtol=1e-5, atol=1e-6)
    if estimator == "k3":
        assert (kl >= 0).all()
    if whiten_rewards:
        ours_w = np.asarray(rl.whiten(jnp.asarray(rewards), jnp.asarray(MASK), shift_mean=False))
        np.testing.assert_allclose(ours_w * MASK, trl_masked_whiten(want, MASK, False) * MASK,
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="kl_estimator"):
        rl.kl_penalty(LOGPS, REF, "k2")
    with pytest.raises(ValueError, match="--algo.kl-estimator must be one of k1, k3, got 'k2'"):
        rl.PPOOptions(kl_estimator="k2")
