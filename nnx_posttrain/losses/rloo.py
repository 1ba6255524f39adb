"""RLOO's policy loss and its options, as TRL 1.16's RLOOTrainer (``trl/trainer/rloo_trainer.py``,
``RLOOTrainer._compute_loss``); its advantages are :func:`nnx_posttrain.losses.rl.leave_one_out_advantages`.
Shapes and the ``(total, weight, metrics)`` convention: see :mod:`nnx_posttrain.losses.rl`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from nnx_posttrain.losses.common import Options, flag
from nnx_posttrain.losses.grpo import PolicyInputs, _clip_metrics, _Counts


@dataclasses.dataclass(frozen=True)
class RLOOOptions(Options):
    """RLOO's options: TRL 1.16 RLOOConfig's names and defaults (``--algo.*`` of ``rloo``, with
    the sampling options of every online algorithm)."""

    beta: float = 0.05
    """Weight of the sequence KL (sum of log pi_old - log pi_ref) subtracted from the reward."""
    epsilon: float = 0.2
    """Lower clipping range of the sequence ratio."""
    epsilon_high: float | None = None
    """Upper clipping range; default: epsilon."""
    normalize_advantages: bool = False
    """(A - mean) / (std + 1e-4) over the batch."""
    reward_clip_range: tuple[float, float] | None = None
    """Clip the rewards to (min, max) before the KL penalty."""

    @property
    def eps_high(self) -> float:
        """The upper clipping range: ``epsilon_high``, default ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def problems(self) -> list[str]:
        clip = self.reward_clip_range
        if clip is not None and clip[0] > clip[1]:
            return [f"{flag('reward_clip_range')}: min {clip[0]} > max {clip[1]}"]
        return []


def rloo_loss(inputs: PolicyInputs, options: RLOOOptions):
    r"""RLOO's policy loss as TRL 1.16's ``RLOOTrainer._compute_loss``: one importance ratio per
    *sequence*, clipped, averaged over sequences.

        w_i = exp(sum_t logp_it - sum_t old_it)        (masked sums over the completion)
        l_i = -min(w_i A_i, clip(w_i, 1 - e_l, 1 + e_h) A_i),   loss = mean_i l_i

    REINFORCE Leave-One-Out (Ahmadian et al., arXiv:2402.14740) with PPO's clip for
    ``num_iterations`` > 1 (e_l = ``epsilon``, e_h = ``epsilon_high``, default e_l).
    ``(total, weight)`` = (sum of l_i, sequences): exact under accumulation. A sequence whose
    mask is all 0 (e.g. ``mask_truncated_completions``) has w = 1 and no gradient, but counts in
    the mean, as TRL. ``inputs.ref_logps`` is not read (RLOO's KL is in the reward). Metrics:
    ``loss``, ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (per sequence),
    ``entropy`` (token mean).
    """
    m = inputs.mask.astype(jnp.float32)
    adv = jnp.asarray(inputs.advantages, jnp.float32)
    ratio = jnp.exp((inputs.logps * m).sum(-1) - (inputs.old_logps * m).sum(-1))
    clipped = jnp.clip(ratio, 1.0 - options.epsilon, 1.0 + options.eps_high)
    per_seq = -jnp.minimum(ratio * adv, clipped * adv)
    rows, tokens = jnp.asarray(m.shape[0], jnp.float32), m.sum()
    total = per_seq.sum()
    metrics = {"loss": (total, rows)}
    metrics.update(_clip_metrics(ratio[:, None], adv[:, None], _Counts(m, tokens, rows, True),
                                 (options.epsilon, options.eps_high)))
    if inputs.entropies is not None:
        metrics["entropy"] = ((inputs.entropies * m).sum(), tokens)
    return total, rows, metrics
