"""Vision-language models: KerasHub's Gemma 3 and Gemma 4 backbones with their vision encoders.

A vision backbone (``reads_images``) takes, beside ``token_ids`` and ``padding_mask``, the batch's
images (``VisionInputs``, per family: Gemma 3's ``images`` (batch, max images, H, W, 3), Gemma 4's
``pixel_values`` (batch, max images, patches, 3 x patch^2) with their ``pixel_position_ids``),
``vision_indices`` (batch, max images x tokens per image:
the positions of the image placeholder tokens, ascending, padded with 0) and ``vision_mask``
(1 at each placeholder token: image tokens attend to each other in both directions). The
training forward (``logprobs.hidden_states``) builds them with ``backbone_inputs`` from the token
ids and the pixel values of the batch being processed, which the step sets around the loss
(``images``: the batch's ``pixel_values``, one per example; the rows through the model are whole
copies of the examples, e.g. a preference pair's chosen then rejected rows, and each copy reads
its example's images). Without pixel values (a text-only batch) a vision backbone gets no image.

The batch's ``pixel_values`` column is one array per family: Gemma 3's images; Gemma 4's patches
with each patch's (x, y) position (-1 for a padding patch) as two last channels, which
``VisionInputs.split`` gives the backbone as its two inputs (small integers, exact in float32).

The vision tower is frozen (``vision_tower.freeze_tower``): LoRA or full fine-tuning trains the
language model; LoRA on the tower's projection or attention is opt-in (``vision_tower``).
KerasHub's ``Gemma3CausalLMPreprocessor`` (and Gemma 4's) asserts TensorFlow when it is built,
though this project only reads its attributes (the tokenizer, the image converter, the image
token counts): ``preprocessor_without_tensorflow`` builds or loads one where TensorFlow is absent.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_posttrain import errors
from nnx_posttrain.model import blocks
from nnx_posttrain.model import vision_qwen3_5 as qwen3_5
from nnx_posttrain.model.blocks import shadowed
from nnx_posttrain.model.converters import full_config

_PIXELS = contextvars.ContextVar("nnx_posttrain_pixel_values", default=None)


def reads_images(module) -> bool:
    """Whether a KerasHub backbone has a vision encoder (Gemma 3 or Gemma 4 with images)."""
    return getattr(module, "vision_encoder", None) is not None


def _gemma_indices(vision, count: int) -> dict:
    return {"vision_mask": vision.astype(jnp.int32), "vision_indices": vision_indices(vision, count)}


@dataclass(frozen=True)
class VisionInputs:
    """How a family's backbone takes images: ``split`` (the batch's ``pixel_values`` [rows, max
    images, ...] -> the backbone's image inputs), ``empty`` (backbone, rows -> those inputs for
    no image), ``placed`` (backbone, the vision encoder's output -> the image embeddings as
    they sit among the scaled text embeddings: the sampler's image prompt pass), ``count``
    (backbone, pixel values -> image tokens a row), ``indices`` (the placeholders [rows, T],
    that count -> the backbone's placement inputs), ``encode`` (backbone, the encoder's call,
    its arguments -> its output: rows along ``rows_axis``) and ``side`` (backbone, pixel
    values -> an image's side in tokens for multimodal rotary positions; 0: none)."""

    split: object
    empty: object
    placed: object = lambda module, encoded: encoded
    count: object = lambda module, pixels: pixels.shape[1] * int(
        module.num_vision_tokens_per_image)
    indices: object = _gemma_indices
    encode: object = lambda module, original, *args, **kwargs: original(*args, **kwargs)
    side: object = lambda module, pixels: 0
    rows_axis: int = 0


def _gemma4_split(pixels):
    return {"pixel_values": pixels[..., :-2],
            "pixel_position_ids": pixels[..., -2:].astype(jnp.int32)}


def _gemma4_empty(module, rows):
    patch = int(module.vision_encoder.patch_size)
    return {"pixel_values": jnp.zeros((rows, 0, 1, 3 * patch * patch), jnp.float32),
            "pixel_position_ids": jnp.zeros((rows, 0, 1, 2), jnp.int32)}


def _gemma4_placed(module, encoded):
    """Gemma 4's backbone scales the image embeddings by 1 / sqrt(hidden) before it places them
    among the unscaled text embeddings, then scales every position by sqrt(hidden): the
    encoder's output up to rounding, computed as the backbone computes it."""
    from keras import ops

    hidden = module.hidden_dim
    encoded = encoded * ops.cast(float(hidden) ** -0.5, encoded.dtype)
    return encoded * ops.cast(ops.sqrt(hidden), encoded.dtype)


GEMMA3 = VisionInputs(
    lambda pixels: {"images": pixels},
    lambda module, rows: {"images": jnp.zeros(
        (rows, 0, int(module.image_size), int(module.image_size), 3), jnp.float32)})
GEMMA4 = VisionInputs(_gemma4_split, _gemma4_empty, _gemma4_placed)
QWEN3_5 = VisionInputs(qwen3_5.split, qwen3_5.empty, count=qwen3_5.count,
                       indices=lambda vision, count: qwen3_5.flat_indices(
                           vision, vision_indices(vision, count)), encode=qwen3_5.encode,
                       side=qwen3_5.side, rows_axis=1)
_FAMILIES = {"Gemma4Backbone": GEMMA4, "Qwen3_5Backbone": QWEN3_5}


def vision_inputs(module) -> VisionInputs:
    """The vision inputs of a vision backbone's family (Gemma 4's, Qwen 3.5's or Gemma 3's)."""
    return _FAMILIES.get(type(module).__name__, GEMMA3)


def check_one_grid(pixel_values) -> None:
    """Refuse to sample Gemma 4's patches (``pixel_values`` [rows, max images, patches, 3 x
    patch^2 + 2]: 4 dimensions, Gemma 3's images have 5) of images whose patch grids differ in
    width: KerasHub's ``Gemma4VisionAveragePooling`` reads the pooling grid's width from the
    widest image of the whole call, so a narrower image would be pooled on the wider grid (its
    embeddings depending on which images share its batch). A ``DataError`` naming the widths."""
    pixels = None if pixel_values is None else np.asarray(pixel_values)
    if pixels is None or pixels.ndim != 4 or not pixels.size:
        return
    x = pixels[..., -2]
    real = (pixels[..., -2:] >= 0).all(-1)  # padding patches: (-1, -1)
    widths = {int(w) + 1 for w, has in zip(np.where(real, x, -1).max(-1).ravel(),
                                           real.any(-1).ravel()) if has}
    if len(widths) > 1:
        raise errors.DataError(
            f"images of {len(widths)} patch-grid widths ({', '.join(map(str, sorted(widths)))} "
            "patches) in one sampling batch of Gemma 4: KerasHub's Gemma 4 pools every image on "
            "the grid of the widest one, so a narrower image's embeddings would be wrong. Give "
            "the images of a batch one aspect ratio (resize them), or sample one prompt (and its "
            "images of one width) a batch")


@contextlib.contextmanager
def images(pixel_values):
    """Within the block, vision backbones read ``pixel_values`` [examples, max images, H, W, 3]
    (None: no images)."""
    token = _PIXELS.set(pixel_values)
    try:
        yield
    finally:
        _PIXELS.reset(token)


def _placeholder_id(module) -> int:
    token = getattr(module, "_nnx_posttrain_image_token", None)
    if token is None:
        raise ValueError(f"{type(module).__name__} reads images but its image placeholder token "
                         "is not known (load it with model.load)")
    return int(token)


def set_image_token(module, token_id: int) -> None:
    """The image placeholder token of a vision backbone (a plain attribute, kept by
    ``nnx.split`` / ``nnx.merge``)."""
    object.__setattr__(module, "_nnx_posttrain_image_token", int(token_id))


def vision_indices(vision_mask, count: int):
    """[batch, count] positions of the 1s of ``vision_mask`` [batch, T], ascending, padded with
    0 (KerasHub's ``Gemma3CausalLMPreprocessor._get_vision_indices``)."""
    length = vision_mask.shape[1]
    order = jnp.argsort(vision_mask == 0, axis=1, stable=True)
    if length < count:
        order = jnp.pad(order, ((0, 0), (0, count - length)))
    order = order[:, :count]
    picked = jnp.take_along_axis(vision_mask, jnp.minimum(order, length - 1), axis=1)
    return jnp.where(picked > 0, order, 0).astype(jnp.int32)


def _tiled(pixels, rows: int):
    """The examples' pixel values for ``rows`` rows: whole copies of the examples in order."""
    if rows % pixels.shape[0]:
        raise ValueError(f"{rows} rows through the model, not whole copies of the batch's "
                         f"{pixels.shape[0]} examples with images")
    copies = rows // pixels.shape[0]
    return pixels if copies == 1 else jnp.concatenate([pixels] * copies, axis=0)


def backbone_inputs(module, token_ids, padding_mask) -> dict:
    """The backbone's inputs: the text's (``blocks.backbone_inputs``: ``token_ids``,
    ``padding_mask``, positions where the backbone takes them), and for a vision backbone the
    images of the ``images`` scope (none outside it), their placeholder positions and mask."""
    inputs = blocks.backbone_inputs(module, token_ids, padding_mask)
    if not reads_images(module):
        return inputs
    token_ids, padding_mask = jnp.asarray(token_ids), jnp.asarray(padding_mask)
    inputs = dict(inputs, token_ids=token_ids, padding_mask=padding_mask)
    rows, family = token_ids.shape[0], vision_inputs(module)
    pixels = _PIXELS.get()
    if pixels is None:  # no image: the vision encoder runs on none
        images, count = family.empty(module, rows), 0
        vision = jnp.zeros(token_ids.shape, bool)
    else:
        pixels = _tiled(jnp.asarray(pixels, jnp.float32), rows)
        images, count = family.split(pixels), pixels.shape[1]
        vision = (token_ids == _placeholder_id(module)) & (padding_mask > 0)
    count = family.count(module, pixels) if count else 0
    return dict(inputs, **images, **family.indices(vision, count))


def embed_images(module, x, token_ids, padding_mask):
    """(embeddings, vision mask) of a prompt: the text embeddings ``x`` [B, T, D] (scaled as the
    backbone scales them) with the images of the ``images`` scope in place of the placeholder
    tokens, as the backbone's graph places them (its vision encoder, then its interleave layer,
    on ``backbone_inputs``), and the ``vision_mask`` [B, T] its decoder blocks read (image
    tokens attend to each other within an image); ``(x, None)`` without images or a vision
    backbone (the sampler's prompt pass over a prompt with images)."""
    if not reads_images(module) or _PIXELS.get() is None:
        return x, None
    inputs = backbone_inputs(module, token_ids, padding_mask)
    family = vision_inputs(module)
    images = {k: inputs[k] for k in family.empty(module, 0)}
    if "image_grid_thw" in images:  # Qwen 3.5: patches and their grid
        encoded = family.encode(module, module.vision_encoder.call,  # (a grid kept concrete)
                                images["pixel_values"], images["image_grid_thw"])
    else:
        encoded = module.vision_encoder(images.get("images", images))  # Gemma 4's: a dict
    x = module.interleave_embeddings(image_embeddings=family.placed(module, encoded),
                                     text_embeddings=x, vision_indices=inputs["vision_indices"])
    return x, inputs.get("vision_mask")


@contextlib.contextmanager
def rotary_positions(module, token_ids, padding_mask):
    """Within the block, a family with multimodal rotary positions (Qwen 3.5's M-RoPE) rotates
    the rows ``token_ids`` [rows, T] at those of their images (the ``images`` scope's:
    ``vision_qwen3_5.mrope_positions``); otherwise nothing changes."""
    vision, side = _image_rows(module, token_ids, padding_mask)
    if not side:
        yield
        return
    with qwen3_5.mrope(module, qwen3_5.mrope_positions(vision, side)):
        yield


def _image_rows(module, token_ids, padding_mask) -> tuple:
    """(the placeholder tokens [rows, T], an image's side in tokens) of rows under the ``images``
    scope, for a family with multimodal rotary positions; (None, 0) otherwise."""
    pixels = _PIXELS.get()
    side = (vision_inputs(module).side(module, pixels)
            if reads_images(module) and pixels is not None else 0)
    if not side:
        return None, 0
    return (jnp.asarray(token_ids) == _placeholder_id(module)) & \
        (jnp.asarray(padding_mask) > 0), side


def decoding_positions(module, token_ids, padding_mask):
    """A context factory for the sampler's decoding steps after prompts ``token_ids`` with the
    images of the ``images`` scope: Qwen 3.5's full-attention layers rotate each new token at
    its cache index plus the prompt's M-RoPE offset (``vision_qwen3_5.position_offset``) on
    every channel; other models: nothing (``contextlib.nullcontext``)."""
    vision, side = _image_rows(module, token_ids, padding_mask)
    if not side:
        return contextlib.nullcontext
    offset = qwen3_5.position_offset(vision, side)

    def at(index):
        return jnp.broadcast_to((index + offset)[:, None, None], (offset.shape[0], 4, 1))
    return lambda: qwen3_5.mrope(module, at)


@contextlib.contextmanager
def encoded_once(module):
    """Within the block, the vision encoder encodes each example's images once however many
    rows copy the example (a preference pair's chosen and rejected rows), its output copied to
    every copy (``backbone_inputs`` gives the backbone the images of every row)."""
    pixels = _PIXELS.get()
    if not reads_images(module) or pixels is None:
        yield
        return
    examples = pixels.shape[0]

    family = vision_inputs(module)

    def make(encoder, original):
        def call(images, *args, **kwargs):  # Gemma 3: an array; Gemma 4: a dict of arrays
            copies = jax.tree.leaves(images)[0].shape[0] // examples
            if copies <= 1:
                return family.encode(module, original, images, *args, **kwargs)
            args = [a[:examples] if getattr(a, "shape", ())[:1] == (examples * copies,) else a
                    for a in args]  # (Qwen 3.5's grid, per row)
            out = family.encode(module, original, jax.tree.map(lambda a: a[:examples], images),
                                *args, **kwargs)
            return jnp.concatenate([out] * copies, axis=family.rows_axis)
        return call

    kind = type(module.vision_encoder)  # the encoder the graph calls (after nnx.merge too)
    with shadowed([layer for layer in module.layers if isinstance(layer, kind)], "call", make):
        yield


@contextlib.contextmanager
def preprocessor_without_tensorflow():
    """Within the block, KerasHub's ``Gemma3CausalLMPreprocessor`` and
    ``Gemma4CausalLMPreprocessor`` can be built without TensorFlow (their constructors' check is
    skipped; calling them would still need TensorFlow)."""
    from keras_hub.src.models.gemma3 import gemma3_causal_lm_preprocessor as gemma3
    from keras_hub.src.models.gemma4 import gemma4_causal_lm_preprocessor as gemma4
    from keras_hub.src.utils import tensor_utils

    if tensor_utils.tf is not None:
        yield
        return
    originals = [(m, m.assert_tf_installed) for m in (gemma3, gemma4)]
    for m, _ in originals:
        m.assert_tf_installed = lambda name: None
    try:
        yield
    finally:
        for m, original in originals:
            m.assert_tf_installed = original


def outside_the_trace(lm, module):
    """``lm``, built abstractly (``nnx.eval_shape``: ``plan``), made usable outside that trace.
    A layer's constant arrays that are no variable (Gemma 3's vision position ids, made in its
    ``__init__``) came out as shapes, which ``nnx.split`` would keep in the graph as static
    attributes: zeros of their shapes instead (an abstract model is compiled, never run). A
    vision model's image converter, made inside the trace, is made again from its whole config
    (``converters.full_config``): the data pipeline calls it outside (flax refuses a mutation
    from another trace level), on this host's CPU (``_OnHost``)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            for name, value in list(vars(node).items()):
                if isinstance(value, jax.ShapeDtypeStruct):
                    setattr(node, name, np.zeros(value.shape, value.dtype))
    if lm.images is not None:
        converter = lm.images.converter
        lm.images = dataclasses.replace(
            lm.images, converter=_OnHost(type(converter).from_config(full_config(converter))))
    return lm


class _OnHost:
    """An image converter called on this host's CPU (``lean_load.made_on``): a plan's mesh holds
    a topology's devices, which run nothing (the converter's eager JAX operations failed under
    a TPU topology's: "'Executable' object has no attribute 'local_devices'")."""

    def __init__(self, converter):
        self.converter = converter

    def __getattr__(self, name):  # the converter's settings (not yet set: unpickling)
        if name == "converter":
            raise AttributeError(name)
        return getattr(self.converter, name)

    def __call__(self, *args, **kwargs):
        from nnx_posttrain.model.lean_load import made_on

        with made_on(jax.devices("cpu")[0]):
            return self.converter(*args, **kwargs)

