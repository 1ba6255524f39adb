"""Preference losses: against independent float64 NumPy references, hand-computed values, edge
cases (finite losses and gradients), exact micro-batch accumulation, and parameterisations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_calls import cpo, dpo, kto, orpo, reward_bt, simpo
from nnx_posttrain import errors
from nnx_posttrain.losses import preference as pl
from nnx_posttrain.losses.common import log1mexp
from nnx_posttrain.losses.dpo import BATCH_COUPLED_LOSS_TYPES, DPO_LOSS_TYPES, DPOOptions



# Five pairs whose DPO log-ratio differences d = (pc - rc) - (pr - rr) are
# 1.5, -2.0, 0.0, -3.0, 1.8: positive, negative and zero margins.
PC = np.array([-10.0, -12.5, -7.0, -20.0, -3.3])
PR = np.array([-12.0, -11.0, -7.0, -15.0, -9.1])
RC = np.array([-11.0, -12.0, -7.5, -18.0, -4.0])
RR = np.array([-11.5, -12.5, -7.5, -16.0, -8.0])
LEN_C = np.array([5.0, 8.0, 3.0, 10.0, 1.0])
LEN_R = np.array([7.0, 2.0, 3.0, 12.0, 4.0])
NLL = np.array([1.2, 0.7, 2.5, 0.1, 3.0])
# Length-averaged log-probs (SimPO / ORPO / CPO-ipo), with positive, negative and zero margins.
AVG_C = np.array([-0.8, -1.6, -0.9, -0.05, -2.4])
AVG_R = np.array([-1.3, -1.1, -0.9, -0.6, -2.0])


# ---------------------------------------------------------------------------------------------
# Independent float64 references
# ---------------------------------------------------------------------------------------------


def np_logsig(x):
    return -np.logaddexp(0.0, -x)


def np_sig(x):
    return np.exp(np_logsig(x))


def np_dpo_term(kind, beta, ls=0.0, delta_bco=0.0, lengths=True):
    c, r = PC - RC, PR - RR
    d = c - r
    dn = c / LEN_C - r / LEN_R if lengths else d
    if kind == "sigmoid":  # TRL 1.x: label smoothing does not apply to sigmoid
        return -np_logsig(beta * d)
    if kind == "cdpo":  # TRL 0.x's sigmoid with label smoothing
        return -(1 - ls) * np_logsig(beta * d) - ls * np_logsig(-beta * d)
    if kind == "hinge":
        return np.maximum(0.0, 1.0 - beta * d)
    if kind == "ipo":
        return (dn - 1.0 / (2 * beta)) ** 2
    if kind == "robust":
        return (-(1 - ls) * np_logsig(beta * d) + ls * np_logsig(-beta * d)) / (1 - 2 * ls)
    if kind == "bco_pair":
        return -np_logsig(beta * c - delta_bco) - np_logsig(-(beta * r - delta_bco))
    if kind == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if kind == "nca_pair":
        return -np_logsig(beta * c) - 0.5 * np_logsig(-beta * c) - 0.5 * np_logsig(-beta * r)
    if kind == "apo_zero":
        return (1 - np_sig(beta * c)) + np_sig(beta * r)
    if kind == "apo_down":
        return np_sig(beta * c) + (1 - np_sig(beta * d))
    if kind == "sigmoid_norm":
        return -np_logsig(beta * (c / LEN_C - r / LEN_R))
    if kind == "sft":
        return NLL
    raise AssertionError(kind)


def np_log1mexp(x):
    # float64: log(-expm1(x)) is exact near 0, log1p(-exp(x)) for very negative x.
    x = np.asarray(x, np.float64)
    with np.errstate(divide="ignore"):
        return np.where(x > -0.5, np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def mean_of(metric):
    s, c = metric
    return float(s) / float(c)


def dpo_call(kind, beta=0.1, ls=0.0, delta_bco=0.0, **kw):
    return dpo(
        PC, PR, RC, RR, beta=beta, loss_type=kind, label_smoothing=ls, chosen_nll=NLL,
        chosen_lengths=LEN_C, rejected_lengths=LEN_R, bco_delta=delta_bco, **kw,
    )


def check_pair_metrics(metrics, chosen_rewards, rejected_rewards, logps_c, logps_r, per_pair):
    n = len(per_pair)
    expected = {
        "loss": per_pair.mean(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).mean(),
        "logps/chosen": logps_c.mean(),
        "logps/rejected": logps_r.mean(),
    }
    for name, value in expected.items():
        assert float(metrics[name][1]) == n, name
        assert mean_of(metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-6), name


# ---------------------------------------------------------------------------------------------
# DPO family
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, beta, ls, delta_bco",
    [
        ("sigmoid", 0.1, 0.0, 0.0),
        ("sigmoid", 0.5, 0.1, 0.0),  # label smoothing ignored, as TRL 1.16
        ("cdpo", 0.5, 0.1, 0.0),
        ("hinge", 0.3, 0.0, 0.0),
        ("ipo", 0.1, 0.0, 0.0),
        ("robust", 0.2, 0.1, 0.0),
        ("bco_pair", 0.1, 0.0, 0.0),
        ("bco_pair", 0.5, 0.0, 0.37),
        ("sppo_hard", 0.5, 0.0, 0.0),
        ("nca_pair", 0.5, 0.0, 0.0),
        ("apo_zero", 0.5, 0.0, 0.0),
        ("apo_down", 0.5, 0.0, 0.0),
        ("sigmoid_norm", 2.0, 0.0, 0.0),
        ("sft", 0.1, 0.0, 0.0),
    ],
)
def test_dpo_matches_numpy_reference(kind, beta, ls, delta_bco):
    total, weight, metrics = dpo_call(kind, beta, ls, delta_bco)
    ref = np_dpo_term(kind, beta, ls, delta_bco)
    assert total.dtype == jnp.float32 and weight.dtype == jnp.float32
    assert float(weight) == 5
    assert float(total) == pytest.approx(ref.sum(), rel=1e-5, abs=1e-5)
    check_pair_metrics(metrics, beta * (PC - RC), beta * (PR - RR), PC, PR, ref)
    if kind == "bco_pair":
        both = np.concatenate([beta * (PC - RC), beta * (PR - RR)])
        assert float(metrics["bco/reward_mean"][1]) == 10
        assert mean_of(metrics["bco/reward_mean"]) == pytest.approx(both.mean(), rel=1e-5)


def test_dpo_ipo_without_lengths_uses_logps_as_given():
    total, _, _ = dpo(PC, PR, RC, RR, beta=0.1, loss_type="ipo")
    assert float(total) == pytest.approx(np_dpo_term("ipo", 0.1, lengths=False).sum(), rel=1e-5)


def test_dpo_hand_computed():
    # d = (-1 - -3) - (-5 - -5) = 2; beta = 0.1: -log sigmoid(0.2) = log(1 + e^-0.2).
    args = (jnp.array([-1.0]), jnp.array([-5.0]), jnp.array([-3.0]), jnp.array([-5.0]))
    total, weight, metrics = dpo(*args, beta=0.1)
    assert float(total) == pytest.approx(0.5981388693, abs=1e-6)
    assert float(weight) == 1.0
    assert mean_of(metrics["rewards/chosen"]) == pytest.approx(0.2)
    assert mean_of(metrics["rewards/rejected"]) == pytest.approx(0.0)
    assert mean_of(metrics["rewards/accuracies"]) == 1.0
    assert float(dpo(*args, beta=0.1, loss_type="hinge")[0]) == pytest.approx(0.8)
    assert float(dpo(*args, beta=0.1, loss_type="ipo")[0]) == pytest.approx(9.0)  # (2 - 5)^2
    # sppo_hard: (2 - 5)^2 + (0 + 5)^2
    assert float(dpo(*args, beta=0.1, loss_type="sppo_hard")[0]) == pytest.approx(34.0)
    # equal chosen and rejected rewards: the sigmoid loss is log 2 and the accuracy 0 (tie).
    zero = jnp.zeros(3)
    total, _, metrics = dpo(zero, zero, zero, zero)
    assert float(total) == pytest.approx(3 * math.log(2.0))
    assert mean_of(metrics["rewards/accuracies"]) == 0.0


def test_dpo_mpo_is_the_weighted_sum_of_its_terms():
    kinds, weights = ("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0)
    total, weight, metrics = dpo_call(kinds, beta=0.1, delta_bco=0.05, loss_weights=weights)
    separate = [float(dpo_call(k, beta=0.1, delta_bco=0.05)[0]) for k in kinds]
    assert float(total) == pytest.approx(sum(w * s for w, s in zip(weights, separate)), rel=1e-6)
    assert float(weight) == 5
    for kind, s in zip(kinds, separate):
        assert mean_of(metrics[f"loss/{kind}"]) * 5 == pytest.approx(s, rel=1e-6)
    # default weights are all 1
    total1, _, _ = dpo_call(kinds, beta=0.1, delta_bco=0.05)
    assert float(total1) == pytest.approx(sum(separate), rel=1e-6)


def test_dpo_options_are_checked_when_made_and_the_arrays_when_called():
    with pytest.raises(errors.ConfigError, match="unknown DPO loss_type 'kto_pair'"):
        DPOOptions(loss_type="kto_pair")
    with pytest.raises(errors.ConfigError, match="--algo.loss-weights has 1 entries for 2"):
        DPOOptions(loss_type=("sigmoid", "hinge"), loss_weights=(1.0,))
    with pytest.raises(errors.ConfigError, match="label_smoothing < 0.5"):
        DPOOptions(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(errors.ConfigError, match="--algo.ld-alpha must be in"):
        DPOOptions(ld_alpha=1.5)
    # every problem at once, each naming its option
    with pytest.raises(errors.ConfigError) as info:
        DPOOptions(loss_type="sigmoid,sigmoid,aot", use_weighting=True,
                   f_divergence_type="forward_kl")
    assert all(text in str(info.value) for text in (
        "--algo.loss-type lists a loss twice", "--algo.use-weighting (WPO) does not apply",
        "--algo.f-divergence-type 'forward_kl' only applies"))
    assert DPOOptions(loss_type="sigmoid, bco_pair,sft").loss_types == ("sigmoid", "bco_pair", "sft")
    with pytest.raises(ValueError, match="sigmoid_norm"):
        dpo(PC, PR, RC, RR, loss_type="sigmoid_norm")
    with pytest.raises(ValueError, match="chosen_nll"):
        dpo(PC, PR, RC, RR, loss_type=("sigmoid", "sft"))
    with pytest.raises(ValueError, match="both"):
        dpo(PC, PR, RC, RR, loss_type="ipo", chosen_lengths=LEN_C)
    with pytest.raises(ValueError, match="pair_weights"):
        dpo(PC, PR, RC, RR, use_weighting=True)


# ---------------------------------------------------------------------------------------------
# SimPO, CPO, ORPO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ls, nll_weight", [(0.0, 0.0), (0.1, 0.0), (0.0, 1.0)])
def test_simpo_matches_numpy_reference(ls, nll_weight):
    beta, gamma = 2.0, 1.2
    total, weight, metrics = simpo(
        AVG_C, AVG_R, beta=beta, gamma=gamma, label_smoothing=ls, nll_weight=nll_weight,
        chosen_nll=NLL if nll_weight else None,
    )
    z = beta * (AVG_C - AVG_R) - gamma
    ref = -(1 - ls) * np_logsig(z) - ls * np_logsig(-z) + nll_weight * NLL
    assert float(weight) == 5
    assert float(total) == pytest.approx(ref.sum(), rel=1e-5)
    check_pair_metrics(metrics, beta * AVG_C, beta * AVG_R, AVG_C, AVG_R, ref)
    if nll_weight:
        assert mean_of(metrics["nll_loss"]) == pytest.approx(NLL.mean(), rel=1e-6)
    else:
        assert "nll_loss" not in metrics


def test_simpo_hand_computed_and_trl_parameterisation():
    # beta (avg_c - avg_r) - gamma = 2 * 1 - 1 = 1: loss = log(1 + e^-1).
    total, _, _ = simpo(jnp.array([-1.0]), jnp.array([-2.0]), beta=2.0, gamma=1.0)
    assert float(total) == pytest.approx(0.3132616875, abs=1e-6)
    # TRL's CPOTrainer: logits = (c - r) - simpo_gamma / beta; loss = -logsigmoid(beta * logits).
    beta, simpo_gamma = 2.5, 0.8
    trl = -np_logsig(beta * ((AVG_C - AVG_R) - simpo_gamma / beta))
    total, _, _ = simpo(AVG_C, AVG_R, beta=beta, gamma=simpo_gamma)
    assert float(total) == pytest.approx(trl.sum(), rel=1e-5)


def test_simpo_gamma_and_ratio_parameterisations_agree():
    beta, ratio = 2.5, 0.55
    by_ratio = simpo(AVG_C, AVG_R, beta=beta, gamma_beta_ratio=ratio)
    by_gamma = simpo(AVG_C, AVG_R, beta=beta, gamma=ratio * beta)
    assert float(by_ratio[0]) == pytest.approx(float(by_gamma[0]), rel=1e-6)
    # default: gamma_beta_ratio 0.25, i.e. gamma 0.5 at beta 2
    default = simpo(AVG_C, AVG_R)
    assert float(default[0]) == pytest.approx(float(simpo(AVG_C, AVG_R, gamma=0.5)[0]), rel=1e-6)
    with pytest.raises(errors.ConfigError, match="not both"):
        simpo(AVG_C, AVG_R, gamma=1.0, gamma_beta_ratio=0.5)
    with pytest.raises(ValueError, match="chosen_nll"):
        simpo(AVG_C, AVG_R, nll_weight=1.0)


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
def test_cpo_matches_numpy_reference(kind):
    beta, alpha, ls = 0.2, 0.7, 0.05
    pc, pr = (PC, PR) if kind != "ipo" else (AVG_C, AVG_R)
    total, weight, metrics = cpo(
        pc, pr, beta=beta, loss_type=kind, label_smoothing=ls, chosen_nll=NLL, nll_weight=alpha
    )
    d = pc - pr
    if kind == "sigmoid":
        pref = -(1 - ls) * np_logsig(beta * d) - ls * np_logsig(-beta * d)
    elif kind == "hinge":
        pref = np.maximum(0.0, 1 - beta * d)
    else:
        pref = (d - 1 / (2 * beta)) ** 2
    ref = pref + alpha * NLL
    assert float(weight) == 5
    assert float(total) == pytest.approx(ref.sum(), rel=1e-5)
    check_pair_metrics(metrics, beta * pc, beta * pr, pc, pr, ref)
    assert mean_of(metrics["nll_loss"]) == pytest.approx(NLL.mean(), rel=1e-6)


def test_cpo_arguments():
    with pytest.raises(ValueError, match="chosen_nll"):
        cpo(PC, PR)
    total, _, metrics = cpo(PC, PR, nll_weight=0.0)  # reference-free DPO alone
    assert float(total) == pytest.approx(-np_logsig(0.1 * (PC - PR)).sum(), rel=1e-5)
    assert "nll_loss" not in metrics
    with pytest.raises(errors.ConfigError, match="unknown CPO loss_type 'kto'"):
        pl.CPOOptions(loss_type="kto")
    # TRL's loss_type="simpo" / "alphapo": SimPO's margin loss with simpo_gamma (alphapo: no NLL)
    for kind, weight in (("simpo", 0.7), ("alphapo", 0.0)):
        total, _, metrics = cpo(AVG_C, AVG_R, loss_type=kind, nll_weight=0.7, simpo_gamma=0.3,
                                alpha=0.2, chosen_nll=NLL if weight else None)
        want = simpo(AVG_C, AVG_R, beta=0.1, gamma=0.3, nll_weight=weight, alpha=0.2,
                     chosen_nll=NLL if weight else None)
        assert float(total) == float(want[0]) and set(metrics) == set(want[2])


def test_orpo_matches_numpy_reference():
    beta = 0.25
    total, weight, metrics = orpo(AVG_C, AVG_R, NLL, beta=beta)
    log_odds = (AVG_C - AVG_R) - (np_log1mexp(AVG_C) - np_log1mexp(AVG_R))
    ref = NLL - beta * np_logsig(log_odds)
    assert float(weight) == 5
    assert float(total) == pytest.approx(ref.sum(), rel=1e-5)
    check_pair_metrics(metrics, beta * AVG_C, beta * AVG_R, AVG_C, AVG_R, ref)
    assert mean_of(metrics["nll_loss"]) == pytest.approx(NLL.mean(), rel=1e-6)
    assert mean_of(metrics["log_odds_ratio"]) == pytest.approx(np_logsig(log_odds).mean(), rel=1e-5)
    assert mean_of(metrics["log_odds_chosen"]) == pytest.approx(log_odds.mean(), rel=1e-5)


def test_orpo_hand_computed():
    # p_c = 1/2 (odds 1), p_r = 1/4 (odds 1/3): odds ratio 3, sigmoid(log 3) = 3/4,
    # loss = nll + beta * log(4/3).
    half, quarter = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
    total, _, metrics = orpo(half, quarter, 2.0, beta=0.1)
    assert float(total) == pytest.approx(2.0 + 0.1 * math.log(4 / 3), abs=1e-6)
    assert mean_of(metrics["log_odds_chosen"]) == pytest.approx(math.log(3.0), abs=1e-6)
    assert mean_of(metrics["log_odds_ratio"]) == pytest.approx(math.log(0.75), abs=1e-6)


def test_log1mexp_is_accurate_over_the_whole_range():
    x = np.array([-1e-7, -1e-4, -0.01, -0.5, -0.6931, -0.7, -1.0, -5.0, -20.0, -80.0])
    np.testing.assert_allclose(log1mexp(x.astype(np.float32)), np_log1mexp(x), rtol=2e-6)
    far = np.array([-100.0, -1e4])
    np.testing.assert_allclose(log1mexp(far.astype(np.float32)), 0.0, atol=1e-30)
    assert np.isfinite(float(log1mexp(0.0)))


# ---------------------------------------------------------------------------------------------
# KTO and reward modelling
# ---------------------------------------------------------------------------------------------

KTO_POLICY = np.array([-10.0, -12.5, -7.0, -20.0, -3.3, -8.0])
KTO_REF = np.array([-11.0, -12.0, -7.0, -18.0, -4.0, -9.5])
KTO_LABELS = np.array([1, 0, 1, 0, 1, 0])
KL_POLICY = np.array([-14.0, -9.0, -13.0, -10.0, -6.0, -11.0])
KL_REF = np.array([-14.5, -9.2, -12.0, -11.0, -6.3, -11.0])


def np_kto(beta, wd, wu, kl=None):
    if kl is None:
        kl = max(np.mean(KL_POLICY - KL_REF), 0.0)
    rho = KTO_POLICY - KTO_REF
    des = KTO_LABELS == 1
    per = np.where(des, wd * (1 - np_sig(beta * (rho - kl))), wu * (1 - np_sig(beta * (kl - rho))))
    return per, kl


@pytest.mark.parametrize("beta, wd, wu", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33)])
def test_kto_matches_numpy_reference(beta, wd, wu):
    total, weight, metrics = kto(
        KTO_POLICY, KTO_REF, KTO_LABELS, KL_POLICY, KL_REF,
        beta=beta, desirable_weight=wd, undesirable_weight=wu,
    )
    per, kl = np_kto(beta, wd, wu)
    assert kl > 0
    assert float(weight) == 6
    assert float(total) == pytest.approx(per.sum(), rel=1e-5)
    assert mean_of(metrics["loss"]) == pytest.approx(per.mean(), rel=1e-5)
    assert mean_of(metrics["kl"]) == pytest.approx(kl, rel=1e-5)
    des, und = KTO_LABELS == 1, KTO_LABELS == 0
    rewards = beta * (KTO_POLICY - KTO_REF)
    assert float(metrics["rewards/chosen"][1]) == 3 and float(metrics["rewards/rejected"][1]) == 3
    assert mean_of(metrics["rewards/chosen"]) == pytest.approx(rewards[des].mean(), rel=1e-5)
    assert mean_of(metrics["rewards/rejected"]) == pytest.approx(rewards[und].mean(), rel=1e-5)
    assert mean_of(metrics["logps/chosen"]) == pytest.approx(KTO_POLICY[des].mean(), rel=1e-6)
    assert mean_of(metrics["logps/rejected"]) == pytest.approx(KTO_POLICY[und].mean(), rel=1e-6)


def test_kto_kl_is_clamped_detached_and_overridable():
    # a negative KL estimate is clamped to 0
    total, _, metrics = kto(KTO_POLICY, KTO_REF, KTO_LABELS, KL_REF, KL_POLICY)
    assert float(metrics["kl"][0]) == 0.0
    assert float(total) == pytest.approx(np_kto(0.1, 1, 1, kl=0.0)[0].sum(), rel=1e-5)
    # hand-computed: rho = 0 and kl = 0 gives 1 - sigmoid(0) = 1/2 for either label
    total, _, _ = kto(jnp.zeros(2), jnp.zeros(2), jnp.array([1, 0]), None, None)
    assert float(total) == pytest.approx(1.0)
    # explicit kl
    total, _, metrics = kto(KTO_POLICY, KTO_REF, KTO_LABELS, None, None, kl=0.4)
    assert float(total) == pytest.approx(np_kto(0.1, 1, 1, kl=0.4)[0].sum(), rel=1e-5)
    # no gradient flows through the KL estimate
    grad = jax.grad(lambda kp: kto(KTO_POLICY, KTO_REF, KTO_LABELS, kp, KL_REF)[0])(
        jnp.asarray(KL_POLICY, jnp.float32)
    )
    np.testing.assert_array_equal(grad, 0.0)


def test_kto_counts_with_one_class_only():
    _, _, metrics = kto(KTO_POLICY, KTO_REF, np.ones(6, bool), KL_POLICY, KL_REF)
    assert float(metrics["rewards/rejected"][1]) == 0.0
    assert float(metrics["rewards/rejected"][0]) == 0.0
    assert float(metrics["logps/chosen"][1]) == 6.0


def test_reward_bt_matches_numpy_reference():
    rc = np.array([1.0, -0.5, 2.0, 0.3, 0.0])
    rr = np.array([0.0, 0.5, -1.0, 0.3, 4.0])
    margin = np.array([0.5, 0.0, 1.0, 0.2, 0.0])
    coef = 0.01
    total, weight, metrics = reward_bt(rc, rr, margin=margin, center_rewards_coefficient=coef)
    ref = -np_logsig(rc - rr - margin) + coef * (rc + rr) ** 2
    assert float(weight) == 5
    assert float(total) == pytest.approx(ref.sum(), rel=1e-5)
    assert mean_of(metrics["loss"]) == pytest.approx(ref.mean(), rel=1e-5)
    assert mean_of(metrics["accuracy"]) == pytest.approx(0.4)  # the tie counts as wrong
    assert mean_of(metrics["margin"]) == pytest.approx((rc - rr).mean(), rel=1e-6)
    assert mean_of(metrics["rewards/margins"]) == pytest.approx((rc - rr).mean(), rel=1e-6)
    assert mean_of(metrics["rewards/chosen"]) == pytest.approx(rc.mean(), rel=1e-6)
    assert mean_of(metrics["rewards/rejected"]) == pytest.approx(rr.mean(), rel=1e-6)
    assert mean_of(metrics["mean_reward"]) == pytest.approx(np.concatenate([rc, rr]).mean())
    # TRL's reduction: mean BT loss + coef * mean((rc + rr)^2)
    trl = (-np_logsig(rc - rr - margin)).mean() + coef * np.mean((rc + rr) ** 2)
    assert float(total / weight) == pytest.approx(trl, rel=1e-5)
    # a [batch, 1] score head output is accepted
    total2, _, _ = reward_bt(
        rc[:, None], rr[:, None], margin=margin, center_rewards_coefficient=coef
    )
    assert float(total2) == pytest.approx(float(total), rel=1e-6)


def test_reward_bt_hand_computed():
    total, _, metrics = reward_bt(jnp.array([1.0]), jnp.array([0.0]))
    assert float(total) == pytest.approx(0.3132616875, abs=1e-6)  # log(1 + e^-1)
    assert mean_of(metrics["accuracy"]) == 1.0


# ---------------------------------------------------------------------------------------------
# Edge cases: finite losses and gradients
# ---------------------------------------------------------------------------------------------

EDGE_CASES = {
    # (chosen, rejected) policy log-probs; the reference is the chosen/rejected swapped
    "equal": (np.array([-5.0, 0.0, -1e4]), np.array([-5.0, 0.0, -1e4])),
    "huge_margin": (np.array([-1.0, -1e4, -2.0]), np.array([-1e4, -1.0, -2e4])),
    "very_negative": (np.array([-1e4, -2e4, -3e4]), np.array([-1.5e4, -1e4, -3e4])),
}


def assert_finite_loss_and_grads(fn, chosen, rejected):
    chosen, rejected = jnp.asarray(chosen, jnp.float32), jnp.asarray(rejected, jnp.float32)
    total, weight, metrics = fn(chosen, rejected)
    assert np.isfinite(float(total)) and float(weight) > 0
    for name, (s, c) in metrics.items():
        assert np.isfinite(float(s)) and np.isfinite(float(c)), name
    grads = jax.grad(lambda c, r: fn(c, r)[0], argnums=(0, 1))(chosen, rejected)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g))), g


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
@pytest.mark.parametrize("kind", DPO_LOSS_TYPES)
def test_dpo_edge_cases_are_finite(kind, case):
    chosen, rejected = EDGE_CASES[case]
    lengths = np.array([1.0, 300.0, 0.0])  # 0 is clamped to 1, as TRL

    def fn(c, r):
        return dpo(
            c, r, rejected, chosen, beta=0.1, loss_type=kind, label_smoothing=0.1,
            chosen_nll=-c, chosen_lengths=lengths, rejected_lengths=lengths, bco_delta=0.2,
        )

    assert_finite_loss_and_grads(fn, chosen, rejected)


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
@pytest.mark.parametrize(
    "name",
    ["simpo", "cpo_simpo", "cpo_sigmoid", "cpo_hinge", "cpo_ipo", "orpo", "kto", "reward_bt"],
)
def test_other_losses_edge_cases_are_finite(name, case):
    chosen, rejected = EDGE_CASES[case]
    fns = {
        "simpo": lambda c, r: simpo(c, r, beta=2.0, gamma=1.0, label_smoothing=0.1),
        "cpo_simpo": lambda c, r: simpo(c, r, nll_weight=1.0, chosen_nll=-c),
        "cpo_sigmoid": lambda c, r: cpo(c, r, chosen_nll=-c, label_smoothing=0.1),
        "cpo_hinge": lambda c, r: cpo(c, r, loss_type="hinge", chosen_nll=-c),
        "cpo_ipo": lambda c, r: cpo(c, r, loss_type="ipo", chosen_nll=-c),
        "orpo": lambda c, r: orpo(c, r, -c, beta=0.1),
        "kto": lambda c, r: kto(
            jnp.concatenate([c, r]), jnp.concatenate([r, c]), jnp.array([1, 1, 1, 0, 0, 0]),
            jnp.concatenate([r, c]), jnp.concatenate([c, r]),
        ),
        "reward_bt": lambda c, r: reward_bt(c, r, margin=1.0, center_rewards_coefficient=0.01),
    }
    assert_finite_loss_and_grads(fns[name], chosen, rejected)


def test_orpo_near_zero_and_zero_logps_are_finite():
    chosen = np.array([0.0, -1e-8, -1e-3, -1e4])
    rejected = np.array([-1e-6, 0.0, -1e4, -1e-7])
    assert_finite_loss_and_grads(lambda c, r: orpo(c, r, -c, beta=0.1), chosen, rejected)


def test_losses_are_float32_even_for_float64_or_int_inputs():
    ints = np.array([-1, -2]), np.array([-3, -1]), np.array([-2, -2]), np.array([-2, -2])
    total, weight, _ = dpo(*ints)
    assert total.dtype == jnp.float32 and weight.dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# (sum, count) accumulation: two halves give exactly the means of the whole batch
# ---------------------------------------------------------------------------------------------


def _split_and_compare(fn, arrays, cut):
    whole = fn(*arrays)
    halves = [fn(*[a[:cut] for a in arrays]), fn(*[a[cut:] for a in arrays])]
    total = sum(float(h[0]) for h in halves)
    weight = sum(float(h[1]) for h in halves)
    assert weight == float(whole[1])
    assert total / weight == pytest.approx(float(whole[0]) / float(whole[1]), rel=1e-6)
    assert set(halves[0][2]) == set(whole[2])
    for name, (s, c) in whole[2].items():
        s_split = sum(float(h[2][name][0]) for h in halves)
        c_split = sum(float(h[2][name][1]) for h in halves)
        if float(c) == 0:
            assert c_split == 0, name
            continue
        assert s_split / c_split == pytest.approx(float(s) / float(c), rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize("kind", tuple(k for k in DPO_LOSS_TYPES
                                       if k not in BATCH_COUPLED_LOSS_TYPES)
                         + (("sigmoid", "bco_pair", "sft"),))
def test_dpo_accumulates_exactly(kind):
    """Every per-pair term (aot / aot_unpaired sort the batch: tests/test_trl_variants.py)."""
    def fn(pc, pr, rc, rr, nll, lc, lr):
        return dpo(
            pc, pr, rc, rr, beta=0.3, loss_type=kind, label_smoothing=0.1, chosen_nll=nll,
            chosen_lengths=lc, rejected_lengths=lr, bco_delta=0.1,
            loss_weights=(0.8, 0.2, 1.0) if not isinstance(kind, str) else None,
        )

    _split_and_compare(fn, (PC, PR, RC, RR, NLL, LEN_C, LEN_R), cut=2)


@pytest.mark.parametrize(
    "name, fn, arrays",
    [
        (
            "simpo",
            lambda c, r, n: simpo(c, r, nll_weight=0.5, chosen_nll=n),
            (AVG_C, AVG_R, NLL),
        ),
        ("cpo", lambda c, r, n: cpo(c, r, chosen_nll=n), (PC, PR, NLL)),
        ("orpo", lambda c, r, n: orpo(c, r, n), (AVG_C, AVG_R, NLL)),
        (
            "reward_bt",
            lambda c, r, m: reward_bt(c, r, margin=m, center_rewards_coefficient=0.1),
            (PC / 10, PR / 10, LEN_C / 10),
        ),
    ],
)
def test_pairwise_losses_accumulate_exactly(name, fn, arrays):
    _split_and_compare(fn, arrays, cut=3)


def test_kto_accumulates_exactly_with_a_shared_kl():
    kl = float(np.mean(KL_POLICY - KL_REF))

    def fn(p, r, y):
        return kto(p, r, y, None, None, beta=0.2, undesirable_weight=1.3, kl=kl)

    _split_and_compare(fn, (KTO_POLICY, KTO_REF, KTO_LABELS), cut=2)
    # a cut that leaves one half without undesirable examples
    _split_and_compare(fn, (KTO_POLICY, KTO_REF, np.array([1, 1, 0, 0, 1, 0])), cut=2)


def test_losses_jit():
    f = jax.jit(lambda *a: dpo(*a, loss_type=("sigmoid", "ipo"))[0])
    assert np.isfinite(float(f(PC, PR, RC, RR)))
