"""The sampler's passes through the model (``sampler``): the prompt pass and each decoding step
run KerasHub's decoder blocks with the sampler's KV cache behind the attention layers'
``_compute_attention`` seam (``forward``); a prompt with images on a vision model takes the
training forward's prompt pass (``image_prompt``)."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain import families, model
from nnx_posttrain.model import attention, vision
from nnx_posttrain.model.blocks import override_blocks
from nnx_posttrain.model.logprobs import vocabulary_logits
from nnx_posttrain.sampling.capacity import block_layouts
from nnx_posttrain.sampling.capacity import kv_layout as _kv_layout


def family(module) -> families.Decoding:
    """How the sampler drives ``module``'s decoder blocks (its family's ``Decoding``). Rotary
    positions only: an absolute-position family (GPT-2, OPT, ...) would see shifted positions
    with left padding."""
    name = type(module).__name__
    family = families.of(module)
    if family is None or isinstance(family.decoding, families.Unsupported):
        supported = [f.backbone for f in families.FAMILIES.values() if f.decoding]
        why = f" ({family.decoding.reason})" if family is not None else ""
        raise NotImplementedError(
            f"the KV-cache sampler does not support {name}{why}: supported backbones are "
            f"{', '.join(supported)} (rotary positions and cached decoder blocks)"
        )
    params = inspect.signature(type(module.transformer_layers[0]).call).parameters
    keywords = any(p.kind is p.VAR_KEYWORD for p in params.values())  # SmolLM3: from **kwargs
    if family.decoding.cache_kw not in params and not keywords:
        raise NotImplementedError(f"{name}: decoder block takes no {family.decoding.cache_kw}")
    return family.decoding


def empty_cache(module, batch: int, length: int):
    """One (keys, values) pair [B * kv heads, L, head dim] per decoder block (``attend_cached``),
    of the block's own kv heads and head dim (``capacity.block_layouts``); a recurrent block's
    initial state (``Decoding.state``: Qwen 3.5's Gated DeltaNet); None for a block that reads
    an earlier block's cache (Gemma 4's KV-shared layers)."""
    dtype = _kv_layout(module)[2]
    fam = family(module)
    blocks = model.decoder_blocks(module)
    return tuple(
        fam.state(block, batch) if attention.recurrent_layer(block) is not None
        else None if layout is None
        else tuple(jnp.zeros((batch * layout[0], length, layout[1]), dtype) for _ in range(2))
        for block, layout in zip(blocks, block_layouts(module)))


def _pass_through_cache(module, fam: families.Decoding, batch: int, length: int):
    """What a block is given as its cache: zeros exactly as long as its input, so that KerasHub's
    cache write (a dynamic update slice, whose start is clamped to fit) is the new keys and values
    themselves, and its rotary embedding starts at the cache index. As wide as the widest block's
    keys (Gemma 4's blocks slice theirs out of it, as from KerasHub's own cache)."""
    dtype = _kv_layout(module)[2]
    layouts = [layout for layout in block_layouts(module) if layout is not None]
    heads, head_dim = max(h for h, _ in layouts), max(d for _, d in layouts)
    if fam.pair_cache:
        shape = (batch, length, heads, head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return jnp.zeros((batch, 2, length, heads, head_dim), dtype)


class Cache(NamedTuple):
    """The KV cache of every block, the position of the next token written to it, and the mask
    of its keys (the prompt's left pads masked)."""

    caches: tuple
    index: Any
    key_mask: Any


def _embedded(module, fam: families.Decoding, token_ids):
    """The token embeddings [B, T, D] of ``token_ids``, scaled as the family's backbone scales
    them."""
    x = module.token_embedding(token_ids)
    if fam.embed_scale:
        x = x * jnp.sqrt(jnp.asarray(module.hidden_dim, jnp.float32)).astype(x.dtype)
    return x


def _written(pair, k, v, index):
    """One block's cache ``pair`` (keys, values) [B * K, L, H] with keys and values [B, T, K, H]
    written at positions index..index+T-1 (row b * K + k: kv head k of row b)."""
    t = k.shape[1]
    return tuple(
        jax.lax.dynamic_update_slice_in_dim(
            cache, jnp.transpose(own, (0, 2, 1, 3)).reshape(cache.shape[0], t, -1)
            .astype(cache.dtype), index, 1)
        for cache, own in zip(pair, (k, v)))


def _head(module, x, last: bool):
    """float32 logits of the blocks' output ``x``: the final norm, then the vocabulary projection
    (at the last position only when ``last``: a prompt pass reads nothing else)."""
    h = (getattr(module, "layer_norm", None) or module.norm)(x)  # SmolLM3: norm
    return vocabulary_logits(module.token_embedding, h[:, -1:] if last else h)


def forward(module, fam: families.Decoding, token_ids, cache: Cache, prompt=None, embedded=None):
    """Run ``token_ids`` [B, T] at positions index..index+T-1 through the decoder blocks: float32
    logits [B, T, vocab] (the path of ``model.token_logprobs``; for the prompt pass, [B, 1, vocab]:
    its last position, the only one read) and the updated caches.

    KerasHub's blocks compute everything but attention (projections, biases, q/k norms, rotary
    embedding, norms, feed-forward, LoRA); each attention layer's ``_compute_attention`` writes its
    keys and values into this sampler's cache at ``index`` (in place in the decoding loop: no copy
    of the cache per step, as KerasHub's slice / update / stack of its cache makes) and returns
    ``model.attention``'s kernels' output: for the prompt pass (``prompt``: the prompt's padding
    mask), the module's training path over the prompt's own keys; for a decoding step, one query
    per row against the cache (``attend_cached``), its left pads masked by ``key_mask``. A
    KV-shared block (Gemma 4: ``fam.kv_source``) writes nothing and attends over its source
    block's keys (given it as ``fam.shared_kw``, as KerasHub's backbone does); the family's
    ``layer_inputs`` (Gemma 4's per-layer inputs) go to each block. A recurrent block (Qwen
    3.5's Gated DeltaNet) runs from its state in the cache and leaves its new state there
    (``Decoding.state_step``; the prompt's left pads zeroed at its input). ``embedded``: the
    input embeddings, when not the tokens' (a prompt with images: ``image_prompt``)."""
    batch, t = token_ids.shape
    index, key_mask = cache.index, cache.key_mask
    x = _embedded(module, fam, token_ids) if embedded is None else embedded
    caches = list(cache.caches)
    choice = attention.attention_of(module)
    if choice.implementation == "keras":
        choice = attention.Choice("xla", choice.chunk)

    blocks = model.decoder_blocks(module)
    sources = [fam.kv_source(block) if fam.kv_source else None for block in blocks]

    def kernel(i, spec, q, k, v):
        if sources[i] is None:
            caches[i] = _written(caches[i], k[:, :, ::spec.repeated], v[:, :, ::spec.repeated],
                                 index)
        if prompt is not None:  # a KV-shared block's k / v: its source block's, as KerasHub's
            return attention.attend(q, k, v, prompt, spec, choice)
        own = caches[i if sources[i] is None else sources[i]]
        return attention.attend_cached(q, own[0], own[1], key_mask, index, spec)

    through = _pass_through_cache(module, fam, batch, t)
    extra = fam.layer_inputs(module, token_ids, x) if fam.layer_inputs else [{}] * len(blocks)
    outputs = []  # each block's cache output: what a KV-shared block reads
    if fam.cache_kw not in inspect.signature(type(blocks[0]).call).parameters:
        index = jnp.asarray(index, jnp.int32)  # SmolLM3's **kwargs: Keras mixes no int and array
    recurrent = [attention.recurrent_layer(block) is not None for block in blocks]
    with attention.overridden(module, (batch, t), kernel, training=False):
        for i, (block, kwargs, source) in enumerate(zip(blocks, extra, sources)):
            if recurrent[i]:  # Qwen 3.5's Gated DeltaNet: its state, not keys and values
                x, caches[i] = fam.state_step(block, x, caches[i], index, prompt)
                outputs.append(None)
                continue
            if source is not None:
                kwargs = dict(kwargs, **{fam.shared_kw: outputs[source]})
            x, out = block(x, **{fam.cache_kw: through, fam.index_kw: index}, **kwargs)
            outputs.append(out)
    return _head(module, x, last=prompt is not None), tuple(caches)


def image_prompt(module, fam: families.Decoding, token_ids, caches: tuple, prompt):
    """The prompt pass over prompts with images (those of the ``model.images`` scope) on a vision
    backbone, as the training forward computes it: the placeholder tokens' embeddings replaced by
    the vision tower's projected embeddings (``vision.embed_images``), and every block called as
    the backbone's graph calls it, without a cache, with KerasHub's own mask and attention
    (causal, image tokens bidirectional within an image, the sliding window, the prompt's left
    pads masked: what a vision model trains with), Gemma 4's per-layer inputs (its image tokens
    reading padding's) and its KV-shared blocks given their source block's keys and values; each
    attention layer with its own keys and values writes them into ``caches`` at position 0.
    Qwen 3.5 (no image-token mask: causal attention throughout) takes the text's prompt pass
    (``forward``) from those embeddings, its full-attention layers at the M-RoPE positions.
    Returns the last position's float32 logits [B, 1, vocab] and the caches, from which decoding
    goes on as for text."""
    if not vision.reads_images(module):
        raise ValueError(f"pixel values given, but {type(module).__name__} has no vision tower")
    x, vision_mask = vision.embed_images(module, _embedded(module, fam, token_ids), token_ids,
                                         prompt)
    if vision_mask is None:  # Qwen 3.5: causal image tokens, the text's pass at M-RoPE positions
        with vision.rotary_positions(module, token_ids, prompt):
            return forward(module, fam, token_ids, Cache(caches, 0, prompt), prompt, embedded=x)
    caches = list(caches)
    blocks = model.decoder_blocks(module)
    sources = [fam.kv_source(block) if fam.kv_source else None for block in blocks]
    specs = [attention.layer_spec(block, training=False) for block in blocks]
    index = {id(attention.attention_layer(block)): i for i, block in enumerate(blocks)}

    def make(layer, original):
        i = index[id(layer)]

        def compute(q, k, v, *args, **kwargs):
            if sources[i] is None:  # a KV-shared block's keys are its source's, written there
                caches[i] = _written(caches[i], k[:, :, ::specs[i].repeated],
                                     v[:, :, ::specs[i].repeated], 0)
            return original(q, k, v, *args, **kwargs)
        return compute

    extra = (fam.layer_inputs(module, token_ids, x, vision_mask=vision_mask) if fam.layer_inputs
             else [{}] * len(blocks))
    outputs = []  # each block's keys and values (Gemma 4): what a KV-shared block reads
    with override_blocks(module, "_compute_attention", make, part=attention.attention_layer):
        for block, kwargs, source in zip(blocks, extra, sources):
            if source is not None:
                kwargs = dict(kwargs, **{fam.shared_kw: outputs[source]})
            out = block(x, padding_mask=prompt, vision_mask=vision_mask, **kwargs)
            x, kv = out if isinstance(out, tuple) else (out, None)  # Gemma 3: x alone
            outputs.append(kv)
    return _head(module, x, last=True), tuple(caches)
