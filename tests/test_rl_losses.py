"""Online RL losses and advantages against hand-computed values and plain NumPy versions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_calls import grpo_loss, rloo_loss
from nnx_posttrain.losses import rl


def test_group_advantages_by_hand():
    # one group of 4: mean 0.5, unbiased std sqrt(1/3)
    adv = np.asarray(rl.group_advantages([1.0, 0.0, 1.0, 0.0], 4, "group"))
    std = np.sqrt(1 / 3)
    np.testing.assert_allclose(adv, np.array([0.5, -0.5, 0.5, -0.5]) / (std + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(rl.group_advantages([1.0, 0.0, 1.0, 0.0], 4, "none"),
                               [0.5, -0.5, 0.5, -0.5])


@pytest.mark.slow
def test_group_with_equal_rewards_has_zero_advantage_and_no_nan():
    r = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    for scale in ("group", "batch", "none"):
        adv = np.asarray(rl.group_advantages(r, 3, scale))
        assert np.isfinite(adv).all()
        np.testing.assert_allclose(adv[:3], 0.0)
    # a batch whose rewards are all equal: zero, not NaN, under batch scaling too
    np.testing.assert_array_equal(rl.group_advantages([2.0] * 4, 2, "batch"), np.zeros(4))


def test_batch_scaling_uses_the_batch_std():
    r = np.array([3.0, 1.0, 0.0, 0.0])
    adv = np.asarray(rl.group_advantages(r, 2, "batch"))
    expected = (r - np.repeat(r.reshape(2, 2).mean(1), 2)) / (r.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_leave_one_out():
    # k = 3: baseline of the first = (2 + 4) / 2 = 3 -> 1 - 3 = -2
    np.testing.assert_allclose(rl.leave_one_out_advantages([1.0, 2.0, 4.0], 3),
                               [1 - 3, 2 - 2.5, 4 - 1.5])
    # an unscorable (NaN) completion: left out of its siblings' baselines, advantage 0
    np.testing.assert_allclose(rl.leave_one_out_advantages([1.0, np.nan, 3.0], 3), [-2.0, 0, 2.0])
    with pytest.raises(ValueError):
        rl.leave_one_out_advantages([1.0, 2.0], 1)


def _np_clipped(logps, old, adv, mask, eps_low, eps_high, beta, ref, loss_type, max_len):
    ratio = np.exp(logps - old)
    a = adv[:, None]
    per = -np.minimum(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    if beta:
        per = per + beta * (np.exp(ref - logps) - (ref - logps) - 1)
    m = mask
    if loss_type == "grpo":
        return np.mean((per * m).sum(1) / np.maximum(m.sum(1), 1))
    if loss_type == "bnpo" or loss_type == "dapo":
        return (per * m).sum() / m.sum()
    return (per * m).sum() / (m.shape[0] * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_clipped_policy_loss_matches_numpy(loss_type, beta):
    """The four classic aggregations with the plain k3 KL (``use_bias_correction_kl=False``; TRL's
    default, the corrected KL, and every other loss type: tests/test_trl_rl.py)."""
    rng = np.random.default_rng(0)
    B, T = 4, 6
    logps = rng.normal(-2, 0.5, (B, T)).astype(np.float32)
    old = logps + rng.normal(0, 0.6, (B, T)).astype(np.float32)  # ratios both sides of the clip
    ref = logps + rng.normal(0, 0.2, (B, T)).astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, -2.0], np.float32)
    mask = np.array([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0],
                     [0, 0, 1, 1, 0, 0]], np.float32)
    total, weight, metrics = grpo_loss(
        logps, old, adv, mask, epsilon=0.2, epsilon_high=0.28, beta=beta, ref_logps=ref,
        loss_type=loss_type, max_completion_length=4, use_bias_correction_kl=False)
    want = _np_clipped(logps, old, adv, mask, 0.2, 0.28, beta, ref, loss_type, 4)
    np.testing.assert_allclose(float(total / weight), want, rtol=1e-5)
    s, c = metrics["loss"]
    np.testing.assert_allclose(float(s / c), want, rtol=1e-5)
    kl = (np.exp(ref - logps) - (ref - logps) - 1)
    np.testing.assert_allclose(float(metrics["kl"][0] / metrics["kl"][1]),
                               (kl * mask).sum() / mask.sum(), rtol=1e-5)
    ratio = np.exp(logps - old)
    low = ((ratio < 0.8) & (adv[:, None] < 0)) * mask
    high = ((ratio > 1.28) & (adv[:, None] > 0)) * mask
    assert low.sum() > 0 and high.sum() > 0  # the fixture exercises both clips
    np.testing.assert_allclose(float(metrics["clip_ratio/low_mean"][0]), low.sum())
    np.testing.assert_allclose(float(metrics["clip_ratio/high_mean"][0]), high.sum())
    np.testing.assert_allclose(float(metrics["clip_ratio/region_mean"][0]), low.sum() + high.sum())


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_clip_ratios_of_one_token_completions_count_tokens_not_rows(loss_type):
    """Completions of length 1 give a [B, 1] token-level weight: the clip ratios still count the
    masked tokens (an empty completion counts nowhere), as at any length; the level comes from
    ``importance_sampling_level``, never from the shape."""
    logps = np.log(np.array([[0.5], [0.5], [0.5], [0.5]], np.float32))
    old = np.log(np.array([[0.2], [0.2], [0.9], [0.2]], np.float32))  # ratios 2.5, 2.5, 0.56, 2.5
    adv = np.array([1.0, 1.0, -1.0, 1.0], np.float32)
    mask = np.array([[1], [1], [1], [0]], np.float32)  # the last completion is empty
    _, _, token = grpo_loss(logps, old, adv, mask, epsilon=0.2, loss_type=loss_type)
    name = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/high_mean"
    # clipped high: rows 0 and 1, of the 3 tokens (row 3 has none)
    assert (float(token[name][0]), float(token[name][1])) == (2.0, 3.0)
    if loss_type == "grpo":
        assert float(token["clip_ratio/low_mean"][0]) == 1.0
        _, _, seq = grpo_loss(logps, old, adv, mask, epsilon=0.2,
                              importance_sampling_level="sequence")
        # sequence level: every row counts once, an empty one too (its weight is 1: not clipped)
        assert (float(seq["clip_ratio/high_mean"][0]), float(seq["clip_ratio/high_mean"][1])) == (
            2.0, 4.0)


def test_loss_types_accumulate_over_micro_batches_as_documented():
    """dapo over two micro-batches == token mean of the whole batch; bnpo == mean of the two
    micro-batch token means (TRL's per-micro-batch normalisation)."""
    rng = np.random.default_rng(1)
    logps = rng.normal(-1, 0.3, (4, 5)).astype(np.float32)
    adv = np.array([1.0, -1.0, 2.0, 0.5], np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], np.float32)
    per = -(adv[:, None]) * mask  # ratio 1
    parts = [grpo_loss(logps[i:i + 2], logps[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                       loss_type=t) for i in (0, 2) for t in ("dapo",)]
    dapo = sum(float(p[0]) for p in parts) / sum(float(p[1]) for p in parts)
    np.testing.assert_allclose(dapo, per.sum() / mask.sum(), rtol=1e-6)
    parts = [grpo_loss(logps[i:i + 2], logps[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                       loss_type="bnpo") for i in (0, 2)]
    bnpo = sum(float(p[0]) for p in parts) / sum(float(p[1]) for p in parts)
    want = np.mean([per[i:i + 2].sum() / mask[i:i + 2].sum() for i in (0, 2)])
    np.testing.assert_allclose(bnpo, want, rtol=1e-6)


def test_policy_gradient_with_one_iteration_is_reinforce():
    """old = stop_gradient(logps): the loss value is -mean(A) and the gradient is -A * dlogp."""
    logps = jnp.array([[-1.0, -2.0], [-0.5, -1.5]])
    adv = jnp.array([1.0, -2.0])
    mask = jnp.ones((2, 2))

    def f(lp):
        total, weight, _ = grpo_loss(lp, jax.lax.stop_gradient(lp), adv, mask,
                                     loss_type="dapo")
        return total / weight

    value, grad = jax.value_and_grad(f)(logps)
    np.testing.assert_allclose(value, -(1.0 * 2 - 2.0 * 2) / 4)
    np.testing.assert_allclose(grad, -np.array([[1.0, 1.0], [-2.0, -2.0]]) / 4)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_extreme_ratios_and_zero_masks_stay_finite(level):
    logps = jnp.array([[-1e-3, -80.0, 0.0]])
    old = jnp.array([[-60.0, -1e-3, 0.0]])
    masks = (jnp.ones((1, 3)), jnp.zeros((1, 3)))
    for loss_type in rl.LOSS_TYPES:
        def f(lp, mask):
            t, w, _ = grpo_loss(lp, old, jnp.array([1.5]), mask, beta=0.1,
                                ref_logps=old, loss_type=loss_type,
                                max_completion_length=3, delta=2.0,
                                importance_sampling_level=level,
                                top_entropy_quantile=0.5,
                                entropies=jnp.ones((1, 3)))
            return t / jnp.maximum(w, 1e-9)  # as the training step divides
        step = jax.jit(jax.value_and_grad(f))  # as the training step runs it: one program
        for mask in masks:
            value, grad = step(logps, mask)
            assert np.isfinite(value) and np.isfinite(np.asarray(grad)).all(), loss_type
    # RLOO's sequence ratio of a 3-token sum of +-80 log-ratios
    step = jax.jit(jax.value_and_grad(lambda lp, mask: rloo_loss(lp, old, jnp.array([1.5]), mask)[0]))
    for mask in masks:
        value, grad = step(logps, mask)
        assert np.isfinite(value) and np.isfinite(np.asarray(grad)).all()


def test_k3_is_nonnegative_and_zero_at_equality():
    lp = jnp.array([-3.0, -1.0, -0.1])
    np.testing.assert_allclose(rl.k3_kl(lp, lp), 0.0)
    assert (np.asarray(rl.k3_kl(lp, lp + jnp.array([0.5, -0.5, 2.0]))) > 0).all()


def _np_gae(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        idx = np.flatnonzero(mask[b])
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = values[b, idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, adv + values * mask


def test_gae_matches_the_textbook_recursion():
    rng = np.random.default_rng(2)
    rewards = rng.normal(size=(3, 6)).astype(np.float32)
    values = rng.normal(size=(3, 6)).astype(np.float32)
    mask = np.array([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], np.float32)
    adv, ret = rl.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 0.9, 0.8)
    want_adv, want_ret = _np_gae(rewards * mask, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-6)
    # gamma = lam = 1, zero values: the advantage is the reward-to-go
    adv, _ = rl.gae(jnp.asarray(rewards), jnp.zeros_like(values), jnp.asarray(mask), 1.0, 1.0)
    togo = np.cumsum((rewards * mask)[:, ::-1], axis=1)[:, ::-1] * mask
    np.testing.assert_allclose(adv, togo, rtol=1e-5, atol=1e-6)


def test_ppo_loss_by_hand():
    # one token, A = 1, ratio e^0.5 > 1.2: clipped -> pg = -1.2; value 2 vs return 0, old value
    # 1 clipped to 1.2: vf = 0.5 * max(4, 1.44) = 2
    logps, old = jnp.array([[0.0, -0.5]]), jnp.array([[0.0, -1.0]])
    mask = jnp.array([[0.0, 1.0]])
    total, weight, m = rl.ppo_loss(
        rl.PPOInputs(logps, old, jnp.array([[0.0, 1.0]]), jnp.zeros((1, 2)),
                     jnp.array([[0.0, 2.0]]), jnp.array([[0.0, 1.0]]), mask),
        rl.PPOOptions(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1))
    np.testing.assert_allclose(float(total / weight), -1.2 + 0.1 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(m["policy/clipfrac_avg"][0]), 1.0)
    np.testing.assert_allclose(float(m["val/clipfrac_avg"][0]), 0.0)


def test_whiten_masked():
    x = jnp.array([1.0, 2.0, 3.0, 100.0])
    m = jnp.array([1.0, 1.0, 1.0, 0.0])
    w = np.asarray(rl.whiten(x, m))
    np.testing.assert_allclose(w[:3], (np.array([1, 2, 3]) - 2) / 1.0, rtol=1e-6)
