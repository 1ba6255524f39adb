"""The router load-balancing loss of mixture-of-experts models (Switch Transformer, eqs. 4-6), as
transformers 5.24 defines it (``load_balancing_loss_func``, the same in its Mixtral, Qwen3-MoE,
Qwen3.5-MoE and GPT-OSS models) and TRL 1.16 adds it to its SFT / DPO losses. Imports jax and
``nnx_posttrain.errors`` only.

Every MoE layer's router rows are pooled (rows of padding left out)::

    tokens_per_expert[e] = mean over (layer, token) of 1[e in top_k(softmax(logits))]
    router_prob[e]       = mean over (layer, token) of softmax(logits)[e]
    aux                  = num_experts * sum_e tokens_per_expert[e] * router_prob[e]

``tokens_per_expert`` sums to ``top_k``, so a perfectly balanced router gives ``aux = top_k``.
The training loss is the algorithm's mean loss plus ``router_aux_loss_coef * aux`` per micro-batch
(``with_router_aux``), as transformers' causal-LM forward adds it.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from nnx_posttrain.losses.common import Options


@dataclasses.dataclass(frozen=True)
class RouterOptions(Options):
    router_aux_loss_coef: float | None = None
    """Weight of the router load-balancing loss of a mixture-of-experts model (TRL's
    ``router_aux_loss_coef``): None takes the model family's (its released config's: Qwen3-MoE
    0.001, Mixtral 0.02, Gemma 4 none: 0); 0 turns it off (its metrics are still logged).
    Ignored for a dense model."""

    def problems(self):
        coef = self.router_aux_loss_coef
        bad = coef is not None and not (isinstance(coef, (int, float)) and coef >= 0)
        return super().problems() + (
            [f"--algo.router-aux-loss-coef must be >= 0 (or unset: the model's), got {coef!r}"]
            if bad else [])


def load_balancing(logits, top_k: int, mask=None) -> tuple[jax.Array, jax.Array]:
    """``(aux, tokens_per_expert)`` of router ``logits`` [layers, rows, experts] (the
    module docstring's formula), ``mask`` [rows] (None: every row)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    experts = probs.shape[-1]
    _, chosen = jax.lax.top_k(probs, top_k)
    counts = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(-2)  # [layers, rows, E]
    w = jnp.ones(probs.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    rows = jnp.maximum(w.sum() * probs.shape[0], 1.0)
    tokens_per_expert = jnp.einsum("lre,r->e", counts, w) / rows
    router_prob = jnp.einsum("lre,r->e", probs, w) / rows
    return experts * jnp.sum(tokens_per_expert * router_prob), tokens_per_expert


# tokens per expert logged one metric per expert up to this many experts (beyond: min and max)
EXPERTS_LOGGED = 16


def with_router_aux(result: tuple, routed) -> tuple:
    """A loss's ``(total, weight, metrics)`` with the router's load-balancing loss added
    (``coef * aux`` to the mean: ``coef * aux * weight`` to the total), ``aux_loss`` (TRL's name)
    and the tokens per expert (``moe/tokens_per_expert/E``, a share of the routed tokens:
    balanced is top_k / experts; ``moe/max_tokens_per_expert``, ``moe/min_tokens_per_expert``)
    in its metrics. ``routed`` (``model.router.Routed``): ``logits`` [layers, rows, experts],
    ``mask`` [rows], ``top_k``, ``coef``; None (a dense model): the result unchanged."""
    if routed is None:
        return result
    total, weight, metrics = result
    aux, tokens = load_balancing(routed.logits, routed.top_k, routed.mask)
    total = total + routed.coef * jax.lax.stop_gradient(weight) * aux
    one = jnp.float32(1.0)
    out = dict(metrics, aux_loss=(aux, one))
    out["moe/max_tokens_per_expert"] = (tokens.max(), one)
    out["moe/min_tokens_per_expert"] = (tokens.min(), one)
    if tokens.shape[0] <= EXPERTS_LOGGED:
        out.update({f"moe/tokens_per_expert/{e}": (tokens[e], one) for e in range(tokens.shape[0])})
    return total, weight, out
