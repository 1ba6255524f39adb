"""One attention path for every family and accelerator (``--attention auto|keras|xla|cudnn|splash``).

KerasHub's attention layers compute ``softmax(q k^T * scale + mask) v`` from a ``[batch, T, T]``
mask that the decoder block builds (causal + padding, or the block-diagonal mask of packed rows),
with an einsum over grouped heads in ``[batch, kv heads, groups, T, S]`` layout. For the training
forward (``hidden_states``), this module replaces, on every decoder block for the duration of the
call (``blocks.override_blocks``), two methods:

- the block's mask method, by a ``[batch, T, 1]`` placeholder of ones (no ``T x T`` mask is built);
- the attention layer's ``_compute_attention(q, k, v, mask, ...)`` — the seam every family shares,
  after the projections (Qwen's biases, Qwen 3 / Gemma 3 q/k norms) and the rotary embedding — by
  :func:`attend`, which compares **segment ids** (packed rows; else the padding mask, 1 = token)
  inside the kernel or one query chunk at a time: a query sees a key iff both carry the same
  segment id, the key is not later, and (sliding window ``W``) at most ``W - 1`` positions earlier.

Implementations (``set_attention`` resolves ``auto`` per platform and layer and says which path it
took, with the reason of any fallback):

- ``keras``: KerasHub's own code, untouched (the materialised mask);
- ``xla``: exact attention as plain XLA operations, the formulation measured fastest on CPU:
  ``[batch, T, kv heads, groups, S]`` scores without head transposes (with one kv head, every
  query head is a row of one batched matmul; keys that KerasHub's Llama / Qwen / Mistral layers
  repeated per group are un-repeated), soft cap, float32 softmax (with GPT-OSS's attention
  sinks: a learned logit per head in each softmax's denominator). Sequences
  longer than ``chunk`` take blocked attention with an online softmax (``model/flash.py``): tiles
  of ``min(chunk, 128)`` squared scores, only those a query block can see (causal, window, same
  segment), the backward pass recomputing them, so memory is O(T) plus one tile, never ``T x T``;
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN flash attention, GPU,
  bfloat16 / float16, head dim a multiple of 8 up to 128, 256 on Hopper; no soft cap, no sinks), the mask of
  one query chunk at a time built from segment ids;
- ``splash``: Pallas splash attention (TPU; ``model/splash.py``):
  causal or local mask, segment ids and the soft cap inside the kernel (no sinks); head dim a multiple of 128
  (any in interpret mode, which the tests use on CPU); a sequence that is not a multiple of 128
  takes the ``xla`` formulation;
- ``auto``: ``splash`` on TPU, ``cudnn`` on GPU, where the layer and dtype allow; else ``xla``.

A requested kernel that cannot do a layer's feature (or a backbone of no known family, an
attention layer no family reads, dropout, Gemma 3's bidirectional mode, an image tower) falls
back to ``keras``; each family's reader (``families``) says what its layers compute. The sampler's cached
decoding goes through the same seam (``overridden``): its prompt pass takes ``attend``, each
decoding step ``attend_cached`` (one query per row against its KV cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from nnx_posttrain import families
from nnx_posttrain.families import LayerSpec, recurrent_layer  # noqa: F401  (re-exported)
from nnx_posttrain.model.blocks import decoder_blocks, mask_method, override_blocks
from nnx_posttrain.model.flash import NEG, Visible, allowed, flash
from nnx_posttrain.model.splash import splash

IMPLEMENTATIONS = ("auto", "keras", "xla", "cudnn", "splash")
_ATTRIBUTE = "_nnx_posttrain_attention"
FLASH_BLOCK = 128  # tile of the blocked path (CPU, 2k / 8k, fwd + bwd: the fastest packed, ~4% off unpacked)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The resolved path, kept on the module (a plain attribute: ``nnx.split`` / ``merge`` keep it)."""
    implementation: str = "keras"  # keras | xla | cudnn | splash
    chunk: int = 512  # past this length: blocked attention (xla), query chunks (cudnn)
    interpret: bool = False  # Pallas kernels in interpret mode (CPU tests)


def attention_layer(block):
    """The attention sublayer of a KerasHub decoder block: the one whose class some family reads
    (``families.attention_classes``), else None."""
    known = families.attention_classes()
    return next((layer for layer in block._flatten_layers(include_self=False, recursive=False)
                 if type(layer).__name__ in known), None)


def layer_spec(block, training: bool = True) -> LayerSpec | str | None:
    """The block's attention as a ``LayerSpec`` (its family's reader, by the attention layer's
    class name), or the reason it stays with KerasHub's code (attention dropout only matters in
    ``training``); None for a block with a known recurrent mixer and no attention (its own code
    runs, there is no attention to replace). An attention class no family reads is never
    guessed at."""
    layer = attention_layer(block)
    if layer is None:
        if recurrent_layer(block) is not None:
            return None
        return f"{type(block).__name__} has no known attention layer"
    kind = type(layer).__name__
    if training and (getattr(layer, "dropout", 0) or getattr(layer, "_dropout", 0)):
        return f"{kind} has attention dropout"
    if getattr(layer, "use_bidirectional_attention", False):
        return f"{kind} is bidirectional"
    return families.attention_reader(layer)(layer, training)


# Attributes under which a backbone holds an image tower: image tokens attend bidirectionally
# (Gemma 3, Gemma 4) or as a prefix (PaliGemma's ``vit_encoder``), which no kernel here does.
VISION_TOWERS = ("vision_encoder", "vit_encoder")


def _cudnn_problem(spec: LayerSpec, head_dim: int, dtype) -> str | None:
    if spec.soft_cap is not None:
        return "cuDNN has no logit soft cap"
    if spec.sinks is not None:
        return "cuDNN has no attention sinks"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention needs bfloat16 / float16, not {jnp.dtype(dtype).name}"
    cap = getattr(jax.devices()[0], "compute_capability", "0")
    limit = 256 if float(cap or 0) >= 9.0 else 128
    if head_dim % 8 or head_dim > limit:
        return f"cuDNN needs a head dim that is a multiple of 8 up to {limit}, not {head_dim}"
    return None


def _splash_problem(spec: LayerSpec, head_dim: int, interpret: bool) -> str | None:
    if spec.sinks is not None:
        return "splash attention has no attention sinks"
    if not interpret and head_dim % 128:
        return f"splash attention needs a head dim that is a multiple of 128, not {head_dim}"
    return None


def resolve(module, implementation: str = "auto", platform: str | None = None,
            interpret: bool = False) -> tuple[str, str]:
    """(implementation, reason): the path ``module``'s attention takes on ``platform``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"--attention must be one of {', '.join(IMPLEMENTATIONS)}, "
                         f"not {implementation!r}")
    if implementation == "keras":
        return "keras", "requested"
    platform = platform or jax.default_backend()
    if families.of(module) is None:
        return "keras", f"{type(module).__name__} is not a known model family"
    tower = next((name for name in VISION_TOWERS if getattr(module, name, None) is not None), None)
    if tower:
        return "keras", f"image tokens attend bidirectionally or as a prefix (a {tower})"
    blocks = decoder_blocks(module)
    specs = [s for s in map(layer_spec, blocks) if s is not None]  # not a recurrent block's
    unknown = next((s for s in specs if isinstance(s, str)), None)
    if unknown:
        return "keras", unknown
    if not specs:
        return "keras", f"{type(module).__name__} has no attention layer"
    if mask_method(blocks[0]) is None:
        return "keras", f"{type(blocks[0]).__name__} has no known mask method"
    layer = next(filter(None, map(attention_layer, blocks)))
    head_dim = int(getattr(layer, "head_dim", 0) or getattr(layer, "_head_dim", 0))
    dtype = module.dtype_policy.compute_dtype
    problems = {"cudnn": lambda s: _cudnn_problem(s, head_dim, dtype),
                "splash": lambda s: _splash_problem(s, head_dim, interpret)}
    if implementation == "auto":
        preferred = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(platform)
        if preferred:
            why = next((p for p in map(problems[preferred], specs) if p), None)
            if why is None:
                return preferred, f"auto on {platform}"
            return "xla", f"auto on {platform}; {preferred} not used: {why}"
        return "xla", f"auto on {platform}"
    if implementation == "cudnn" and platform not in ("gpu", "cuda"):
        return "keras", f"cudnn needs a GPU, this is {platform}"
    if implementation == "splash" and platform != "tpu" and not interpret:
        return "keras", f"splash needs a TPU (or interpret mode), this is {platform}"
    why = next((p for p in map(problems.get(implementation, lambda s: None), specs) if p), None)
    if why:
        return "keras", f"{implementation} not used: {why}"
    return implementation, "requested"


def set_attention(module, implementation: str = "auto", *, platform: str | None = None,
                  interpret: bool = False, chunk: int = 512) -> str:
    """Choose ``module``'s attention path (``--attention``) and return a line saying which one it
    took and why."""
    resolved, reason = resolve(module, implementation, platform, interpret)
    object.__setattr__(module, _ATTRIBUTE, Choice(resolved, chunk, interpret))
    return f"attention: {resolved} ({reason})"


def attention_of(module) -> Choice:
    return getattr(module, _ATTRIBUTE, Choice())


# ----------------------------------------------------------------------------- the kernels


def _xla_chunk(q, k, v, visible: Visible, spec: LayerSpec):
    """q [B, C, K, G, H], k / v [B, S, K, H] -> [B, C, K, G, H]."""
    b, c, kv, g, h = q.shape
    if not spec.scale_scores:
        q = q * jnp.asarray(spec.scale, q.dtype)
    # an additive bias, one per batch row and (query, key) (not per head; no select backward)
    bias = jnp.where(allowed(*visible, spec.window), 0.0, NEG)
    if kv == 1:  # one kv head: every (query, head) is a row of one batched matmul, no transpose
        s = jnp.einsum("bqh,bsh->bqs", q.reshape(b, c * g, h), k[:, :, 0]).reshape(b, c, g, -1)
        bias = bias[:, :, None, :]
    else:
        s = jnp.einsum("bckgh,bskh->bckgs", q, k)
        bias = bias[:, :, None, None, :]
    sink = None
    if spec.sinks is not None:  # [K, G] -> each score row's sink logit
        sink = spec.sinks[0][:, None] if kv == 1 else spec.sinks[:, :, None]
        sink = jnp.broadcast_to(sink, s.shape[:-1] + (1,))
    p = _probabilities(s, bias, spec, v.dtype, sink)
    if kv == 1:
        return jnp.einsum("bqs,bsh->bqh", p.reshape(b, c * g, -1), v[:, :, 0]).reshape(q.shape)
    return jnp.einsum("bckgs,bskh->bckgh", p, v)


def _probabilities(s, bias, spec: LayerSpec, dtype, sink=None):
    """Attention weights of raw scores ``s``: scaled (Llama family), soft-capped, masked by the
    additive ``bias``, float32 softmax over keys (with ``sink``, float32 logits of s's shape but
    one key: a sink in the denominator), in ``dtype``."""
    if spec.scale_scores:
        s = s * jnp.asarray(spec.scale, s.dtype)
    if spec.soft_cap is not None:
        s = jnp.tanh(s / spec.soft_cap) * spec.soft_cap
    if sink is not None:
        return _sink_softmax(s.astype(jnp.float32) + bias, sink).astype(dtype)
    return _softmax(s.astype(jnp.float32) + bias).astype(dtype)


@jax.custom_vjp
def _softmax(x):
    """softmax over the last axis; its backward ``p * (g - sum(g * p))`` as one row reduction
    of a plain product (XLA:CPU emits jax.nn.softmax's transposed JVP as a slow, broadcasting
    reduction at long sequences)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - jax.lax.stop_gradient(m))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_fwd(x):
    p = _softmax(x)
    return p, p


def _softmax_bwd(p, g):
    return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _sink_softmax_fwd(x, sink):
    """Probabilities of ``x``'s keys in a softmax over them and the ``sink`` logit (shape of x
    with one key), and the sink's own: GPT-OSS's attention sinks (KerasHub appends the sink to
    the scores and drops its probability after the softmax)."""
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(x, axis=-1, keepdims=True), sink))
    e, e_sink = jnp.exp(x - m), jnp.exp(sink - m)
    total = jnp.sum(e, axis=-1, keepdims=True) + e_sink
    p = e / total
    return p, (p, e_sink / total)


def _sink_softmax_bwd(residuals, g):
    """The keys' as ``_softmax``'s; the sink's ``-p_sink * sum(g * p)`` (its probability has no
    cotangent of its own)."""
    p, p_sink = residuals
    gp = jnp.sum(g * p, axis=-1, keepdims=True)
    return p * (g - gp), -p_sink * gp


_sink_softmax = jax.custom_vjp(lambda x, sink: _sink_softmax_fwd(x, sink)[0])
_sink_softmax.defvjp(_sink_softmax_fwd, _sink_softmax_bwd)


def _with_sink_logits(spec: LayerSpec, kv: int) -> LayerSpec:
    """``spec`` with its sinks (a layer's variable, read now: inside a trace, its traced value)
    as float32 logits [K, G] (query head n = k * G + g, as the queries are grouped)."""
    if spec.sinks is None:
        return spec
    sinks = jnp.asarray(getattr(spec.sinks, "value", spec.sinks), jnp.float32)
    return dataclasses.replace(spec, sinks=sinks.reshape(kv, -1))


def _cudnn_chunk(q, k, v, visible: Visible, spec: LayerSpec):
    b, c, kv, g, h = q.shape
    ok = allowed(*visible, spec.window)[:, None]
    out = jax.nn.dot_product_attention(q.reshape(b, c, kv * g, h), k, v, mask=ok,
                                       scale=spec.scale, implementation="cudnn")
    return out.reshape(b, c, kv, g, h)


def _chunked(kernel, qkv: tuple, segment_ids, spec: LayerSpec, chunk: int):
    """Query chunks of ``chunk`` positions, each against the keys it can see, recomputed in the
    backward pass when there is more than one chunk; ``qkv`` = (q, k, v)."""
    q, k, v = qkv
    t = q.shape[1]
    pos = jnp.arange(t)
    if t <= chunk:
        return kernel(q, k, v, Visible(segment_ids, segment_ids, pos, pos), spec)
    one = jax.checkpoint(lambda q, k, v, visible: kernel(q, k, v, visible, spec))
    outs = []
    for lo in range(0, t, chunk):
        hi = min(lo + chunk, t)
        first = max(0, lo - spec.window + 1) if spec.window else 0
        outs.append(one(q[:, lo:hi], k[:, first:hi], v[:, first:hi],
                        Visible(segment_ids[:, lo:hi], segment_ids[:, first:hi], pos[lo:hi],
                                pos[first:hi])))
    return jnp.concatenate(outs, axis=1)


def attend(q, k, v, segment_ids, spec: LayerSpec, choice: Choice):
    """Attention output [B, T, N, H] of rotated queries q [B, T, N, H] and keys / values
    [B, S, K * spec.repeated, H] (S = T), with ``segment_ids`` [B, T] (0: padding)."""
    if spec.repeated > 1:  # Llama / Qwen / Mistral repeated each kv head; the copies are equal
        k, v = k[:, :, ::spec.repeated], v[:, :, ::spec.repeated]
    b, t, n, h = q.shape
    kv = k.shape[2]
    q5 = q.reshape(b, t, kv, n // kv, h)
    segment_ids = segment_ids.astype(jnp.int32)
    spec = _with_sink_logits(spec, kv)
    impl = choice.implementation
    if impl == "splash" and t % 128 == 0 and k.shape[1] == t and spec.sinks is None:
        out = splash(q5, k, v, segment_ids, spec, choice.interpret)
    elif impl == "cudnn" and spec.sinks is None:
        out = _chunked(_cudnn_chunk, (q5, k, v), segment_ids, spec, choice.chunk)
    elif t > choice.chunk:  # xla past one chunk (and splash at a length it cannot tile)
        out = flash(q5, k, v, segment_ids, spec, min(choice.chunk, FLASH_BLOCK))
    else:
        out = _xla_chunk(q5, k, v, Visible(segment_ids, segment_ids, jnp.arange(t), jnp.arange(t)),
                         spec)
    return out.reshape(b, t, n, h).astype(q.dtype)


# ----------------------------------------------------------------------------- the override


def attend_cached(q, k_cache, v_cache, key_mask, index, spec: LayerSpec):
    """Attention output [B, T, N, H] of rotated queries q [B, T, N, H] at positions
    ``index .. index + T - 1`` against a KV cache k / v [B * K, L, H] (K kv heads, not repeated,
    row ``b * K + k``) whose positions with ``key_mask`` [B, L] 0 are padding: a query sees the
    valid keys at its position or earlier (within the window). The sampler's decoding step: one
    query per row against the whole cache. In this layout each (row, kv head) is one matmul
    with one batch dimension, reading the buffer the sampler's loop updates in place (with
    [B, L, K, H] or a kv-head axis of size 1, XLA:CPU copies the cache every step)."""
    b, t, n, h = q.shape
    length = k_cache.shape[1]
    kv = k_cache.shape[0] // b
    g = n // kv
    # [B * K, T * G, H]: every (query, head of the group) a row of its kv head's matmul
    q = jnp.transpose(q.reshape(b, t, kv, g, h), (0, 2, 1, 3, 4)).reshape(b * kv, t * g, h)
    if not spec.scale_scores:
        q = q * jnp.asarray(spec.scale, q.dtype)
    ok = allowed(jnp.ones((b, t), jnp.int32), key_mask.astype(jnp.int32), index + jnp.arange(t),
                 jnp.arange(length), spec.window)  # [B, T, L]
    bias = jnp.broadcast_to(jnp.where(ok, 0.0, NEG)[:, None, :, None, :], (b, kv, t, g, length))
    s = jnp.einsum("bqh,bsh->bqs", q, k_cache)
    spec, sink = _with_sink_logits(spec, kv), None
    if spec.sinks is not None:  # [K, G] -> [B * K, T * G, 1], the rows' layout
        sink = jnp.broadcast_to(spec.sinks[None, :, None], (b, kv, t, g)).reshape(b * kv, t * g, 1)
    p = _probabilities(s, bias.reshape(b * kv, t * g, length), spec, v_cache.dtype, sink)
    out = jnp.einsum("bqs,bsh->bqh", p, v_cache).reshape(b, kv, t, g, h)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, n, h).astype(q.dtype)


@contextlib.contextmanager
def overridden(module, shape, kernel, training: bool = True):
    """While active, no decoder block of ``module`` builds its ``[batch, T, T]`` mask (its mask
    method returns a placeholder of ones, ``shape`` = (batch, T) + (1,)) and every attention layer's
    ``_compute_attention(q, k, v, ...)`` returns ``kernel(i, spec, q, k, v)``: ``i`` the block's
    index, ``spec`` its ``LayerSpec``, q / k / v as KerasHub passes them (after the projections and
    the rotary embedding; Llama-family keys repeated per group). Raises NotImplementedError naming
    a layer that has no ``LayerSpec`` (``training=False``: inference, where attention dropout is
    off). A recurrent block (Qwen 3.5's Gated DeltaNet) keeps its own code."""
    blocks = decoder_blocks(module)
    specs = [layer_spec(block, training) for block in blocks]
    unknown = next((s for s in specs if isinstance(s, str)), None)
    if unknown:
        raise NotImplementedError(unknown)
    masks = mask_method(blocks[0])
    if masks is None:
        raise NotImplementedError(f"{type(blocks[0]).__name__} has no known mask method")
    index = {id(attention_layer(block)): i for i, block in enumerate(blocks) if specs[i]}

    def make_compute(layer, original):
        i = index[id(layer)]
        return lambda q, k, v, *args, **kwargs: kernel(i, specs[i], q, k, v)

    placeholder = jnp.ones(tuple(shape) + (1,), jnp.int32)
    with override_blocks(module, masks, lambda block, original: lambda *a, **kw: placeholder), \
            override_blocks(module, "_compute_attention", make_compute, part=attention_layer), \
            own_calls(module):
        yield blocks


def own_calls(module):
    """While active, every attention layer of ``module`` whose family has its own
    ``attention_call`` (SmolLM3: KerasHub's without mutating the layer) is called through it."""
    family = families.of(module)
    own = family.attention_call if family is not None else None
    if own is None:
        return contextlib.nullcontext()
    return override_blocks(module, "call", lambda layer, original: functools.partial(own, layer),
                           part=attention_layer)


@contextlib.contextmanager
def scope(module, padding_mask, segment_ids=None, branched: bool = False):
    """While active, ``module``'s forward pass uses its chosen attention path (``set_attention``)
    with ``segment_ids`` (packed rows) or the padding mask as segments. Yields whether the path is
    active (False: ``keras``, and KerasHub builds its masks as usual). ``branched``: the segment
    ids have shared-prefix branches (``flash.BRANCH``), which splash's segment ids cannot express:
    that path takes ``xla`` instead."""
    choice = attention_of(module)
    if choice.implementation == "keras":
        with own_calls(module):
            yield False
        return
    if branched and choice.implementation == "splash":
        choice = dataclasses.replace(choice, implementation="xla")
    segments = padding_mask if segment_ids is None else segment_ids
    segments = jnp.asarray(segments).astype(jnp.int32)
    with overridden(module, segments.shape,
                    lambda i, spec, q, k, v: attend(q, k, v, segments, spec, choice)):
        yield True
