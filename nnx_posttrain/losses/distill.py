"""Distillation: the generalized Jensen-Shannon divergence between a student's and a teacher's
next-token distributions (Agarwal et al. 2023, "On-Policy Distillation of Language Models",
arXiv:2306.13649; TRL 1.16's ``DistillationTrainer`` and GKD).

With p_s, p_t the student's and the teacher's distributions (logits divided by ``temperature``)
and the mixture m = (1 - beta) p_s + beta p_t:

    JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)      (0 < beta < 1)
    beta = 0: KL(p_t || p_s) (forward KL)    beta = 1: KL(p_s || p_t) (reverse KL, TRL's default)

The gradient reaches the student only. ``gkd`` sums the per-token divergences over the
completion tokens (TRL's token mean, exact under gradient accumulation: see ``common``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import Options, out_of_range


@dataclasses.dataclass(frozen=True)
class DistillOptions(Options):
    """Distillation's loss options: TRL 1.16 DistillationConfig's / GKDConfig's names and
    defaults (``--algo.*`` of ``distill``, with its teacher and sampling options)."""

    beta: float = 1.0
    """Generalized JSD interpolation (TRL's): 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the JSD with mixture (1 - beta) p_student + beta p_teacher."""
    temperature: float = 1.0
    """Divides both models' logits in the loss (after Gemma's final soft cap) and the student's when it samples."""

    def problems(self) -> list[str]:
        return (out_of_range(self, "beta", 0.0 <= self.beta <= 1.0, "in [0, 1]")
                + out_of_range(self, "temperature", self.temperature > 0, "> 0"))


def divergence(student_logits, teacher_logits, options: DistillOptions):
    """(per-position divergence, the student's entropy without gradient), both ``[...]``, from
    float32 logits ``[..., vocab]``. ``options.beta`` (a Python float) picks the divergence,
    ``options.temperature`` divides both logits."""
    beta, temperature = options.beta, options.temperature
    log_ps = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    log_pt = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits / temperature, axis=-1))
    ps, pt = jnp.exp(log_ps), jnp.exp(log_pt)
    if beta == 0.0:
        div = jnp.sum(pt * (log_pt - log_ps), axis=-1)
    elif beta == 1.0:
        div = jnp.sum(ps * (log_ps - log_pt), axis=-1)
    else:
        log_m = jnp.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
        div = (beta * jnp.sum(pt * (log_pt - log_m), axis=-1)
               + (1.0 - beta) * jnp.sum(ps * (log_ps - log_m), axis=-1))
    entropy = jax.lax.stop_gradient(-jnp.sum(ps * log_ps, axis=-1))
    return div, entropy


def gkd(per_token, entropy, loss_mask):
    """``(total, weight, metrics)``: the divergence summed over the tokens where ``loss_mask``
    is 1, their number, and TRL's ``loss`` and ``entropy`` (the student's, in nats)."""
    mask = loss_mask.astype(jnp.float32)
    total, tokens = jnp.sum(per_token * mask), jnp.sum(mask)
    return total, tokens, {"loss": (total, tokens), "entropy": (jnp.sum(entropy * mask), tokens)}
