"""Qwen 3.5 with its vision encoder (KerasHub's ``Qwen3_5Backbone`` with a
``Qwen3_5VisionEncoder``): how the training forward and the sampler give it images
(``model.vision.QWEN3_5``).

- **Patches of one grid.** KerasHub's ``Qwen3_5ImageConverter`` turns an image into patches
  [patches, temporal patch, patch, patch, 3] and its grid [1, h, w]; its encoder reads the grid
  as Python integers (its position-embedding interpolation and its per-image attention loop
  over them), so it cannot take a grid traced by ``jax.jit``. This package gives every image of
  a model one square grid (``data.images.qwen_side``: the converter's smallest pixel budget, a
  picture of that size in pixels a side); the batch's ``pixel_values`` [rows, max images, patches, temporal
  patch, patch, patch, 3] carry the patches, and ``encode`` hands the encoder the grid as
  constants read from the array's static shape.
- **Where the image tokens go.** KerasHub's ``Qwen3_5InterleaveEmbeddings`` scatters the
  encoder's output [rows x max images x tokens, width] at flat indices of [rows x T] positions:
  ``flat_indices`` gives each row's placeholder positions, then, for its empty image slots, an
  index past the end (a scatter drops it: those slots' embeddings go nowhere).
- **Multimodal rotary positions (M-RoPE).** Qwen 3.5's full-attention layers rotate with four
  position channels [text, temporal, height, width] (``mrope_section`` of the rotary pairs
  each): a text token at its sequential position on every channel, an image's tokens at the
  image's start on the temporal channel and at start + their row / column on the others, the
  text after an image continuing from start + max(rows, columns)
  (``Qwen3_5CausalLMPreprocessor._compute_position_ids``, transformers' ``get_rope_index``).
  KerasHub's backbone graph does not pass them (its ``Qwen3_5CausalLM.__call__`` rotates image
  tokens at their sequential positions); its ``call_with_cache``, which ``generate`` runs, does.
  The training forward and the sampler pass them (``mrope``), as the released model was trained.
"""

from __future__ import annotations

import contextlib
import math

import jax.numpy as jnp
import numpy as np

from nnx_posttrain.model.blocks import shadowed


def split(pixels):
    """The batch's ``pixel_values`` [rows, max images, patches, ...] -> the backbone's
    ``pixel_values`` [rows, max images x patches, ...] and ``image_grid_thw`` [rows, max images,
    3] (square grids; ``encode`` reads them from the shapes)."""
    rows, count, n = pixels.shape[:3]
    side = math.isqrt(n)
    grid = jnp.broadcast_to(jnp.asarray([1, side, side], jnp.int32), (rows, count, 3))
    return {"pixel_values": pixels.reshape(rows, count * n, *pixels.shape[3:]),
            "image_grid_thw": grid}


def empty(module, rows: int) -> dict:
    enc = module.vision_encoder
    shape = (rows, 0, enc.temporal_patch_size, enc.patch_size, enc.patch_size, enc.in_channels)
    return {"pixel_values": jnp.zeros(shape, jnp.float32),
            "image_grid_thw": jnp.zeros((rows, 0, 3), jnp.int32)}


def encode(module, original, pixel_values, grid_thw, *args, **kwargs):
    """KerasHub's encoder call on ``pixel_values`` [rows, images x patches, ...] with the grid
    as constants: square grids of ``patches`` each, read from the static shapes (a traced
    ``grid_thw``'s values are never read), and its attention's per-image bounds too. Returns [1,
    tokens, width], as KerasHub's batched call does. ``original``: the encoder's ``call``."""
    rows, total = pixel_values.shape[:2]
    images = grid_thw.shape[1] if len(grid_thw.shape) == 3 else grid_thw.shape[0] // max(rows, 1)
    if not total or not images:
        return jnp.zeros((1, 0, int(module.vision_encoder.out_hidden_size)),
                         jnp.float32)
    per = total // images
    side = math.isqrt(per)
    grid = np.tile(np.asarray([[1, side, side]], np.int32), (rows * images, 1))
    # each image attends to itself: the encoder's per-image bounds, kept concrete (Keras' call
    # of its blocks would make them traced arrays, which its attention loop cannot read)
    bounds = np.arange(0, rows * images * per + 1, per, dtype=np.int32)
    encoder = original.__self__
    layers = list(encoder._flatten_layers(include_self=False))
    attention = [layer for layer in layers if type(layer).__name__ == "Qwen3_5VisionAttention"]
    # the blocks the encoder holds: its ``blocks`` list still names the split module's after
    # ``nnx.merge`` (as ``blocks.decoder_blocks`` says of a backbone's), its layers the merged ones
    own = [layer for layer in layers if type(layer).__name__ == "Qwen3_5VisionBlock"]

    def make(layer, call):
        return lambda x, position_embeddings, cu_seqlens=None: call(x, position_embeddings,
                                                                    bounds)

    with shadowed(attention, "call", make), shadowed([encoder], "blocks", lambda *_: own):
        out = original(pixel_values.reshape(-1, *pixel_values.shape[2:]), grid, *args, **kwargs)
    return out[None]


def side(module, pixels) -> int:
    """An image's side in tokens (its patch grid's side over the spatial merge) of the batch's
    ``pixel_values`` [rows, max images, patches, ...]."""
    return math.isqrt(pixels.shape[2]) // int(module.vision_encoder.spatial_merge_size)


def count(module, pixels) -> int:
    """Image tokens a row's images take: [rows, max images, patches, ...] merged 2 x 2 (the
    encoder's spatial merge)."""
    merge = int(module.vision_encoder.spatial_merge_size)
    return pixels.shape[1] * (pixels.shape[2] // merge ** 2)


def flat_indices(vision, where) -> dict:
    """``vision_indices`` [rows, count] as ``Qwen3_5InterleaveEmbeddings`` reads them: flat
    positions in [rows x T] of each row's placeholders (``where``: [rows, count], ascending,
    ``vision.vision_indices``), then (its empty image slots) rows x T, past the end, where the
    scatter drops them."""
    rows, length = vision.shape
    count = where.shape[1]
    real = jnp.arange(count)[None] < vision.sum(1, keepdims=True)
    flat = where + (jnp.arange(rows) * length)[:, None]
    return {"vision_indices": jnp.where(real, flat, rows * length).astype(jnp.int32)}


def mrope_positions(vision, side: int, start=0):
    """[rows, 4, T] M-RoPE positions (text, temporal, height, width) of rows whose image tokens
    are ``vision`` [rows, T] (bool), each image a square grid of ``side`` x ``side`` tokens, the
    first position ``start`` (KerasHub's preprocessor's rule, see the module's docstring);
    padding counts as text (a shift every channel shares, which the rotation ignores)."""
    per = side * side
    v = vision.astype(jnp.int32)
    before = jnp.cumsum(v, axis=1) - v  # image tokens before each position
    image, within = before // per, before % per
    base = jnp.arange(vision.shape[1])[None] - before + image * side + start
    rows = jnp.where(vision, base + within // side, base)
    cols = jnp.where(vision, base + within % side, base)
    return jnp.stack([base, base, rows, cols], axis=1).astype(jnp.int32)


def position_offset(vision, side: int):
    """[rows] what the M-RoPE positions after a prompt whose image tokens are ``vision`` add to
    the sequential ones (transformers' ``rope_deltas``): each image moves them by
    max(rows, columns) instead of its token count."""
    per = side * side
    images = vision.astype(jnp.int32).sum(1) // per
    return images * (side - per)


def attention_layers(module) -> list:
    from nnx_posttrain.model.blocks import decoder_blocks

    return [layer for block in decoder_blocks(module)
            for layer in block._flatten_layers(include_self=False)
            if type(layer).__name__ == "Qwen3_5Attention"]


@contextlib.contextmanager
def mrope(module, positions):
    """While active, every full-attention layer of ``module`` rotates at ``positions`` (a
    [rows, 4, T] array, or a callable of the layer's ``cache_update_index`` giving one: the
    sampler's decoding steps)."""
    def make(layer, original):
        def call(*args, position_ids=None, **kwargs):
            at = positions(kwargs.get("cache_update_index")) if callable(positions) else positions
            return original(*args, position_ids=at, **kwargs)
        return call

    with shadowed(attention_layers(module), "call", make):
        yield
