"""Router logits of a mixture-of-experts backbone, captured during its forward pass.

KerasHub's MoE blocks compute each token's router logits and drop them (research P7), so the
load-balancing loss (``losses.router``) has nothing to read. Within ``captured(module, coef)``,
each MoE block's router layer (its family's ``MoE.router``) keeps its output as it computes it;
``hidden_states`` notes each forward pass's padding rows (``note_rows``); blocks under
``jax.checkpoint`` hand what they captured out as outputs (``blocks.SINKS``). ``Capture.routed()``
then gives the ``Routed`` arrays of the passes, or None for a dense model.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain import errors, families
from nnx_posttrain.model.blocks import SINKS, decoder_blocks, shadowed

_ACTIVE: list = []  # the captures open now


class Routed(NamedTuple):
    """The router logits of a step's forward passes (``losses.router.with_router_aux``):
    ``logits`` [layers, rows, experts] (rows: batch x positions of every pass), ``mask`` [rows]
    (1 for a real token), the experts per token and the loss's coefficient."""

    logits: jax.Array
    mask: jax.Array
    top_k: int
    coef: float


class Capture:
    """What ``captured`` collects: per forward pass, one [rows, experts] array per MoE layer and
    the pass's real-token rows."""

    def __init__(self, module, layers: int, top_k: int, coef: float):
        self.module, self.layers, self.top_k, self.coef = module, layers, top_k, coef
        self.logits: list = []
        self.rows: list = []

    def routed(self) -> Routed | None:
        if not self.layers or not self.logits:
            return None
        n = self.layers
        passes = [jnp.stack([x.reshape(-1, x.shape[-1]) for x in self.logits[i:i + n]])
                  for i in range(0, len(self.logits), n)]
        masks = self.rows if len(self.rows) == len(passes) else [
            jnp.ones(p.shape[1], jnp.float32) for p in passes]
        return Routed(jnp.concatenate(passes, axis=1), jnp.concatenate(masks), self.top_k,
                      self.coef)


class _Dense:
    def routed(self):
        return None


@contextlib.contextmanager
def captured(module, coef: float | None = None):
    """Within the block, ``module``'s forward passes (``hidden_states``) keep their router logits
    (``Capture``); ``coef`` None: the family's coefficient (``MoE.aux_coef``). A dense model: a
    capture of nothing."""
    family = families.of(module)
    routers = [] if family is None or family.moe is None else _routers(module)
    if not routers:  # a dense model (Gemma 4's dense sizes share the family of 26B-A4B)
        yield _Dense()
        return
    if getattr(module, "_nnx_posttrain_remat", False) == "lazy_frozen":
        if coef == 0:  # off, and not logged: the lazily read blocks cannot hand logits out
            yield _Dense()
            return
        raise errors.ConfigError(
            f"{family.name}: the router load-balancing loss is not computed with the lazily read "
            "frozen blocks of a bfloat16 model on CPU; use --dtype float32, or "
            "--algo.router-aux-loss-coef 0")
    capture = Capture(module, len(routers), family.moe.top_k(module),
                      family.moe.aux_coef(module) if coef is None else float(coef))
    _ACTIVE.append(capture)
    SINKS.append(capture.logits)
    try:
        yield capture
    finally:
        SINKS.remove(capture.logits)
        _ACTIVE.remove(capture)


def _routers(module) -> list:
    family = families.of(module)
    return [r for r in (family.moe.router(b) for b in decoder_blocks(module)) if r is not None]


@contextlib.contextmanager
def recording(module, padding_mask):
    """``hidden_states``, inside its other overrides of the projections: while a capture is open
    on ``module``, its router layers keep their outputs and the pass's real-token rows
    [batch x positions] are noted."""
    captures = [c for c in _ACTIVE if c.module is module]
    if not captures:
        yield
        return
    for capture in captures:
        capture.rows.append(jnp.asarray(padding_mask).reshape(-1).astype(jnp.float32))

    def keep(layer, original):
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            for capture in captures:
                capture.logits.append(out)
            return out
        return call

    with shadowed(_routers(module), "call", keep):
        yield
