"""Qwen 3.5's Gated DeltaNet in the package's forward passes (``Family.recurrent_call``): KerasHub's
``Qwen3_5GatedDeltaNet.call`` with its chunked gated delta rule computed as a triangular solve per
chunk and one ``lax.scan`` over the chunks, the same values and gradients up to float rounding
(tests/test_gated_delta_net.py).

KerasHub's ``_chunk_gated_delta_rule`` (Hugging Face's ``torch_chunk_gated_delta_rule``) unrolls
two Python loops: 63 steps per chunk that invert ``I + L`` (``L``: the chunk's strictly lower
``beta k k^T`` scaled by the decay) one row at a time, and one step per chunk. Traced, that is
thousands of small operations: the gradient of one tiny layer took ~20 s to compile on a CPU (one
chunk of 64 positions; a real-length sequence repeats the chunk step per 64 positions); eager, each
operation compiles for its own shape (minutes). Here the rows are one ``solve_triangular``
(``(I + L)^-1``, the matrix the loop builds; on the CPU one matrix per LAPACK call, see
``unit_lower_inverse``), the chunks' independent parts are computed for all chunks at once, and
the state runs through a scan: a program of fixed size, whatever the length.

The causal depthwise convolution before the rule is ``causal_conv1d``: the kernel's few taps as
shifted products on the channels-last projection, the numbers of KerasHub's ``_causal_conv1d``
(a grouped convolution on channels-first inputs) without its convolution, whose weight gradient
the TPU compiler of JAX 0.10.2 (libtpu 0.0.42) rejects at Qwen3.5-35B-A3B's 8,192 channels.

The decoding paths (a cache: the sampler's prompt pass and its steps) stay KerasHub's own call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from keras import activations, ops


def _l2norm(x, eps=1e-6):
    """KerasHub's ``_l2norm`` (in the input's dtype)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _chunks(x, chunk: int):
    """[B, H, T, ...] float32 -> [N, B, H, chunk, ...] (zero padded to whole chunks)."""
    pad = (-x.shape[2]) % chunk
    x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    x = x.reshape(x.shape[:2] + (x.shape[2] // chunk, chunk) + x.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _solved(strict):
    """(I + strict)^-1 of a batch of strictly lower triangular matrices [..., C, C]."""
    eye = jnp.broadcast_to(jnp.eye(strict.shape[-1], dtype=strict.dtype), strict.shape)
    return jax.scipy.linalg.solve_triangular(eye + strict, eye, lower=True, unit_diagonal=True)


def _solved_one_at_a_time(strict):
    """``_solved`` with one matrix per LAPACK call (a loop over the batch), on the CPU."""
    flat = strict.reshape((-1, 1) + strict.shape[-2:])
    return jax.lax.map(_solved, flat).reshape(strict.shape)


def unit_lower_inverse(strict):
    """(I + strict)^-1 for ``strict`` [..., C, C] strictly lower triangular (float32): a
    triangular solve, on the CPU one matrix per LAPACK call. jaxlib 0.10's CPU solve splits a
    batch over XLA's intra-op thread pool and blocks its own pool thread until the parts are
    done, so as many batched solves in flight as the pool has threads (two on a 2-core host:
    the DeltaNet solves of one accumulation step's loop body) each hold a thread waiting for
    parts that no thread is left to run, and the step never finishes (jax's commit 859992407d,
    after 0.11.0, stops splitting in open-source builds). A call of one matrix runs in its own
    thread: the same LAPACK routine on the same matrix, the same values. TPUs and GPUs keep the
    batched solve (no LAPACK there)."""
    return jax.lax.platform_dependent(strict, cpu=_solved_one_at_a_time, default=_solved)


def chunked_delta_rule(qkv: tuple, g, beta, chunk_size: int = 64, initial_state=None):
    """The gated delta rule of KerasHub's ``_chunk_gated_delta_rule``: ``qkv`` = (query, key,
    value), query / key [B, T, H, dk], value [B, T, H, dv]; the log decay ``g`` and the write
    strength ``beta`` [B, T, H]; the state to start from (None: zeros). Returns (output
    [B, T, H, dv] in the query's dtype, final state [B, H, dk, dv] float32)."""
    query, key, value = qkv
    t, dtype = query.shape[1], query.dtype
    heads = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # noqa: E731  [B, H, T, ...]
    q = heads(_l2norm(query)) * query.shape[-1] ** -0.5
    k, v, beta = heads(_l2norm(key)), heads(value), heads(beta)
    q, k, k_beta, v_beta = (_chunks(x, chunk_size) for x in (q, k, k * beta[..., None],
                                                                v * beta[..., None]))
    g = jnp.cumsum(_chunks(heads(g), chunk_size), axis=-1)  # [N, B, H, C]: within each chunk
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), jnp.float32))
    decay = jnp.exp((g[..., :, None] - g[..., None, :]) * lower) * lower
    strict = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay * (1.0 - jnp.eye(chunk_size))
    inverse = unit_lower_inverse(strict)
    v_fixed = inverse @ v_beta
    k_cumdecay = inverse @ (k_beta * jnp.exp(g)[..., None])
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_decayed = q * jnp.exp(g)[..., None]
    k_decayed = k * jnp.exp(g[..., -1:] - g)[..., None]

    def step(state, chunk):
        v_c, kc_c, intra_c, q_c, k_c, g_last = chunk
        v_new = v_c - kc_c @ state
        out = q_c @ state + intra_c @ v_new
        state = state * jnp.exp(g_last)[..., None, None] + jnp.swapaxes(k_c, -1, -2) @ v_new
        return state, out

    b, h, dk, dv = k.shape[1], k.shape[2], k.shape[-1], v.shape[-1]
    state = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    state, out = jax.lax.scan(step, state, (v_fixed, k_cumdecay, intra, q_decayed, k_decayed,
                                            g[..., -1]))
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, -1, dv)[:, :, :t]
    return jnp.swapaxes(out, 1, 2).astype(dtype), state


def causal_conv1d(x, weight):
    """KerasHub's ``_causal_conv1d`` on channels-last ``x`` [B, T, C] with ``weight`` [C, K]:
    ``out[t] = sum_i weight[:, i] * x[t - K + 1 + i]`` (zeros before the first position), the
    K products and their sum in float32, rounded once to ``x``'s dtype, as the convolution.

    Written without a convolution: in KerasHub's layer (a grouped convolution between transposes
    to channels-first and back, the SiLU between them) the gradient by the weight is a
    convolution of ``batch_group_count`` = channels whose operands come in the two layouts (the
    input channels-last, the SiLU's gradient channels-first), and the TPU compiler of JAX 0.10.2
    (libtpu 0.0.42) rewrites it into a multiply of the two that its verifier rejects ("Binary op
    with incompatible shapes: bf16[1,1024,8192] and bf16[1,8192,1024]": Qwen3.5-35B-A3B's full
    fine-tune on one chip or many; 0.8B's 6,144 channels too; LoRA, which trains no kernel, is
    spared). K shifted products (Qwen 3.5: 4) on the projection as it comes need no transpose."""
    taps, length = weight.shape[-1], x.shape[1]
    w = ops.convert_to_tensor(weight).astype(x.dtype).astype(jnp.float32)  # as the conv's
    padded = jnp.pad(x, [(0, 0), (taps - 1, 0), (0, 0)]).astype(jnp.float32)
    out = sum(padded[:, i:i + length] * w[:, i] for i in range(taps))
    return out.astype(x.dtype)


def delta_net_call(layer, original, hidden_states, attention_mask=None, cache=None, **kwargs):
    """``Qwen3_5GatedDeltaNet.call`` (``layer``) without a cache: KerasHub 0.32's code with the
    convolution of ``causal_conv1d`` (and its SiLU) on channels-last arrays and the delta rule of
    ``chunked_delta_rule``; with a cache (decoding), KerasHub's own (``original``). ``kwargs``:
    ``cache_update_index`` and ``training``, which the call without a cache ignores as
    KerasHub's does."""
    if cache is not None:
        return original(hidden_states, attention_mask=attention_mask, cache=cache, **kwargs)
    if attention_mask is not None and attention_mask.ndim == 2:
        hidden_states = hidden_states * ops.cast(attention_mask[..., None], hidden_states.dtype)
    batch, length = hidden_states.shape[:2]
    mixed = causal_conv1d(layer.in_proj_qkv(hidden_states), layer.conv1d_weight)
    mixed = mixed * ops.sigmoid(mixed)
    kd = layer.key_dim
    query, key = (ops.reshape(mixed[..., i * kd:(i + 1) * kd],
                              (batch, length, layer.num_k_heads, layer.head_k_dim))
                  for i in (0, 1))
    value = ops.reshape(mixed[..., 2 * kd:], (batch, length, layer.num_v_heads, layer.head_v_dim))
    beta = ops.sigmoid(layer.in_proj_b(hidden_states))
    g = -ops.exp(ops.cast(layer.A_log, "float32")) * activations.softplus(
        ops.cast(layer.in_proj_a(hidden_states), "float32") + ops.cast(layer.dt_bias, "float32"))
    if layer.num_v_heads // layer.num_k_heads > 1:
        query, key = (ops.repeat(x, layer.num_v_heads // layer.num_k_heads, axis=2)
                      for x in (query, key))
    core, _ = chunked_delta_rule((query, key, value), g, beta)
    z = ops.reshape(layer.in_proj_z(hidden_states), (-1, layer.head_v_dim))
    core = layer.norm(ops.reshape(core, (-1, layer.head_v_dim))) * activations.silu(z)
    return layer.out_proj(ops.reshape(core, (batch, length, -1)))
