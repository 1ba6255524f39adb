"""The preference losses against NumPy references written from TRL 1.16.0's source (TRL itself is
not called): DPO's newer loss types, f-divergences, WPO weighting, LD-DPO, the token-mean NLL
terms and their exact accumulation, AOT's batch coupling, cDPO, CPO's AlphaPO and KTO's unpaired
APO-zero. Each test names the TRL file and function it transcribes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_calls import dpo, kto
from nnx_posttrain.losses import preference as pl
from nnx_posttrain.losses.common import Pairs, token_mean_terms
from nnx_posttrain.losses.dpo import (F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCES, DPOOptions,
                                      ld_split, wpo_weights)
from nnx_posttrain.losses.dpo import f_divergence_scores as scores_of


def f_divergence_scores(u, kind, alpha=0.5):
    return scores_of(u, DPOOptions(f_divergence_type=kind, f_alpha_divergence_coef=alpha))


RNG = np.random.default_rng(0)
B, T = 6, 9
# per-token log-probs of policy and reference on right-padded completions of unequal lengths
# (a 1-token prompt at position 0, as the model aligns them)
LEN_C = np.array([3, 7, 5, 1, 8, 4])
LEN_R = np.array([6, 2, 5, 4, 3, 8])


def _mask(lengths):
    m = np.zeros((B, T), np.float32)
    for i, n in enumerate(lengths):
        m[i, 1:1 + n] = 1
    return m


MASK_C, MASK_R = _mask(LEN_C), _mask(LEN_R)
TOK_C = (RNG.normal(-1.2, 0.6, (B, T)) * MASK_C).astype(np.float32)
TOK_R = (RNG.normal(-1.4, 0.6, (B, T)) * MASK_R).astype(np.float32)
REF_TOK_C = (TOK_C + RNG.normal(0, 0.4, (B, T)) * MASK_C).astype(np.float32)
REF_TOK_R = (TOK_R + RNG.normal(0, 0.4, (B, T)) * MASK_R).astype(np.float32)
# log sum_v p_v^2 <= log max_v p_v <= 0, and >= logp_t + logp_t
LSS_C = (np.minimum(TOK_C, 0) * 0.7 * MASK_C).astype(np.float32)
LSS_R = (np.minimum(TOK_R, 0) * 0.7 * MASK_R).astype(np.float32)


def np_logsig(x):
    return -np.logaddexp(0.0, -x)


def np_sig(x):
    return np.exp(np_logsig(x))


# ---------------------------------------------------------------------------------------------
# NumPy transcription of trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss (TRL 1.16.0)
# ---------------------------------------------------------------------------------------------


def trl_dpo(loss_types, weights=None, beta=0.1, label_smoothing=0.0, f_divergence_type="reverse_kl",
            f_alpha=0.5, discopop_tau=0.05, use_weighting=False, ld_alpha=None, rows=slice(None)):
    """``DPOTrainer._compute_loss`` in float64 on rows ``rows`` of the fixture: the per-token
    log-probs summed (or LD-split), the f-divergence scores, each loss type's branch, WPO's
    weights, ``loss += per_sequence_loss.mean() * loss_weight``."""
    tc, tr, rtc, rtr = (x[rows].astype(np.float64) for x in (TOK_C, TOK_R, REF_TOK_C, REF_TOK_R))
    mc, mr = MASK_C[rows].astype(np.float64), MASK_R[rows].astype(np.float64)
    weights = weights or [1.0] * len(loss_types)
    if ld_alpha is None:
        logps = lambda t, m: (t * m).sum(1)
        cl, rl_, rcl, rrl = logps(tc, mc), logps(tr, mr), logps(rtc, mc), logps(rtr, mr)
    else:  # comp_pos / shared_mask / tail_mask, with shared_lens = min(chosen, rejected) lengths
        shared = np.minimum(mc.sum(1), mr.sum(1))[:, None]

        def ld(t, m):
            pos = np.cumsum(m, axis=1)
            shared_mask = (pos > 0) & (pos <= shared)
            tail_mask = pos > shared
            return (t * shared_mask).sum(1) + ld_alpha * (t * tail_mask).sum(1)

        cl, rl_, rcl, rrl = ld(tc * mc, mc), ld(tr * mr, mr), ld(rtc * mc, mc), ld(rtr * mr, mr)
    c, r = cl - rcl, rl_ - rrl
    if f_divergence_type == "reverse_kl":
        sc, sr = c, r
    elif f_divergence_type == "forward_kl":
        sc, sr = 1 - np.exp(-c), 1 - np.exp(-r)
    elif f_divergence_type == "js_divergence":
        sc, sr = math.log(2) + np_logsig(c), math.log(2) + np_logsig(r)
    else:
        if abs(f_alpha - 1.0) < 1e-6:
            sc, sr = c, r
        else:
            coef = 1.0 / (f_alpha - 1.0)
            sc = (np.exp(np.minimum((f_alpha - 1.0) * c, 80.0)) - 1.0) * coef
            sr = (np.exp(np.minimum((f_alpha - 1.0) * r, 80.0)) - 1.0) * coef
    d = sc - sr
    eps = label_smoothing
    loss = 0.0
    for loss_type, w in zip(loss_types, weights):
        if loss_type == "sigmoid":
            per = -np_logsig(beta * d)
        elif loss_type == "hinge":
            per = np.maximum(0.0, 1 - beta * d)
        elif loss_type == "ipo":
            per = (sc / np.maximum(mc.sum(1), 1) - sr / np.maximum(mr.sum(1), 1)
                   - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            qw, log_qw = np_sig(beta * d), np_logsig(beta * d)
            ql, log_ql = np_sig(-beta * d), np_logsig(-beta * d)
            per = qw * (log_qw - np.log1p(-eps)) + ql * (log_ql - np.log(eps))
        elif loss_type == "nca_pair":
            per = -np_logsig(beta * c) - 0.5 * np_logsig(-beta * c) - 0.5 * np_logsig(-beta * r)
        elif loss_type == "robust":
            per = (-(1 - eps) * np_logsig(beta * d) + eps * np_logsig(-beta * d)) / (1 - 2 * eps)
        elif loss_type == "bco_pair":
            per = -np_logsig(beta * c) - np_logsig(-beta * r)
        elif loss_type == "sppo_hard":
            per = (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
        elif loss_type == "aot":
            delta = np.sort(cl - rl_) - np.sort(rcl - rrl)
            per = -np_logsig(beta * delta) * (1 - eps) - np_logsig(-beta * delta) * eps
        elif loss_type == "aot_unpaired":
            delta = np.sort(c) - np.sort(r)
            per = -np_logsig(beta * delta) * (1 - eps) - np_logsig(-beta * delta) * eps
        elif loss_type == "apo_zero":
            per = (1 - np_sig(beta * c)) + np_sig(beta * r)
        elif loss_type == "apo_down":
            per = np_sig(beta * c) + (1 - np_sig(beta * (c - r)))
        elif loss_type == "discopop":
            logits = d * beta
            mod = np_sig(logits / discopop_tau)
            per = -np_logsig(logits) * (1 - mod) + np.exp(-logits) * mod
        elif loss_type == "sft":  # -chosen_per_token_logps[chosen_mask.bool()].mean()
            per = np.full(len(c), -tc[mc > 0].mean())
        elif loss_type == "sigmoid_norm":
            per = -np_logsig(beta * (sc / np.maximum(mc.sum(1), 1) - sr / np.maximum(mr.sum(1), 1)))
        else:
            raise AssertionError(loss_type)
        if use_weighting:  # Eq (2) of the WPO paper
            lc, lr_ = (np.asarray(x[rows], np.float64) for x in (LSS_C, LSS_R))
            wc = np.exp(((tc - lc) * mc).sum(1) / np.maximum(mc.sum(1), 1))
            wr = np.exp(((tr - lr_) * mr).sum(1) / np.maximum(mr.sum(1), 1))
            per = per * wc * wr
        loss += per.mean() * w
    return loss


def ours(loss_types, weights=None, beta=0.1, label_smoothing=0.0, f_divergence_type="reverse_kl",
         f_alpha=0.5, discopop_tau=0.05, use_weighting=False, ld_alpha=None, rows=slice(None),
         nll_scale=None):
    """The same through this library's pieces, as ``algorithms.preference.DPO.loss`` uses them."""
    tc, tr, rtc, rtr = (jnp.asarray(x[rows]) for x in (TOK_C, TOK_R, REF_TOK_C, REF_TOK_R))
    mc, mr = jnp.asarray(MASK_C[rows]), jnp.asarray(MASK_R[rows])
    if ld_alpha is None:
        cl, rl_, rcl, rrl = (tc * mc).sum(1), (tr * mr).sum(1), (rtc * mc).sum(1), (rtr * mr).sum(1)
    else:
        cs, ct, rs, rt = ld_split(tc, tr, mc, mr)
        rcs, rct, rrs, rrt = ld_split(rtc, rtr, mc, mr)
        cl, rl_, rcl, rrl = cs + ld_alpha * ct, rs + ld_alpha * rt, rcs + ld_alpha * rct, rrs + ld_alpha * rrt
    nll = token_mean_terms(-(tc * mc).sum(1), mc.sum(1), nll_scale)
    weights_ = None
    if use_weighting:
        weights_ = (wpo_weights(tc, jnp.asarray(LSS_C[rows]), mc)
                    * wpo_weights(tr, jnp.asarray(LSS_R[rows]), mr))
    return dpo(cl, rl_, rcl, rrl, beta=beta, loss_type=tuple(loss_types), loss_weights=weights,
               label_smoothing=label_smoothing, chosen_nll=nll, chosen_lengths=mc.sum(1),
               rejected_lengths=mr.sum(1), f_divergence_type=f_divergence_type,
               f_alpha_divergence_coef=f_alpha, discopop_tau=discopop_tau, pair_weights=weights_)


def mean(out):
    return float(out[0]) / float(out[1])


ALL_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
             "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]


@pytest.mark.parametrize("loss_type", ALL_TYPES)
@pytest.mark.parametrize("beta, ls", [(0.1, 0.1), (0.7, 0.02)])
def test_every_trl_dpo_loss_type(loss_type, beta, ls):
    """trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss: each loss_type branch (TRL 1.16
    lists exactly these fifteen) on summed per-token log-probs of unequal lengths."""
    want = trl_dpo([loss_type], beta=beta, label_smoothing=ls)
    assert mean(ours([loss_type], beta=beta, label_smoothing=ls)) == pytest.approx(
        want, rel=2e-5, abs=1e-6)


def test_mpo_combination_and_sft_token_mean():
    """DPOTrainer._compute_loss: ``loss += per_sequence_loss.mean() * loss_weight`` over MPO's
    three terms; the sft term is the token mean over the batch's chosen completion tokens."""
    kinds, w = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    assert mean(ours(kinds, w)) == pytest.approx(trl_dpo(kinds, w), rel=2e-5)
    total, weight, metrics = ours(["sft"])
    token_mean = -TOK_C[MASK_C > 0].astype(np.float64).mean()
    assert float(total / weight) == pytest.approx(token_mean, rel=1e-6)
    # not the mean of per-example averages (the lengths differ)
    per_example = (-(TOK_C * MASK_C).sum(1) / LEN_C).mean()
    assert abs(per_example - token_mean) > 1e-2


@pytest.mark.parametrize("f_type", F_DIVERGENCES)
@pytest.mark.parametrize("loss_type", [t for t in F_DIVERGENCE_LOSS_TYPES if t != "cdpo"])
def test_f_divergence_scores(f_type, loss_type):
    """DPOTrainer._compute_loss, the ``f_divergence_type`` branch (chosen_scores /
    rejected_scores) feeding every loss type TRL allows it for."""
    kw = dict(f_divergence_type=f_type, f_alpha=0.3, label_smoothing=0.05, beta=0.4)
    assert mean(ours([loss_type], **kw)) == pytest.approx(trl_dpo([loss_type], **kw), rel=2e-5,
                                                          abs=1e-6)


def test_f_divergence_rules():
    """The loss types TRL rejects with a non-default f-divergence (DPOTrainer.__init__); the
    alpha divergence's limit alpha -> 1 is reverse KL."""
    u = jnp.array([-3.0, 0.0, 2.5])
    np.testing.assert_allclose(f_divergence_scores(u, "alpha_divergence", 1.0), u)
    np.testing.assert_allclose(f_divergence_scores(u, "alpha_divergence", 1.0 + 1e-3), u, rtol=5e-3)
    # forward KL: f'(t) = 1 - 1/t at t = e^u
    np.testing.assert_allclose(f_divergence_scores(u, "forward_kl"), 1 - np.exp(-np.asarray(u)),
                               rtol=1e-6)
    for bad in ("bco_pair", "nca_pair", "aot", "apo_zero", "sppo_hard"):
        with pytest.raises(ValueError, match="only applies"):
            ours([bad], f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="unknown f_divergence_type"):
        ours(["sigmoid"], f_divergence_type="chi2")


@pytest.mark.parametrize("kinds", [["sigmoid"], ["ipo"], ["sigmoid", "sft"], ["discopop"]])
def test_wpo_weighting(kinds):
    """DPOTrainer._compute_loss, ``if self.use_weighting`` (WPO eq. 2): weights exp(mean_t
    (logp_t - log_sum_sq_probs_t)) of chosen times rejected, detached, multiply every term,
    sft's scalar token mean included."""
    assert mean(ours(kinds, use_weighting=True)) == pytest.approx(
        trl_dpo(kinds, use_weighting=True), rel=2e-5)
    # the weights carry no gradient
    g = jax.grad(lambda t: wpo_weights(t, jnp.asarray(LSS_C), jnp.asarray(MASK_C)).sum())(
        jnp.asarray(TOK_C))
    np.testing.assert_array_equal(g, 0.0)
    with pytest.raises(ValueError, match="aot"):
        ours(["aot"], use_weighting=True)


@pytest.mark.parametrize("ld_alpha", [0.0, 0.35, 1.0])
@pytest.mark.parametrize("kinds", [["sigmoid"], ["ipo"], ["sigmoid", "sft"]])
def test_ld_dpo(ld_alpha, kinds):
    """DPOTrainer._compute_loss and compute_ref_log_probs, ``if self.ld_alpha`` (comp_pos,
    shared_mask, tail_mask): policy and reference log-probs are shared + ld_alpha * tail."""
    assert mean(ours(kinds, ld_alpha=ld_alpha)) == pytest.approx(
        trl_dpo(kinds, ld_alpha=ld_alpha), rel=2e-5)
    if ld_alpha == 1.0:  # no weighting: plain DPO
        assert mean(ours(kinds, ld_alpha=1.0)) == pytest.approx(mean(ours(kinds)), rel=1e-6)


def test_ld_split_by_hand():
    # chosen 3 tokens, rejected 1: shared length 1
    tokens_c = jnp.array([[0.0, -1.0, -2.0, -4.0, 0.0]])
    tokens_r = jnp.array([[0.0, -8.0, 0.0, 0.0, 0.0]])
    mc, mr = jnp.array([[0, 1, 1, 1, 0]]), jnp.array([[0, 1, 0, 0, 0]])
    cs, ct, rs, rt = (float(x[0]) for x in ld_split(tokens_c, tokens_r, mc, mr))
    assert (cs, ct, rs, rt) == (-1.0, -6.0, -8.0, 0.0)


def test_nll_terms_accumulate_to_the_large_batch_token_mean():
    """Two micro-batches whose NLL terms are scaled by the whole batch's pairs / tokens (what the
    algorithms compute on the host) add up exactly to TRL's one-batch token mean; each
    micro-batch's own scale would not (unequal token counts)."""
    kinds, w = ["sigmoid", "sft"], [1.0, 1.0]
    whole = ours(kinds, w)
    scale = B / MASK_C.sum()
    parts = [ours(kinds, w, rows=rows, nll_scale=scale) for rows in (slice(0, 2), slice(2, None))]
    total, weight = sum(float(p[0]) for p in parts), sum(float(p[1]) for p in parts)
    assert total / weight == pytest.approx(mean(whole), rel=1e-6)
    assert mean(whole) == pytest.approx(trl_dpo(kinds, w), rel=2e-5)
    own = [ours(kinds, w, rows=rows) for rows in (slice(0, 2), slice(2, None))]
    assert abs(sum(float(p[0]) for p in own) / weight - mean(whole)) > 1e-3


def test_aot_sorts_each_micro_batch_as_trl_does():
    """AOT couples the pairs of a batch (torch.sort over the batch in DPOTrainer._compute_loss).
    Under accumulation each micro-batch is sorted on its own: the accumulated loss is the mean of
    the micro-batches' AOT losses (TRL's per-device micro-batch loss averaged over accumulation
    steps), which differs from sorting the whole batch."""
    for kind in ("aot", "aot_unpaired"):
        kw = dict(label_smoothing=0.1, beta=1.0)
        parts = [ours([kind], rows=rows, **kw) for rows in (slice(0, 3), slice(3, None))]
        acc = sum(float(p[0]) for p in parts) / sum(float(p[1]) for p in parts)
        trl_acc = np.mean([trl_dpo([kind], rows=rows, **kw)
                           for rows in (slice(0, 3), slice(3, None))])
        assert acc == pytest.approx(trl_acc, rel=2e-5)
        assert abs(acc - trl_dpo([kind], **kw)) > 1e-3


def test_sigmoid_ignores_label_smoothing_and_cdpo_keeps_it():
    """TRL 1.16's sigmoid branch is -logsigmoid(beta * delta) whatever label_smoothing is; cDPO
    (TRL 0.x's smoothed sigmoid) stays reachable as loss_type 'cdpo'. Hand example: d = 2,
    beta = 0.5, eps = 0.2: sigmoid = log(1 + e^-1) = 0.31326; cdpo = 0.8 * 0.31326 + 0.2 *
    log(1 + e) = 0.51326."""
    args = (jnp.array([-1.0]), jnp.array([-5.0]), jnp.array([-3.0]), jnp.array([-5.0]))
    sig = float(dpo(*args, beta=0.5, label_smoothing=0.2)[0])
    cdpo = float(dpo(*args, beta=0.5, label_smoothing=0.2, loss_type="cdpo")[0])
    assert sig == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)
    assert cdpo == pytest.approx(0.8 * math.log1p(math.exp(-1.0)) + 0.2 * math.log1p(math.e),
                                 abs=1e-6)


def test_exo_pair_needs_label_smoothing():
    """DPOTrainer.__init__: 'Label smoothing must be greater than 0.0 when using exo_pair'."""
    with pytest.raises(ValueError, match="exo_pair"):
        ours(["exo_pair"], label_smoothing=0.0)


# ---------------------------------------------------------------------------------------------
# CPO: AlphaPO (trl/experimental/cpo/cpo_trainer.py, CPOTrainer.cpo_loss)
# ---------------------------------------------------------------------------------------------

SUM_C = (TOK_C * MASK_C).sum(1).astype(np.float64)
SUM_R = (TOK_R * MASK_R).sum(1).astype(np.float64)


def trl_cpo_loss(pc, pr, loss_type, beta, ls, alpha, simpo_gamma=0.5):
    """CPOTrainer.cpo_loss: the AlphaPO reward transform, then the loss_type branch; returns
    (losses, chosen_rewards, rejected_rewards)."""
    if alpha != 0.0:
        rc = (1 - np.exp(pc) ** (-alpha)) / alpha
        rr = (1 - np.exp(pr) ** (-alpha)) / alpha
        logits = rc - rr
    else:
        rc, rr = pc, pr
        logits = pc - pr
    if loss_type == "simpo":
        logits = logits - simpo_gamma / beta
        losses = -np_logsig(beta * logits) * (1 - ls) - np_logsig(-beta * logits) * ls
    elif loss_type == "sigmoid":
        losses = -np_logsig(beta * logits) * (1 - ls) - np_logsig(-beta * logits) * ls
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    return losses, beta * rc, beta * rr


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo"])
@pytest.mark.parametrize("alpha", [0.0, 0.25, -0.5])
def test_cpo_alphapo(loss_type, alpha):
    """CPOTrainer.cpo_loss with ``alpha`` (and get_batch_loss_metrics: loss = losses.mean() +
    cpo_alpha * nll_loss, rewards = beta * the transformed rewards); averaged log-probs for ipo
    and simpo (concatenated_forward's ``average_log_prob``), the NLL a token mean."""
    beta, ls, cpo_alpha = 0.3, 0.05, 0.7
    averaged = loss_type in ("ipo", "simpo")
    pc = SUM_C / LEN_C if averaged else SUM_C
    pr = SUM_R / LEN_R if averaged else SUM_R
    losses, rc, rr = trl_cpo_loss(pc, pr, loss_type, beta, ls, alpha)
    nll = -TOK_C[MASK_C > 0].astype(np.float64).mean()
    want = losses.mean() + cpo_alpha * nll
    terms = token_mean_terms(-SUM_C, LEN_C)
    if loss_type == "simpo":
        out = pl.simpo(Pairs(pc, pr, terms), pl.SimPOOptions(
            beta=beta, gamma=0.5, label_smoothing=ls, alpha=alpha, nll_weight=cpo_alpha))
    else:
        out = pl.cpo(Pairs(pc, pr, terms), pl.CPOOptions(
            beta=beta, loss_type=loss_type, label_smoothing=ls, alpha=alpha, nll_weight=cpo_alpha))
    assert mean(out) == pytest.approx(want, rel=2e-5)
    metrics = out[2]
    assert float(metrics["rewards/chosen"][0]) / B == pytest.approx(rc.mean(), rel=2e-5)
    assert float(metrics["rewards/rejected"][0]) / B == pytest.approx(rr.mean(), rel=2e-5)
    assert float(metrics["nll_loss"][0]) / B == pytest.approx(nll, rel=1e-6)


def test_alphapo_stays_finite_where_the_power_overflows():
    """p^(-alpha) of a summed log-prob of -1e4 overflows in TRL; the capped exponent keeps the
    loss and its gradient finite."""
    f = lambda c: pl.cpo(Pairs(c, jnp.array([-1.0, -2.0])), pl.CPOOptions(alpha=0.5,
                                                                          nll_weight=0.0))[0]
    c = jnp.array([-1e4, -3.0])
    assert np.isfinite(float(f(c))) and np.isfinite(np.asarray(jax.grad(f)(c))).all()


# ---------------------------------------------------------------------------------------------
# KTO: apo_zero_unpaired (trl/trainer/kto_trainer.py, KTOTrainer._compute_loss)
# ---------------------------------------------------------------------------------------------


def test_kto_apo_zero_unpaired():
    """KTOTrainer._compute_loss, ``loss_type == "apo_zero_unpaired"``: chosen 1 - s(beta rho),
    rejected s(beta rho), weighted, kl = 0 (calculate_KL False), loss = mean over examples."""
    policy = np.array([-10.0, -12.5, -7.0, -20.0, -3.3, -8.0])
    ref = np.array([-11.0, -12.0, -7.0, -18.0, -4.0, -9.5])
    labels = np.array([1, 0, 1, 0, 1, 0])
    beta, wd, wu = 0.5, 1.0, 1.3
    rho = policy - ref
    chosen = wd * (1 - np_sig(beta * rho[labels == 1]))
    rejected = wu * np_sig(beta * rho[labels == 0])
    want = np.concatenate([chosen, rejected]).mean()
    total, weight, metrics = kto(policy, ref, labels, None, None, beta=beta,
                                    desirable_weight=wd, undesirable_weight=wu,
                                    loss_type="apo_zero_unpaired")
    assert float(total / weight) == pytest.approx(want, rel=1e-6)
    assert float(metrics["kl"][0]) == 0.0
    # mismatched-completion log-probs, if given, are ignored: no reference point
    again = kto(policy, ref, labels, policy - 3, ref, beta=beta, desirable_weight=wd,
                   undesirable_weight=wu, loss_type="apo_zero_unpaired")
    assert float(again[0]) == pytest.approx(float(total), rel=1e-7)
    with pytest.raises(ValueError, match="KTO loss_type"):
        kto(policy, ref, labels, None, None, loss_type="bco")
