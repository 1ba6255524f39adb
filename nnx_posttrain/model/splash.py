"""Pallas splash attention (TPU; ``jax.experimental.pallas.ops.tpu.splash_attention``), the
``splash`` path of ``attention.attend``: causal or local mask, segment ids and the soft cap inside
the kernel (no attention sinks: ``attention`` resolves a layer with sinks to another path), per
batch row and kv head through the MQA kernel; under a mesh of several devices, per device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nnx_posttrain.families import LayerSpec


def splash(q, k, v, segment_ids, spec: LayerSpec, interpret: bool):
    """q [B, T, K, G, H], k / v [B, T, K, H] through splash attention's MQA kernel per batch row
    and kv head. XLA cannot partition a Pallas kernel over a mesh: under a mesh of several
    devices (``jax.set_mesh``: the run's) it runs per device (``jax.shard_map``), on the batch
    rows of the mesh's batch axes and, where the kv heads divide by it, the heads of the
    ``tensor`` axis (else each tensor-parallel device computes every head of its rows)."""
    from jax.sharding import PartitionSpec as P

    from nnx_posttrain.sharding import context_row_axes

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _splash_local(q, k, v, segment_ids, spec, interpret)
    rows = context_row_axes(q.shape[0])
    tensor = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("tensor", 1)
    heads = "tensor" if tensor > 1 and q.shape[2] % tensor == 0 else None
    qs, kvs, seg = P(rows, None, heads, None, None), P(rows, None, heads, None), P(rows, None)
    local = functools.partial(_splash_local, spec=spec, interpret=interpret)
    return jax.shard_map(local, mesh=mesh, in_specs=(qs, kvs, kvs, seg), out_specs=qs,
                         check_vma=False)(q, k, v, segment_ids)


def _splash_local(q, k, v, segment_ids, spec: LayerSpec, interpret: bool):
    """``splash`` on one device's arrays."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, kv, g, h = q.shape
    if spec.window:
        one = sm.LocalMask((t, t), window_size=(spec.window - 1, 0), offset=0)
    else:
        one = sm.CausalMask((t, t))
    block = min(512, t)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * g), block_sizes=sizes,
                                              attn_logits_soft_cap=spec.soft_cap,
                                              interpret=interpret)
    qh = jnp.transpose(q * jnp.asarray(spec.scale, q.dtype), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
    kh, vh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))  # [B, K, T, H]
    seg = sk.SegmentIds(q=segment_ids, kv=segment_ids)
    per_head = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s), in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qh, kh, vh, seg)  # [B, K, G, T, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4))
