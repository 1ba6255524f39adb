"""Blocked exact attention with an online softmax (the ``xla`` path past one chunk of queries).

``flash(q, k, v, segment_ids, spec, block)`` equals ``softmax(q k^T * scale + mask) v`` (the mask
from segment ids, causality and an optional sliding window: ``allowed``, which every ``xla`` /
``cudnn`` path of ``attention`` shares) but never holds more than one ``block x block`` tile of
scores per (batch row, head): the forward
pass walks the key blocks a query block can see (causal and window skipping: a ``while`` loop
over ``[first visible block, diagonal block]``, skipping tiles where no query and key share a
segment: packed rows cost what their examples cost) with a running max and sum, and keeps only the
output and the row log-sum-exp; the backward pass (a ``custom_vjp``) recomputes each tile's
probabilities from that log-sum-exp and accumulates dq, dk, dv. Attention sinks (GPT-OSS:
``spec.sinks``, one logit per query head in every softmax's denominator) start each query's
running max and sum (max = the sink, sum = 1); their gradient is ``-sum(p_sink * delta)``.
Memory is O(T) in the sequence
length, plus one tile: the FlashAttention algorithm (Dao et al., 2022), written in plain JAX so
that XLA:CPU runs it and any backend can.

Layout: q [B, T, K, G, H] (K kv heads, G query heads per kv head), k / v [B, T, K, H], segment ids
[B, T] int32; tiles of scores [B, Cq, K, G, Ck] in float32.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

NEG = -1e30  # a masked score: finite (no NaN), exp(NEG - max) = 0 in float32
# Segment ids of a shared-prefix row (``algorithms.shared_prompt``): ``s`` is example s's shared
# prefix (a preference pair's prompt), ``s + k * BRANCH`` (k = 1, 2) its k-th branch (the chosen /
# rejected completion), which sees the prefix and itself but not the other branch.
BRANCH = 2**20


def example_of(seg):
    """The example a segment id belongs to (its branches' ids carry ``BRANCH`` multiples)."""
    return jnp.where(seg > 0, seg % BRANCH, seg)


class Visible(NamedTuple):
    """Which keys each query sees (``allowed``): the queries' and the keys' segment ids
    [B, C] / [B, S] and positions [C] / [S]."""

    seg_q: jax.Array
    seg_k: jax.Array
    pos_q: jax.Array
    pos_k: jax.Array


def allowed(seg_q, seg_k, pos_q, pos_k, window):
    """[batch, Tq, S] bool: same segment (or the key in the shared prefix of the query's branch,
    ``BRANCH``), key not later, within the window."""
    sq, sk = seg_q[:, :, None], seg_k[:, None, :]
    same = (sq == sk) | ((sq > BRANCH) & (sk == sq % BRANCH))
    ok = same & (pos_k[None, None, :] <= pos_q[None, :, None])
    if window:
        ok &= pos_q[None, :, None] - pos_k[None, None, :] < window
    return ok


def _pad(x, length):
    pad = length - x.shape[1]
    return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _first_block(i, block, window):
    """The first key block that query block ``i`` can see."""
    if not window:
        return 0
    return jnp.maximum(0, (i * block - window + 1) // block)


def _needed(seg, block):
    """[blocks, blocks] bool: some query of block i and key of block j share an example in some
    batch row (tested on each block's [min, max] segment range: packed rows' tiles between two
    different examples are skipped, as a varlen kernel skips them)."""
    b, t = seg.shape
    tiles = example_of(seg).reshape(b, t // block, block)
    low, high = tiles.min(-1), tiles.max(-1)  # [B, blocks]
    overlap = (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])
    return jnp.any(overlap, axis=0)


def _tile(q, k, segs: tuple, ij: tuple, block, spec):
    """Scores of query block i against key block j (``ij``; ``segs``: their segment ids): (s [B,
    C, K, G, C] float32 after scale and soft cap, with masked entries at NEG; capped tanh for the
    backward pass or None)."""
    (seg_q, seg_k), (i, j) = segs, ij
    s = jnp.einsum("bqkgh,bskh->bqkgs", q, k).astype(jnp.float32)
    if spec.scale_scores:
        s = s * spec.scale
    cap = None
    if spec.soft_cap is not None:
        cap = jnp.tanh(s / spec.soft_cap)
        s = cap * spec.soft_cap
    ok = allowed(seg_q, seg_k, i * block + jnp.arange(block), j * block + jnp.arange(block),
                 spec.window)
    return jnp.where(ok[:, :, None, None, :], s, NEG), cap


def _over_keys(i, needed, block, window, tile, init):
    """``tile(j, carry)`` over the key blocks j that query block i sees (from the first one in its
    window to the diagonal) and needs (``_needed``); the others leave ``carry`` as it is."""
    def key_block(j, carry):
        return jax.lax.cond(needed[i, j], partial(tile, j), lambda c: c, carry)

    return jax.lax.fori_loop(_first_block(i, block, window), i + 1, key_block, init)


def _slice(x, index, block):
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=1)


def _start(sinks, shape):
    """The running max and sum before any key: (NEG, 0), or with sink logits [K, G] (sink, 1)."""
    if sinks is None:
        return jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(sinks, shape), jnp.ones(shape, jnp.float32)


def _forward(qkv, sinks, seg, spec, block):
    """(out [B, T, K, G, H] in q's dtype, lse [B, T, K, G] float32) of ``qkv`` = (q, k, v), q
    already scaled; ``sinks``: sink logits [K, G] or None."""
    q, k, v = qkv
    b, t, kv, g, h = q.shape
    blocks = t // block
    needed = _needed(seg, block)

    def query_block(i):
        qi, si = _slice(q, i, block), _slice(seg, i, block)

        def tile(j, carry):
            m, l, acc = carry
            s, _ = _tile(qi, _slice(k, j, block), (si, _slice(seg, j, block)), (i, j), block, spec)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bqkgs,bskh->bqkgh", p.astype(v.dtype), _slice(v, j, block))
            return m_new, l, acc * correction[..., None] + pv.astype(jnp.float32)

        init = _start(sinks, (b, block, kv, g)) + (jnp.zeros((b, block, kv, g, h), jnp.float32),)
        m, l, acc = _over_keys(i, needed, block, spec.window, tile, init)
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(blocks))  # [blocks, B, C, ...]
    merge = lambda x: jnp.moveaxis(x, 0, 1).reshape((b, t) + x.shape[3:])  # noqa: E731
    return merge(out), merge(lse)


def _backward(residuals, dout, spec, block):
    """dq, dk, dv (float32) of the scaled-query attention, recomputing each tile from ``lse``
    (``residuals``: q, k, v, seg, out, lse of the forward pass)."""
    q, k, v, seg, out, lse = residuals
    b, t, kv, g, h = q.shape
    blocks = t // block
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, K, G]
    needed = _needed(seg, block)

    def query_block(i, carry):
        dq, dk, dv = carry
        qi, si, doi = _slice(q, i, block), _slice(seg, i, block), _slice(dout, i, block)
        lse_i, delta_i = _slice(lse, i, block), _slice(delta, i, block)

        def tile(j, inner):
            dq_i, dk, dv = inner
            kj, vj = _slice(k, j, block), _slice(v, j, block)
            s, cap = _tile(qi, kj, (si, _slice(seg, j, block)), (i, j), block, spec)
            p = jnp.exp(s - lse_i[..., None])  # masked entries: exp(NEG - lse) = 0
            dp = jnp.einsum("bqkgh,bskh->bqkgs", doi, vj).astype(jnp.float32)
            ds = p * (dp - delta_i[..., None])
            if cap is not None:
                ds = ds * (1 - cap * cap)
            if spec.scale_scores:
                ds = ds * spec.scale
            ds = ds.astype(q.dtype)
            dq_i = dq_i + jnp.einsum("bqkgs,bskh->bqkgh", ds, kj).astype(jnp.float32)
            dk_j = jnp.einsum("bqkgs,bqkgh->bskh", ds, qi).astype(jnp.float32)
            dv_j = jnp.einsum("bqkgs,bqkgh->bskh", p.astype(v.dtype), doi).astype(jnp.float32)
            dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, j, block) + dk_j, j * block, 1)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, j, block) + dv_j, j * block, 1)
            return dq_i, dk, dv

        dq_i = jnp.zeros((b, block, kv, g, h), jnp.float32)
        dq_i, dk, dv = _over_keys(i, needed, block, spec.window, tile, (dq_i, dk, dv))
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, 1), dk, dv

    zeros_q = jnp.zeros(q.shape, jnp.float32)
    zeros_k = jnp.zeros(k.shape, jnp.float32)
    return jax.lax.fori_loop(0, blocks, query_block, (zeros_q, zeros_k, zeros_k))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(qkv, sinks, seg, spec, block):
    return _forward(qkv, sinks, seg, spec, block)[0]


def _flash_fwd(qkv, sinks, seg, spec, block):
    out, lse = _forward(qkv, sinks, seg, spec, block)
    return out, (*qkv, seg, out, lse, sinks)


def _flash_bwd(spec, block, residuals, dout):
    q, k, v = residuals[:3]
    dq, dk, dv = _backward(residuals[:6], dout, spec, block)
    sinks, dsinks = residuals[6], None
    if sinks is not None:  # d sink = -sum over rows and queries of p_sink * delta
        lse, out = residuals[5], residuals[4]
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        dsinks = -jnp.sum(jnp.exp(sinks - lse) * delta, axis=(0, 1))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)), dsinks, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash(q, k, v, segment_ids, spec, block: int):
    """q [B, T, K, G, H], k / v [B, T, K, H], segment_ids [B, T] -> [B, T, K, G, H]; ``spec`` an
    ``attention.LayerSpec`` (its ``sinks``, if any, as float32 logits [K, G]). T is padded to a
    multiple of ``block`` (padding: segment -1, seen by no real query) and cut back."""
    t = q.shape[1]
    block = min(block, t)
    length = -(-t // block) * block
    if not spec.scale_scores:
        q = q * jnp.asarray(spec.scale, q.dtype)
    seg = jnp.pad(segment_ids, [(0, 0), (0, length - t)], constant_values=-1)
    sinks, spec = spec.sinks, dataclasses.replace(spec, sinks=None)  # an array: differentiated
    out = _flash((_pad(q, length), _pad(k, length), _pad(v, length)), sinks, seg, spec, block)
    return out[:, :t]
