"""KTO: unpaired desirable / undesirable examples against a KL reference point, and its options.
Written from TRL 1.16.0's ``trl/trainer/kto_trainer.py`` (the ``loss_type`` branches of
``KTOTrainer._compute_loss``). Conventions (``(total, weight, metrics)``, summed log-probs,
options): see :mod:`nnx_posttrain.losses.common`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import Metrics, Options, _count, _f32, _mean_metric, flag

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclasses.dataclass(frozen=True)
class KTOOptions(Options):
    """KTO's options: TRL's KTOConfig names and defaults (``--algo.*`` of ``kto``). The paper
    recommends weights with desirable_weight n_D / (undesirable_weight n_U) in [1, 4/3]."""

    beta: float = 0.1
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto, or apo_zero_unpaired (APO-zero on unpaired data: no KL reference point)."""
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def calculate_kl(self) -> bool:
        """TRL's ``calculate_KL``: apo_zero_unpaired needs no KL rows (z0 = 0)."""
        return self.loss_type == "kto"

    def problems(self) -> list[str]:
        if self.loss_type not in KTO_LOSS_TYPES:
            return [f"{flag('loss_type')}: unknown KTO loss_type {self.loss_type!r}; expected "
                    f"one of {', '.join(KTO_LOSS_TYPES)}"]
        return []


class KTOExamples(NamedTuple):
    """The arrays of :func:`kto`, ``[batch]``: the policy's and the reference's *summed*
    log-probs of each example, its label (1/True desirable, 0/False undesirable), the policy's
    and the reference's log-probs of the mismatched completions (the KL rows; None without), or
    ``kl``, a reference point given instead of the estimate (e.g. one shared over all
    micro-batches of a step, which makes the accumulation exact)."""

    policy_logps: jax.Array
    ref_logps: jax.Array
    labels: jax.Array
    kl_policy_logps: jax.Array | None = None
    kl_ref_logps: jax.Array | None = None
    kl: jax.Array | float | None = None


def reference_point(examples: KTOExamples, options: KTOOptions) -> jax.Array:
    """z0 = max(0, mean_j [log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)]), detached: from the KL
    rows, or ``examples.kl``; 0 for apo_zero_unpaired and without KL rows (TRL's
    ``calculate_KL=False``)."""
    kl = 0.0 if not options.calculate_kl else examples.kl
    if kl is None:
        if examples.kl_policy_logps is None and examples.kl_ref_logps is None:
            kl = jnp.zeros((), jnp.float32)
        else:
            kl = jnp.mean(_f32(examples.kl_policy_logps) - _f32(examples.kl_ref_logps))
    return jax.lax.stop_gradient(jnp.maximum(_f32(kl), 0.0))


def kto(examples: KTOExamples, options: KTOOptions):
    r"""KTO: unpaired desirable / undesirable examples against a KL reference point.

        rho = log pi(y|x) - log pi_ref(y|x)
        z0  = max(0, mean_j [log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)]), no gradient
        desirable   (label 1): lambda_D * (1 - s(beta (rho - z0)))
        undesirable (label 0): lambda_U * (1 - s(beta (z0 - rho)))

    "KTO: Model Alignment as Prospect Theoretic Optimization" (Ethayarajh et al.,
    arXiv:2402.01306), eq. 7, as TRL's KTOTrainer (``loss_type="kto"``). The KL reference point
    z0 (:func:`reference_point`) is estimated from mismatched completions y'_j (each prompt
    paired with another example's completion: TRL shifts the completions by one within the
    batch). TRL computes z0 per process as the mean over its micro-batch, detached, gathers the
    per-process means, averages them (equal to the global mean when every process has the same
    batch size) and clamps at 0. Under JAX SPMD a ``[global batch]`` array already gives that
    global mean.

    ``loss_type="apo_zero_unpaired"`` (TRL's KTOTrainer): the unpaired APO-zero loss of "Anchored
    Preference Optimization and Contrastive Revisions" (arXiv:2408.06266, eq. 7), without a
    reference point: desirable lambda_D (1 - s(beta rho)), undesirable lambda_U s(beta rho); no
    KL rows are needed, z0 is 0.

    Metrics: ``kl`` = (z0, 1) per call (TRL logs the per-batch z0 and averages the logged
    values); ``rewards/chosen`` = beta rho over desirable examples, ``rewards/rejected`` over
    undesirable ones, ``logps/chosen``, ``logps/rejected`` likewise (so counts differ: the number
    of desirable vs undesirable examples, exactly as TRL's ``*_sum`` / ``count/*`` bookkeeping;
    a count may be 0); ``loss`` over all examples. TRL's ``rewards/margins`` is the difference of
    the two reward means, computed when logging.
    """
    policy, ref = _f32(examples.policy_logps), _f32(examples.ref_logps)
    desirable = (jnp.asarray(examples.labels) > 0).astype(jnp.float32)
    beta = _f32(options.beta)
    kl = reference_point(examples, options)
    logratios = policy - ref
    # 1 - s(x) = s(-x): no cancellation when s(x) is close to 1.
    # (1 - s(beta (rho - z0))) and (1 - s(beta (z0 - rho))); apo_zero_unpaired has z0 = 0, the
    # same expressions as TRL's 1 - s(beta rho) and s(beta rho)
    desirable_loss = jax.nn.sigmoid(-beta * (logratios - kl))
    undesirable_loss = jax.nn.sigmoid(-beta * (kl - logratios))
    per_example = jnp.where(desirable > 0, _f32(options.desirable_weight) * desirable_loss,
                            _f32(options.undesirable_weight) * undesirable_loss)
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
