"""Tokenizing transforms: a record -> fixed-length numpy arrays (picklable Grain maps).

Tokenization follows TRL: plain text is BOS + prompt, then completion + EOS; a conversation is
rendered with the model family's chat template (``nnx_posttrain.chat``), the prompt ending with the
generation prompt.

- ``Tokenize`` (SFT): ``input_ids``, ``attention_mask``, ``loss_mask`` (1 where the token at that
  position is to be predicted), ``truncated``;
- ``TokenizePreference``: the same three arrays prefixed ``chosen_`` and ``rejected_``, ``truncated``,
  and ``margin`` where the data has TRL's optional ``margin`` column (a reward model's target
  margin per pair);
- ``TokenizeUnpaired``: ``input_ids``, ``attention_mask``, ``loss_mask``, ``label`` (1.0 / 0.0),
  ``truncated``;
- ``TokenizePrompt``: ``prompt_ids`` left-padded to ``max_prompt_length``, ``prompt_mask``,
  ``truncated``, ``index`` (the record's index in the source, for ``extra_columns``).

Truncation: a prompt longer than ``max_prompt_length`` keeps its end (and its BOS); then a sequence
longer than ``max_length`` keeps its start or its end (``truncation``). ``truncated`` is 1 when
anything was cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from nnx_posttrain import chat
from nnx_posttrain.data import images as _images
from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.formats import (
    _columns,
    _lm_segments,
    _prompt_completion,
    _value,
    _where,
    check_values,
    data_format,
    detect_format,
    preference_parts,
    record_tools,
)

def _bos(tok) -> list[int]:
    return [tok.bos_id] if tok.bos_id is not None else []


def _encode(tok, segs, chat_format) -> tuple[list[int], list[int]]:
    """Token ids of segments and their loss flags. When the end-of-turn marker is not one token
    of this tokenizer, a segment ending with it ends with the EOS id instead."""
    end_marker = chat.END_OF_TURN[chat_format]
    marker_is_token = tok.token_id(end_marker) is not None
    ids, mask = [], []
    for text, trained in segs:
        eos_after = False
        if not marker_is_token and text.endswith(end_marker):
            text, eos_after = text[: -len(end_marker)], True
        piece = tok.encode(text)
        if eos_after:
            piece.append(tok.eos_id)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def _keep_prompt_end(ids: list[int], max_prompt_length: int, bos_id) -> list[int]:
    """The last ``max_prompt_length`` tokens of a prompt, its BOS kept in front."""
    if bos_id is not None and ids and ids[0] == bos_id and max_prompt_length >= 2:
        return [bos_id] + ids[len(ids) - max_prompt_length + 1 :]
    return ids[len(ids) - max_prompt_length :]


def _sequence(t, head, tail, add_eos, max_prompt_length):
    """BOS + prompt (kept to ``max_prompt_length``) + completion (+ EOS), padded to the
    transform ``t``'s ``max_length`` (its tokenizer, chat format and truncation)."""
    tok, chat_format, max_length, truncation = t.tokenizer, t.chat_format, t.max_length, t.truncation
    head, tail = _images.expand_segments(t.images, head), _images.expand_segments(t.images, tail)
    prompt_ids = _bos(tok) + _encode(tok, head, chat_format)[0]
    ids, mask = _encode(tok, tail, chat_format)
    if add_eos and tok.eos_id is not None:
        ids.append(tok.eos_id)
        mask.append(1)
    cut = bool(max_prompt_length) and len(prompt_ids) > max_prompt_length
    if cut:
        prompt_ids = _keep_prompt_end(prompt_ids, max_prompt_length, tok.bos_id)
    return pad_example(prompt_ids + ids, [0] * len(prompt_ids) + mask, max_length, tok.pad_id,
                       truncation, truncated=cut)


def pad_example(ids, mask, max_length, pad_id, truncation="keep_start", truncated=False) -> dict:
    """Right-pad (or cut, keeping the start or the end) to ``max_length``: ``input_ids``,
    ``attention_mask``, ``loss_mask``, ``truncated`` (1 if cut here or ``truncated`` is true)."""
    if truncation not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation must be 'keep_start' or 'keep_end', got {truncation!r}")
    if len(ids) > max_length:
        truncated = True
        sl = slice(0, max_length) if truncation == "keep_start" else slice(len(ids) - max_length, None)
        ids, mask = ids[sl], mask[sl]
    n = len(ids)
    out_ids = np.full(max_length, pad_id, np.int32)
    out_ids[:n] = ids
    attention = np.zeros(max_length, np.int32)
    attention[:n] = 1
    loss_mask = np.zeros(max_length, np.float32)
    loss_mask[:n] = mask
    return {
        "input_ids": out_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "truncated": np.int32(truncated),
    }


def _check_lengths(transform):
    name = type(transform).__name__
    if getattr(transform, "max_length", 1) < 1:
        raise ValueError(f"{name}: max_length must be >= 1, got {transform.max_length}")
    if transform.max_prompt_length is not None and transform.max_prompt_length < 1:
        raise ValueError(f"{name}: max_prompt_length must be >= 1 or None, got "
                         f"{transform.max_prompt_length}")
    if getattr(transform, "truncation", "keep_start") not in ("keep_start", "keep_end"):
        raise ValueError(f"{name}: truncation must be 'keep_start' or 'keep_end', got "
                         f"{transform.truncation!r}")


@dataclass
class Tokenize:
    """SFT: a language-modelling or prompt-completion record -> fixed-length example (a Grain map
    transform; picklable). ``format`` 'auto' accepts both; 'language_modeling' or
    'prompt_completion' requires that format's columns. ``max_prompt_length`` (None: no limit)
    applies to prompt-completion records."""

    kind: ClassVar[str] = "sft"
    tokenizer: object
    chat_format: str
    max_length: int
    truncation: str = "keep_start"
    max_prompt_length: int | None = None
    format: str = "auto"
    images: object = None  # a vision model's ``data.images.ImageSpec``

    def __post_init__(self):
        _check_lengths(self)
        if self.format not in ("auto", "language_modeling", "prompt_completion"):
            raise ValueError(f"Tokenize: format must be 'auto', 'language_modeling' or "
                             f"'prompt_completion', got {self.format!r}")

    def __call__(self, record: dict) -> dict:
        check_values(record)
        record, arrays = _images.prepare(record, self.chat_format, self.images)
        fmt = self._record_format(record)
        if fmt == "prompt_completion":
            head, tail, add_eos = _prompt_completion(record, "prompt", "completion", self.chat_format)
            ex = _sequence(self, head, tail, add_eos, self.max_prompt_length)
        else:
            segs, add_eos = _lm_segments(record, fmt, self.chat_format)
            ex = _sequence(self, [], segs, add_eos, None)
        return _with_images(self, ex, arrays, _where(record))

    def _record_format(self, record):
        where, keys = _where(record), _columns(record)
        if self.format == "language_modeling":
            if "messages" in keys:
                return "messages"
            if "text" in keys:
                return "text"
            raise DataError(f"{where}: field 'text' is missing (format 'language_modeling' needs "
                            f"'text' or 'messages'; columns {sorted(keys)})")
        if self.format == "prompt_completion":
            for name in ("prompt", "completion"):
                if name not in keys:
                    raise DataError(f"{where}: field '{name}' is missing")
            return "prompt_completion"
        fmt = detect_format(record)
        if fmt in ("messages", "text", "prompt_completion"):
            return fmt
        if fmt == "prompt_only":
            raise DataError(f"{where}: field 'completion' is missing (a prompt-only record; SFT needs "
                            "'prompt' + 'completion', 'messages' or 'text')")
        raise DataError(f"{where}: a {fmt.replace('_', ' ')} record (columns {sorted(keys)}) cannot be "
                        "used for SFT; expected 'messages', 'prompt' + 'completion', or 'text'")


@dataclass
class _SequenceTransform:
    """What every prompt + completion transform is configured with (a picklable Grain map)."""

    tokenizer: object
    chat_format: str
    max_length: int
    truncation: str = "keep_start"
    max_prompt_length: int | None = None
    images: object = None  # a vision model's ``data.images.ImageSpec``

    def __post_init__(self):
        _check_lengths(self)


_SIDES = {"": ("input_ids", "loss_mask", "attention_mask", "vision_mask"),
          "prompt": ("prompt_ids", None, "prompt_mask", "prompt_vision_mask")}


def _with_images(t, ex: dict, arrays: list, where: str, sides=("",)) -> dict:
    """A vision model's example (``t.images`` set): its image tokens out of the loss, its vision
    masks, ``pixel_values`` and ``image_count``; the example itself for a text model."""
    if t.images is None:
        return ex
    for side in sides:
        keys = _SIDES.get(side) or tuple(f"{side}_{k}" for k in _SIDES[""])
        _images.image_tokens(ex, keys, t.tokenizer, t.images, len(arrays), where)
    return _images.add_pixels(ex, t.images, arrays)


@dataclass
class TokenizePreference(_SequenceTransform):
    """A preference record (``chosen``, ``rejected``, explicit or implicit ``prompt``) -> prompt +
    chosen and prompt + rejected, each ``max_length`` long: ``chosen_input_ids``,
    ``chosen_attention_mask``, ``chosen_loss_mask`` (the completion's tokens only), the same for
    ``rejected_``, and ``truncated`` (1 if either side was cut); with ``margin``, the record's
    ``margin`` (a number in every record)."""

    kind: ClassVar[str] = "preference"
    margin: bool = False

    def __call__(self, record: dict) -> dict:
        check_values(record)
        record, arrays = _images.prepare(record, self.chat_format, self.images)
        prompt, chosen, rejected = preference_parts(record)
        out, truncated = {}, 0
        for name, completion in (("chosen", chosen), ("rejected", rejected)):
            head, tail, add_eos = _prompt_completion(record, "prompt", name, self.chat_format,
                                                     prompt=prompt, completion=completion)
            ex = _sequence(self, head, tail, add_eos, self.max_prompt_length)
            truncated |= int(ex.pop("truncated"))
            out.update({f"{name}_{k}": v for k, v in ex.items()})
        out["truncated"] = np.int32(truncated)
        if self.margin:
            out["margin"] = _margin(record)
        elif record.get("margin") is not None:  # never dropped without a word
            raise DataError(f"{_where(record)}: field 'margin' is set here but in none of the "
                            "data's first records: give every record a margin, or none")
        return _with_images(self, out, arrays, _where(record), sides=("chosen", "rejected"))


def _margin(record: dict) -> np.float32:
    value = record.get("margin")
    if value is None:
        state = "null" if "margin" in record else "missing"
        raise DataError(f"{_where(record)}: field 'margin' is {state} (the data has a 'margin' "
                        "column: every record needs a number there)")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) \
            or not np.isfinite(value):
        raise DataError(f"{_where(record)}: field 'margin' must be a finite number, got "
                        f"{type(value).__name__} {value!r:.40}")
    return np.float32(value)


def _has_margin(src, scan: int = 100) -> bool:
    """Whether the data has TRL's ``margin`` column: any of its first ``scan`` records names it
    (a null there too: a Parquet column with a missing first value). A margin set on a later
    record only is refused by the transform, so none is dropped silently."""
    for i in range(min(len(src), scan)):
        try:
            if "margin" in src[i]:
                return True
        except DataError:
            continue
    return False


@dataclass
class TokenizeUnpaired(_SequenceTransform):
    """An unpaired preference record (``prompt``, ``completion``, boolean or 1 / 0 ``label``) ->
    ``input_ids``, ``attention_mask``, ``loss_mask`` (completion only), ``label`` (1.0 desirable,
    0.0 undesirable), ``truncated``."""

    kind: ClassVar[str] = "unpaired_preference"

    def __call__(self, record: dict) -> dict:
        check_values(record)
        record, arrays = _images.prepare(record, self.chat_format, self.images)
        where = _where(record)
        if record.get("label") is None:
            raise DataError(f"{where}: field 'label' is {'null' if 'label' in record else 'missing'}")
        label = record["label"]
        # 1 / 0 as well, as TRL (it tests the label's truth): a pandas or CSV export writes them
        integral = isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_))
        if not (isinstance(label, (bool, np.bool_)) or integral and label in (0, 1)):
            shown = f"{type(label).__name__} {label!r:.40}"
            raise DataError(f"{where}: field 'label' must be a boolean (true or false, or 1 / 0), "
                            f"got {shown}")
        head, tail, add_eos = _prompt_completion(record, "prompt", "completion", self.chat_format)
        ex = _sequence(self, head, tail, add_eos, self.max_prompt_length)
        ex["label"] = np.float32(bool(label))
        return _with_images(self, ex, arrays, where)


@dataclass
class TokenizePrompt:
    """A record's ``prompt`` (a prompt-only record, or any record with a prompt) -> ``prompt_ids``
    left-padded to ``max_prompt_length`` (BOS + prompt; a conversation ends with the generation
    prompt; a longer prompt keeps its end and its BOS), ``prompt_mask``, ``truncated``, and
    ``index`` (the record's index in the source given to ``train_batches`` / ``eval_batches``;
    -1 when unknown) for ``extra_columns``."""

    kind: ClassVar[str] = "prompt_only"
    tokenizer: object
    chat_format: str
    max_prompt_length: int
    images: object = None  # a vision model's ``data.images.ImageSpec``

    def __post_init__(self):
        _check_lengths(self)

    def __call__(self, record: dict) -> dict:
        check_values(record)
        record, arrays = _images.prepare(record, self.chat_format, self.images)
        prompt = _value(record, "prompt")
        record_tools(record)  # a run with tools renders them into the prompt: checked up front
        if isinstance(prompt, list):
            try:
                segs = chat.render(prompt, self.chat_format, add_generation_prompt=True)
            except chat.ChatFormatError as exc:
                raise DataError(f"{_where(record)}: field 'prompt': {exc}") from None
        else:
            segs = [(prompt, False)]
        segs = _images.expand_segments(self.images, segs)
        tok, length = self.tokenizer, self.max_prompt_length
        ids = _bos(tok) + _encode(tok, segs, self.chat_format)[0]
        truncated = len(ids) > length
        if truncated:
            ids = _keep_prompt_end(ids, length, tok.bos_id)
        n = len(ids)
        prompt_ids = np.full(length, tok.pad_id, np.int32)
        prompt_ids[length - n :] = ids
        mask = np.zeros(length, np.int32)
        mask[length - n :] = 1
        ex = {"prompt_ids": prompt_ids, "prompt_mask": mask, "truncated": np.int32(truncated),
              "index": np.int64(record.get("_index", -1))}
        return _with_images(self, ex, arrays, _where(record), sides=("prompt",))


def make_transform(src, lm, max_length: int, truncation: str = "keep_start",
                   max_prompt_length: int | None = None, format: str = "auto"):
    """The transform of ``lm``'s tokenizer and chat format (``lm.tokenizer``, ``lm.chat_format``:
    a ``model.LanguageModel``) for the data's format (``format``, or detected from ``src`` when
    'auto'):
    ``Tokenize`` for language modelling and prompt-completion, ``TokenizePreference``,
    ``TokenizeUnpaired``, or ``TokenizePrompt`` (``max_prompt_length``, default ``max_length``).
    The transform's ``kind`` ('sft', 'preference', 'unpaired_preference', 'prompt_only') says what
    its examples hold. An algorithm that needs another view (e.g. prompts of preference data for
    RL) builds that transform itself."""
    fmt, tokenizer, chat_format = data_format(src, format), lm.tokenizer, lm.chat_format
    spec = getattr(lm, "images", None)  # a vision model's ``data.images.ImageSpec``
    if fmt in ("language_modeling", "prompt_completion"):
        return Tokenize(tokenizer, chat_format, max_length, truncation, max_prompt_length, format,
                        images=spec)
    if fmt == "preference":
        return TokenizePreference(tokenizer, chat_format, max_length, truncation, max_prompt_length,
                                  images=spec, margin=_has_margin(src))
    if fmt == "unpaired_preference":
        return TokenizeUnpaired(tokenizer, chat_format, max_length, truncation, max_prompt_length,
                                images=spec)
    return TokenizePrompt(tokenizer, chat_format, max_prompt_length or max_length, images=spec)
