"""The per-pair terms of DPO's ``loss_type`` table: one small function of :class:`DPOInputs` each,
with its formula and paper; :func:`nnx_posttrain.losses.dpo.dpo` combines them. Imports jax only.

Written from TRL 1.16.0's ``trl/trainer/dpo_trainer.py`` (``DPOTrainer._compute_loss``, the
``for loss_type, loss_weight in ...`` branches). Notation: c, r are the chosen and rejected
log-ratios log pi - log pi_ref; s_c, s_r their f-divergence scores (``f_divergence_type``; s = the
log-ratio for the default reverse KL); d = s_c - s_r; b = beta; eps = label_smoothing; s(.) is the
logistic sigmoid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import _f32, _smoothed_sigmoid


class DPOInputs(NamedTuple):
    """What every DPO term is a function of: float32 ``[batch]`` arrays unless noted."""

    c: jax.Array  # chosen log-ratio
    r: jax.Array  # rejected log-ratio
    d: jax.Array  # s_c - s_r (f-divergence scores; c - r for reverse KL)
    d_norm: jax.Array  # s_c / |y_c| - s_r / |y_r| when lengths are given, else d
    beta: jax.Array  # float32 scalar
    eps: Any  # label_smoothing as given (a Python 0 skips the smoothed half)
    chosen_rewards: jax.Array  # b c
    rejected_rewards: jax.Array  # b r
    chosen_nll: Any  # per-pair NLL term of the chosen completion (see ``_sft``), or None
    bco_delta: Any  # BCO's reward shift (a constant)
    policy_margin: jax.Array  # log pi(y_c|x) - log pi(y_r|x) (AOT)
    ref_margin: jax.Array  # log pi_ref(y_c|x) - log pi_ref(y_r|x) (AOT)
    discopop_tau: Any  # DiscoPOP's temperature


def _sigmoid(x: DPOInputs) -> jax.Array:
    """``sigmoid``      -log s(b d)

    DPO: "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
    (Rafailov et al., arXiv:2305.18290), eq. 7. As TRL >= 1.0, label_smoothing is ignored here
    (TRL 0.x applied it: that is ``cdpo``).
    """
    return -jax.nn.log_sigmoid(x.beta * x.d)


def _cdpo(x: DPOInputs) -> jax.Array:
    """``cdpo``         -(1-eps) log s(b d) - eps log s(-b d)

    Conservative DPO (E. Mitchell, "A note on DPO with noisy preferences & relationship to IPO",
    2023, a note without an arXiv id): TRL 0.x's ``sigmoid`` with ``label_smoothing`` eps > 0.
    TRL 1.x has no name for it (its ``sigmoid`` ignores label_smoothing); this one keeps it
    reachable.
    """
    return _smoothed_sigmoid(x.beta * x.d, x.eps)


def _hinge(x: DPOInputs) -> jax.Array:
    """``hinge``        max(0, 1 - b d)

    SLiC-HF ("SLiC-HF: Sequence Likelihood Calibration with Human Feedback", arXiv:2305.10425)
    and RSO ("Statistical Rejection Sampling Improves Preference Optimization",
    arXiv:2309.06657); 1/beta is the margin.
    """
    return jax.nn.relu(1.0 - x.beta * x.d)


def _ipo(x: DPOInputs) -> jax.Array:
    """``ipo``          (d_n - 1/(2 b))^2,  d_n = s_c / |y_c| - s_r / |y_r|

    IPO: "A General Theoretical Paradigm to Understand Learning from Human Preferences"
    (Azar et al., arXiv:2310.12036), eq. 17, beta is the paper's tau. TRL length-normalises the
    IPO scores (TRL >= 1.0 divides the summed scores by the completion token counts, "confirmed
    with the IPO authors"). Pass ``chosen_lengths`` and ``rejected_lengths`` with summed
    log-probs; without lengths the scores are used as given.
    """
    return jnp.square(x.d_norm - 1.0 / (2.0 * x.beta))


def _exo_pair(x: DPOInputs) -> jax.Array:
    """``exo_pair``     q_w (log q_w - log(1-eps)) + q_l (log q_l - log eps),
                     q_w = s(b d), q_l = s(-b d)

    EXO: "Towards Efficient Exact Optimization of Language Model Alignment" (Ji et al.,
    arXiv:2402.00856), eq. 16 with K = 2: KL(p_f || p_rh) between the policy's softmax over
    {chosen, rejected} and the label distribution (1 - eps, eps). Needs eps > 0 (the paper:
    1e-3).
    """
    eps = _f32(x.eps)
    z = x.beta * x.d
    log_qw, log_ql = jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)
    return (jnp.exp(log_qw) * (log_qw - jnp.log1p(-eps))
            + jnp.exp(log_ql) * (log_ql - jnp.log(eps)))


def _robust(x: DPOInputs) -> jax.Array:
    """``robust``       (-(1-eps) log s(b d) + eps log s(-b d)) / (1 - 2 eps),  0 <= eps < 0.5

    Robust DPO: "Provably Robust DPO: Aligning Language Models with Noisy Feedback"
    (Chowdhury et al., arXiv:2403.00409); eps is the label-flip rate.
    """
    eps = _f32(x.eps)
    clean = -(1.0 - eps) * jax.nn.log_sigmoid(x.beta * x.d)
    flipped = -eps * jax.nn.log_sigmoid(-x.beta * x.d)
    return (clean - flipped) / (1.0 - 2.0 * eps)


def _bco_pair(x: DPOInputs) -> jax.Array:
    """``bco_pair``     -log s(b c - delta) - log s(-(b r - delta))

    BCO: "Binary Classifier Optimization for Large Language Model Alignment" (Jung et al.,
    arXiv:2404.04656). delta = ``bco_delta`` is a reward shift, a constant here (no gradient
    flows into it). TRL >= 1.0 uses delta = 0, the default ``bco_delta=0.0``. (TRL 0.x used a
    running mean of the implicit rewards; a caller that wants that keeps the mean itself and
    passes it as ``bco_delta``: the metric ``bco/reward_mean`` gives the batch's reward sum.)
    """
    shift = jax.lax.stop_gradient(_f32(x.bco_delta))
    return -jax.nn.log_sigmoid(x.chosen_rewards - shift) - jax.nn.log_sigmoid(
        -(x.rejected_rewards - shift)
    )


def _sppo_hard(x: DPOInputs) -> jax.Array:
    """``sppo_hard``    (c - 1/(2 b))^2 + (r + 1/(2 b))^2

    SPPO: "Self-Play Preference Optimization for Language Model Alignment" (Wu et al.,
    arXiv:2405.00675), eq. 4.7 with hard winner/loser probabilities 1 and 0 (as TRL).
    """
    half_inv_beta = 0.5 / x.beta
    return jnp.square(x.c - half_inv_beta) + jnp.square(x.r + half_inv_beta)


def _nca_pair(x: DPOInputs) -> jax.Array:
    """``nca_pair``     -log s(b c) - 1/2 log s(-b c) - 1/2 log s(-b r)

    NCA: "Noise Contrastive Alignment of Language Models with Explicit Rewards" (Chen et al.,
    arXiv:2402.05369).
    """
    return (
        -jax.nn.log_sigmoid(x.chosen_rewards)
        - 0.5 * jax.nn.log_sigmoid(-x.chosen_rewards)
        - 0.5 * jax.nn.log_sigmoid(-x.rejected_rewards)
    )


def _aot_loss(delta, x: DPOInputs) -> jax.Array:
    return _smoothed_sigmoid(x.beta * delta, x.eps)


def _aot(x: DPOInputs) -> jax.Array:
    """``aot``          -(1-eps) log s(b D_i) - eps log s(-b D_i),
                     D = sort(log pi(y_c) - log pi(y_r)) - sort(log pi_ref(y_c) - log pi_ref(y_r))

    AOT: "Distributional Preference Alignment of LLMs via Optimal Transport" (Melnyk et al.,
    arXiv:2406.05882), paired variant: the policy's and the reference's margins are each sorted
    over the batch (first-order stochastic dominance via the 1-D optimal transport map), and the
    i-th smallest of each are compared. The sort couples the pairs of a batch: see
    :func:`nnx_posttrain.losses.dpo.dpo` for what this means under gradient accumulation.
    """
    return _aot_loss(jnp.sort(x.policy_margin) - jnp.sort(x.ref_margin), x)


def _aot_unpaired(x: DPOInputs) -> jax.Array:
    """``aot_unpaired`` -(1-eps) log s(b D_i) - eps log s(-b D_i),  D = sort(c) - sort(r)

    AOT (arXiv:2406.05882), unpaired variant: the chosen and the rejected log-ratios are sorted
    separately over the batch.
    """
    return _aot_loss(jnp.sort(x.c) - jnp.sort(x.r), x)


def _apo_zero(x: DPOInputs) -> jax.Array:
    """``apo_zero``     (1 - s(b c)) + s(b r)

    APO: "Anchored Preference Optimization and Contrastive Revisions: Addressing
    Underspecification in Alignment" (D'Oosterlinck et al., arXiv:2408.06266), eq. 7.
    """
    return jax.nn.sigmoid(-x.chosen_rewards) + jax.nn.sigmoid(x.rejected_rewards)


def _apo_down(x: DPOInputs) -> jax.Array:
    """``apo_down``     s(b c) + (1 - s(b (c - r)))

    APO (arXiv:2408.06266), eq. 8.
    """
    return jax.nn.sigmoid(x.chosen_rewards) + jax.nn.sigmoid(-x.beta * (x.c - x.r))


def _discopop(x: DPOInputs) -> jax.Array:
    """``discopop``     (1 - m) (-log s(z)) + m e^(-z),  z = b d,  m = s(z / tau)

    DiscoPOP, the log-ratio modulated loss discovered in "Discovering Preference Optimization
    Algorithms with and for Large Language Models" (Chris Lu et al., arXiv:2406.08414), eq. 5;
    tau = ``discopop_tau`` (0.05 in the paper and TRL). The exponent of e^(-z) is capped at 80,
    where m < s(-1600) = 0 in float32 already, so the product stays 0 instead of 0 x inf.
    """
    z = x.beta * x.d
    mod = jax.nn.sigmoid(z / _f32(x.discopop_tau))
    return -jax.nn.log_sigmoid(z) * (1.0 - mod) + jnp.exp(jnp.minimum(-z, 80.0)) * mod


def _sigmoid_norm(x: DPOInputs) -> jax.Array:
    """``sigmoid_norm`` -log s(b (s_c / |y_c| - s_r / |y_r|))

    Length-normalised DPO of Tülu 3 ("Tülu 3: Pushing Frontiers in Open Language Model
    Post-Training", arXiv:2411.15124, eq. 6), after SimPO's length normalisation (arXiv:
    2405.14734) but keeping the reference model; TRL's ``sigmoid_norm`` (the summed scores
    divided by the completion token counts, clamped to >= 1). Requires ``chosen_lengths`` and
    ``rejected_lengths`` (typical beta: 2 to 5, not 0.1).
    """
    return -jax.nn.log_sigmoid(x.beta * x.d_norm)


def _sft(x: DPOInputs) -> jax.Array:
    """``sft``          ``chosen_nll``

    The negative log-likelihood of the chosen completion (RPO, "Iterative Reasoning Preference
    Optimization", arXiv:2404.19733; the generation term of MPO). TRL's term is the token-mean
    cross-entropy over all chosen completion tokens of the batch, -mean(logp_t); pass
    ``chosen_nll`` = :func:`nnx_posttrain.losses.common.token_mean_terms` of the per-example
    summed NLLs, whose mean over the pairs is exactly that token mean (also summed over
    micro-batches).
    """
    return jnp.broadcast_to(_f32(x.chosen_nll), x.d.shape)


DPO_TERMS: dict[str, Callable[[DPOInputs], jax.Array]] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sft": _sft,
    "sigmoid_norm": _sigmoid_norm,
    "cdpo": _cdpo,
}
DPO_LOSS_TYPES = tuple(DPO_TERMS)
# the terms built on the chosen - rejected score difference: the only ones TRL lets an
# f-divergence other than reverse KL change (the others have no valid generalisation)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust",
                           "discopop", "sft", "cdpo")
# terms whose per-pair values depend on the other pairs of the batch (they sort it)
BATCH_COUPLED_LOSS_TYPES = ("aot", "aot_unpaired")
