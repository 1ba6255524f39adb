"""Images of vision-language records: TRL 1.16's vision formats, read on the host (in the Grain
workers, never in the training step).

A record's images are its ``images`` column (a list) or its ``image`` column (one image), as TRL's
vision collators read them; an image is a file path (relative to the data file's folder, else the
current directory), a ``data:image/...;base64,`` string (JSONL has no bytes), raw bytes, a Hugging
Face ``datasets`` ``Image`` feature as Arrow / Parquet store it (``{"bytes": ..., "path": ...}``),
a PIL image or a ``uint8`` array (height, width[, channels]). Decoding uses Pillow.

The conversation says where each image goes with ``{"type": "image"}`` content parts beside
``{"type": "text", "text": ...}`` ones. As TRL's ``prepare_multimodal_messages``: when no part
names an image, the images go before the text of the first user message whose content is a string;
the number of image parts must equal the number of images. Content parts are then flattened into
the string the family's chat template writes (each text part trimmed, an image part Gemma 3's
``<start_of_image>`` or Gemma 4's ``<|image|>``), so ``chat.render`` sees strings as for any record.

``ImageSpec`` is what a vision model's data needs: its KerasHub image converter (called here, on
``uint8`` arrays, to resize and rescale), how many placeholder tokens an image takes and the
tokens around them (``expand``: KerasHub's ``Gemma3CausalLMPreprocessor`` / ``Gemma4...`` rule,
applied to the rendered text before tokenization), and how many images a sequence may hold.
Gemma 3's ``pixel_values`` are the resized images; Gemma 4's (``patches``) the converter's
patches, each with its (x, y) position appended as two last channels (-1: a padding patch);
Qwen 3.5's the converter's patches, reordered from its row-by-row list to the 2 x 2 merge
windows its encoder (and a released checkpoint, and transformers' processor) reads.
``ImageSpec`` is duck-typed: this package never imports keras (``ImageSpec.from_preprocessor`` reads the
attributes of a KerasHub preprocessor it is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.image_files import decode  # noqa: F401  (data.images.decode)

IMAGE_COLUMNS = ("images", "image")
# Conversational columns, in the order the images are placed (the conversation's opening).
CONVERSATION_FIELDS = ("messages", "prompt", "chosen", "rejected", "completion")
# What an image part becomes in the rendered text, per chat format (the family's template).
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen 3.5's template writes this
IMAGE_MARKERS = {"gemma": "<start_of_image>", "gemma4": "<|image|>", "qwen3.5": QWEN_IMAGE,
                 "qwen3.5-nothink": QWEN_IMAGE}


def _where(record) -> str:
    return record.get("_where", "?")


@dataclass
class ImageSpec:
    """A vision model's image handling (picklable, for Grain workers): ``converter`` (a KerasHub
    ``ImageConverter``, or any callable from ``uint8`` (n, h, w, 3) to (n, H, W, 3) with an
    ``image_size``), ``tokens_per_image`` placeholder tokens per image between ``start`` and
    ``end`` (with ``around`` on either side), at most ``max_images`` per sequence; the text names
    an image with ``marker`` (default ``start``). ``patches``: Gemma 4's converter (patches and
    their positions, ``pixels``); ``side``: Qwen 3.5's (every image ``side`` pixels square,
    ``qwen_side``)."""

    converter: object
    tokens_per_image: int
    max_images: int
    start: str = "<start_of_image>"
    placeholder: str = "<img>"
    end: str = "<end_of_image>"
    marker: str = ""
    around: str = "\n\n"
    patches: bool = False
    side: int = 0

    def __post_init__(self):
        self.marker = self.marker or self.start

    @classmethod
    def from_preprocessor(cls, preprocessor) -> "ImageSpec":
        """The spec of a KerasHub vision preprocessor (``Gemma3CausalLMPreprocessor`` or
        ``Gemma4CausalLMPreprocessor`` with an ``image_converter``)."""
        tok = preprocessor.tokenizer
        if type(preprocessor).__name__.startswith("Qwen3_5"):
            c = preprocessor.image_converter
            tokens = (qwen_side(c) // (c.patch_size * c.spatial_merge_size)) ** 2
            return cls(c, tokens, int(getattr(preprocessor, "max_images_per_prompt", QWEN_IMAGES)),
                       tok.vision_start_token, tok.image_token, tok.vision_end_token,
                       marker=QWEN_IMAGE, around="", side=qwen_side(c))
        gemma4 = type(preprocessor).__name__.startswith("Gemma4")
        tokens = (tok.start_of_image_token, tok.image_placeholder, tok.end_of_image_token)
        return cls(preprocessor.image_converter, int(preprocessor.num_vision_tokens_per_image),
                   int(preprocessor.max_images_per_prompt), *tokens,
                   marker=tokens[1] if gemma4 else "", around="" if gemma4 else "\n\n",
                   patches=gemma4)

    @classmethod
    def of_model(cls, lm) -> "ImageSpec | None":
        """The spec of a loaded model (``model.LanguageModel``) whose preprocessor has an image
        converter (a vision model); None for a text model."""
        pre = getattr(lm.task, "preprocessor", None)
        if getattr(pre, "image_converter", None) is None:
            return None
        return cls.from_preprocessor(pre)

    def expand(self, text: str) -> str:
        """``text`` with each ``marker`` replaced by the image's token block, as KerasHub's
        preprocessor does: ``around + start + placeholder * n + end + around`` (Gemma 3:
        ``"\\n\\n"`` around its ``<start_of_image>``; Gemma 4: nothing around, its
        ``<|image|>`` the marker)."""
        block = f"{self.start}{self.placeholder * self.tokens_per_image}{self.end}"
        return text.replace(self.marker, self.around + block + self.around)

    def pixels(self, arrays: list) -> np.ndarray:
        """(``max_images``, H, W, 3) float32: each image resized and rescaled by the converter on
        its own; the unused slots are the converter's output for a black image, as KerasHub's
        preprocessor pads (computed once per process). Gemma 4: ``_patches``."""
        if self.patches:
            return self._patches(arrays)
        if self.side:
            return self._qwen_patches(arrays)
        h, w = self.converter.image_size
        out = np.empty((self.max_images, h, w, 3), np.float32)
        for i, array in enumerate(arrays):
            out[i] = np.asarray(self.converter(array[None]), np.float32)[0]
        if len(arrays) < self.max_images:
            if getattr(self, "_blank", None) is None:
                blank = np.zeros((1, h, w, 3), np.uint8)
                self._blank = np.asarray(self.converter(blank), np.float32)[0]
            out[len(arrays):] = self._blank
        return out

    def _patches(self, arrays: list) -> np.ndarray:
        """(``max_images``, patches, 3 x patch^2 + 2) float32: each image's patches from
        Gemma 4's converter (resized to its aspect ratio, padded to the most patches) with each
        patch's (x, y) position appended; an unused slot is padding patches only (zeros at
        position -1), which the encoder reads as nothing (zero embeddings) and which leaves the
        other images' pooling grid as it is (KerasHub pads a prompt's images to one size)."""
        c = self.converter
        count, width = c.max_soft_tokens * c.pooling_kernel_size ** 2, 3 * c.patch_size ** 2
        out = np.zeros((self.max_images, count, width + 2), np.float32)
        out[..., width:] = -1
        for i, array in enumerate(arrays):
            got = c(array[None])
            out[i, :, :width] = np.asarray(got["pixel_values"], np.float32)[0]
            out[i, :, width:] = np.asarray(got["pixel_position_ids"], np.float32)[0]
        return out


    def _qwen_patches(self, arrays: list) -> np.ndarray:
        """(``max_images``, patches, temporal patch, patch, patch, 3) float32: each image through
        Qwen 3.5's converter at the model's side (a square picture of another size resized by
        the converter itself; a picture of another aspect ratio first stretched to the square,
        Pillow's bilinear, where KerasHub's converter would keep its aspect ratio and give it
        another grid), its patches then put in merge-window order (``qwen_window_order``: the
        order the encoder and transformers' processor use); an empty slot holds zeros (its
        tokens are not placed)."""
        from PIL import Image

        c, side = self.converter, self.side
        p, t = int(c.patch_size), int(c.temporal_patch_size)
        out = np.zeros((self.max_images, (side // p) ** 2, t, p, p, 3), np.float32)
        for i, array in enumerate(arrays):
            if array.shape[0] != array.shape[1]:
                array = np.asarray(Image.fromarray(array).resize((side, side), Image.BILINEAR))
            got = c(array)
            rows, cols = (int(n) for n in np.asarray(got["grid_thw"])[1:])
            out[i] = qwen_window_order(np.asarray(got["patches"], np.float32), rows, cols,
                                       int(c.spatial_merge_size))
        return out


# Images a Qwen 3.5 sequence may hold where its preprocessor does not say (KerasHub's has no limit)
QWEN_IMAGES = 2


def qwen_window_order(patches: np.ndarray, rows: int, cols: int, merge: int) -> np.ndarray:
    """An image's patches (``rows x cols`` of them, [patches, ...]) listed row by row, as
    KerasHub 0.32's ``Qwen3_5ImageConverter`` lists them, reordered by ``merge x merge`` window:
    window after window row by row, each window's patches row by row. That is the order
    transformers' ``Qwen2VLImageProcessor`` gives and both ``Qwen3_5VisionEncoder``s read (their
    position embeddings and rotary positions are laid out by window, their merger joins each 4
    consecutive patches), so a released checkpoint's."""
    rest = patches.shape[1:]
    grid = patches.reshape(rows // merge, merge, cols // merge, merge, *rest)
    return grid.swapaxes(1, 2).reshape(patches.shape)


def qwen_side(converter) -> int:
    """The side in pixels of every image of a Qwen 3.5 model: its converter's smallest pixel
    budget (``min_pixels``) as a square, rounded to whole merged patches (Qwen3.5's 65,536:
    256 pixels, 16 x 16 patches of 16, 64 image tokens). Its encoder reads each image's grid as
    Python integers, which a compiled step cannot vary: one grid for every image."""
    stride = int(converter.patch_size) * int(converter.spatial_merge_size)
    return max(stride, round(float(converter.min_pixels) ** 0.5 / stride) * stride)


def record_images(record: dict) -> tuple[str, list]:
    """(column, raw values) of a record's images: its ``images`` list or its ``image``; none: []."""
    where = _where(record)
    if record.get("images") is not None:
        if record.get("image") is not None:
            raise DataError(f"{where}: fields 'images' and 'image' are both set: give one")
        values = record["images"]
        if not isinstance(values, (list, tuple)):
            raise DataError(f"{where}: field 'images' must be a list of images, got "
                            f"{type(values).__name__}")
        return "images", list(values)
    if record.get("image") is not None:
        return "image", [record["image"]]
    return "images", []


def _base_dir(record) -> Path | None:
    """The folder of the data file a record comes from (``_where`` is "path:line" / "path:row N")."""
    path = Path(_where(record).rsplit(":", 1)[0])
    return path.parent if path.is_file() else None


def _image_parts(content) -> int:
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image") \
        if isinstance(content, list) else 0


def _place_images(messages: list, n: int) -> list:
    """TRL's placement: ``n`` image parts before the text of the first user message with string
    content (when no message has an image part)."""
    out = list(messages)
    for i, m in enumerate(out):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            out[i] = dict(m, content=[{"type": "image"}] * n + [{"type": "text",
                                                                  "text": m["content"]}])
            break
    return out


def _count(record, field) -> int:
    return sum(_image_parts(m.get("content")) for m in record.get(field) or []
               if isinstance(m, dict) and m.get("role") != "tool")


def _check_plain(record: dict, n: int, marker: str | None) -> dict:
    """A record of plain strings: as in TRL's standard (not conversational) vision format, its
    text names each image with the model's image token (``marker``, Gemma 3's
    ``<start_of_image>``), in ``text``, the ``prompt``, or else (an implicit prompt) ``chosen``."""
    field = next((f for f in ("text", "prompt", "chosen") if isinstance(record.get(f), str)), None)
    found = record[field].count(marker) if marker and field else 0
    if found != n:
        named = f"{found} {marker} marker(s)" if marker else "no image marker (a text-only model)"
        raise DataError(f"{_where(record)}: field 'images' holds {n} image(s) but field "
                        f"'{field}' has {named}")
    return record


def place_images(record: dict, n: int, marker: str | None = None) -> dict:
    """The record with its ``n`` images placed in its conversation (``_place_images``, when no
    part names one) and their count checked against its ``{"type": "image"}`` parts. The images
    are the prompt's: parts in ``messages``, ``prompt``, or (a pair with an implicit prompt) in
    ``chosen`` and ``rejected`` alike; a completion holds none. A record of plain strings names
    its images with ``marker`` in its text (``_check_plain``)."""
    where = _where(record)
    convo = [f for f in CONVERSATION_FIELDS if isinstance(record.get(f), list)]
    if not convo:
        return _check_plain(record, n, marker)
    opening = [f for f in convo if f in ("messages", "prompt")][:1] or \
        [f for f in convo if f in ("chosen", "rejected")]
    out = dict(record)
    if n and opening and not any(_count(record, f) for f in convo):
        out.update({f: _place_images(record[f], n) for f in opening})
    for f in convo:
        if f not in opening and _count(out, f):
            raise DataError(f"{where}: field '{f}' has {{'type': 'image'}} parts: the images "
                            "belong to the prompt")
    counts = [_count(out, f) for f in opening] or [0]
    if len(set(counts)) > 1:
        raise DataError(f"{where}: fields 'chosen' and 'rejected' hold {counts[0]} and "
                        f"{counts[1]} image parts: the prompt they share holds the images")
    if counts[0] != n:
        raise DataError(f"{where}: field 'images' holds {n} image(s) but the conversation has "
                        f"{counts[0]} {{'type': 'image'}} part(s)")
    return out


def flatten(messages: list, chat_format: str, where: str, field: str) -> list:
    """Messages whose content is a list of parts -> the same with string content: text parts
    joined (trimmed each for ``gemma`` / ``gemma4``, whose templates trim them), image parts the
    format's
    marker (``IMAGE_MARKERS``)."""
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("content"), list)):
            out.append(m)
            continue
        pieces = []
        for j, part in enumerate(m["content"]):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                trims = chat_format in ("gemma", "gemma4")
                pieces.append(part["text"].strip() if trims else part["text"])
            elif kind == "image" and chat_format in IMAGE_MARKERS:
                pieces.append(IMAGE_MARKERS[chat_format])
            elif kind == "image":
                raise DataError(f"{where}: field '{field}': message {i} has an image; chat format "
                                f"{chat_format!r} reads none (image markers: "
                                f"{', '.join(IMAGE_MARKERS)})")
            else:
                raise DataError(f"{where}: field '{field}': message {i}, content part {j} must "
                                "be {'type': 'text', 'text': str} or {'type': 'image'}, got "
                                f"{part!r:.80}")
        out.append(dict(m, content="".join(pieces)))
    return out


def prepare(record: dict, chat_format: str, spec: ImageSpec | None):
    """(record, images): the record with its images placed (``place_images``) and every
    conversation's content parts flattened to strings (``flatten``), and its images decoded
    (``uint8`` arrays). A record with images is refused by a text-only model (``spec`` None)."""
    where = _where(record)
    column, values = record_images(record)
    if values and spec is None:
        raise DataError(f"{where}: field '{column}': this model reads no images (a text-only "
                        "model): train a vision-language model, or leave the images out")
    if spec is not None and len(values) > spec.max_images:
        raise DataError(f"{where}: field '{column}' holds {len(values)} images, over the "
                        f"{spec.max_images} a sequence of this model may hold")
    out = place_images(record, len(values), spec.marker if spec is not None else None)
    for f in CONVERSATION_FIELDS:
        if isinstance(out.get(f), list):
            out[f] = flatten(out[f], chat_format, where, f)
    base = _base_dir(record) if values else None
    names = [f"images[{i}]" for i in range(len(values))] if column == "images" else ["image"]
    return out, [decode(v, where, name, base) for v, name in zip(values, names)]


def expand_segments(spec: ImageSpec | None, segs: list) -> list:
    """Rendered segments with each image marker expanded to its token block (``ImageSpec.expand``)."""
    return segs if spec is None else [(spec.expand(text), flag) for text, flag in segs]


def image_tokens(ex: dict, keys: tuple, tok, spec: ImageSpec, n_images: int, where: str) -> None:
    """In place: the image tokens of the example's sequence ``keys`` = (ids, loss mask or None,
    attention, vision mask) kept out of the loss, and the vision mask (1 at each placeholder
    token, KerasHub's ``vision_mask``) added; a sequence that cut an image's tokens (``max_length``) is
    refused."""
    ids_key, loss_key, attention_key, vision_key = keys
    ids_of = [tok.token_id(t) for t in (spec.start, spec.placeholder, spec.end)]
    if None in ids_of:
        raise ValueError(f"the tokenizer has no single token for {spec.start!r}, "
                         f"{spec.placeholder!r} or {spec.end!r}: not this vision model's")
    ids, attention = ex[ids_key], ex[attention_key].astype(bool)
    vision = (ids == ids_of[1]) & attention
    if int(vision.sum()) != n_images * spec.tokens_per_image:
        raise DataError(f"{where}: the sequence keeps {int(vision.sum())} of the "
                        f"{n_images * spec.tokens_per_image} image tokens of its {n_images} "
                        f"image(s) once cut to its length: raise max_length (or max_prompt_length)")
    if loss_key is not None:
        ex[loss_key][np.isin(ids, ids_of) & attention] = 0
    ex[vision_key] = vision.astype(np.int32)


def add_pixels(ex: dict, spec: ImageSpec | None, arrays: list) -> dict:
    """The example with ``pixel_values`` and ``image_count`` (with a vision model only)."""
    if spec is not None:
        ex["pixel_values"] = spec.pixels(arrays)
        ex["image_count"] = np.int32(len(arrays))
    return ex
