"""Distillation: the generalized Jensen-Shannon divergence between a student's and a teacher's
next-token distributions (Agarwal et al. 2023, "On-Policy Distillation of Language Models",
arXiv:2306.13649; TRL 1.16's ``DistillationTrainer`` and GKD). Imports jax only.

With p_s, p_t the student's and the teacher's distributions (logits divided by ``temperature``)
and the mixture m = (1 - beta) p_s + beta p_t:

    JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)      (0 < beta < 1)
    beta = 0: KL(p_t || p_s) (forward KL)    beta = 1: KL(p_s || p_t) (reverse KL, TRL's default)

The gradient reaches the student only. ``gkd`` sums the per-token divergences over the
completion tokens (TRL's token mean, exact under gradient accumulation: see ``common``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def divergence(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """(per-position divergence, the student's entropy without gradient), both ``[...]``, from
    float32 logits ``[..., vocab]``. ``beta`` (a Python float) picks the divergence."""
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
