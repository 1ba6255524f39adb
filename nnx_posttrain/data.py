"""Data: JSONL records -> tokenized, fixed-length examples -> Grain batches.

Record formats follow TRL's column conventions and are detected from the columns:

- ``messages``: a conversation; the loss covers the assistant turns only;
- ``prompt`` + ``completion``: strings (BOS + prompt + completion + EOS) or message lists
  (rendered with the model family's chat template); the loss covers the completion only;
- ``text``: language modelling; the loss covers every token.

An example is ``input_ids``, ``attention_mask`` and ``loss_mask`` (1 where the token at that
position is to be predicted), all of length ``max_length``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from nnx_posttrain import arithmetic, chat


class DataError(ValueError):
    """Bad input data; the message names the file, the line and the field."""


class JsonlSource:
    """Random-access JSONL source: line offsets are indexed once, records are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such data file")
        starts, lengths, numbers = [], [], []
        with self.path.open("rb") as f:
            pos = 0
            for number, line in enumerate(f, 1):
                if line.strip():  # blank lines are not records
                    starts.append(pos)
                    lengths.append(len(line))
                    numbers.append(number)
                pos += len(line)
        self._starts = np.asarray(starts, np.int64)
        self._lengths = np.asarray(lengths, np.int64)
        self._numbers = np.asarray(numbers, np.int64)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> dict:
        with self.path.open("rb") as f:
            f.seek(int(self._starts[index]))
            raw = f.read(int(self._lengths[index]))
        where = f"{self.path}:{int(self._numbers[index])}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        record["_where"] = where
        return record


class ListSource:
    def __init__(self, records: list[dict], name: str):
        self.records, self.name = records, name

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        return dict(self.records[index], _where=f"{self.name}[{index}]")


def source(spec: str, split: str = "train"):
    """'builtin' -> the arithmetic task's split; otherwise a JSONL path."""
    if spec == "builtin":
        return ListSource([arithmetic.sft_record(a, b) for a, b in arithmetic.problems(split)],
                          f"builtin:{split}")
    if not spec.endswith(".jsonl"):
        raise DataError(f"{spec}: unsupported data file (expected a .jsonl file or 'builtin')")
    return JsonlSource(spec)


# ----------------------------------------------------------------------------- formats


def detect_format(record: dict) -> str:
    keys = set(record) - {"_where"}
    if "messages" in keys:
        return "messages"
    if "prompt" in keys and "completion" in keys:
        return "prompt_completion"
    if "text" in keys:
        return "text"
    raise DataError(
        f"{record.get('_where', '?')}: cannot tell the format from columns {sorted(keys)}; expected "
        "'messages', 'prompt' + 'completion', or 'text'"
    )


def _require_str(record, field, allow_empty=False):
    value = record.get(field)
    where = record.get("_where", "?")
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return value


def segments(record: dict, chat_format: str) -> tuple[list[tuple[str, bool]], bool]:
    """(segments, add_eos): text pieces with a flag 'carries loss', in order."""
    fmt = detect_format(record)
    where = record.get("_where", "?")
    try:
        if fmt == "messages":
            msgs = record["messages"]
            segs = chat.render(msgs, chat_format)
            if not any(flag for _, flag in segs):
                raise DataError(f"{where}: field 'messages' has no assistant turn to learn from")
            if any(m["role"] == "assistant" and not m["content"].strip() for m in msgs):
                raise DataError(f"{where}: field 'messages' has an empty assistant turn")
            return segs, False
        if fmt == "prompt_completion":
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, list) and isinstance(completion, list):
                segs = chat.render(prompt + completion, chat_format)
                n_prompt = len(chat.to_text(prompt, chat_format))
                # nothing in the prompt's text carries loss; after it, the template's own flags
                # (assistant content + end-of-turn marker, not the turn headers)
                return _split_at(segs, n_prompt), False
            prompt = _require_str(record, "prompt", allow_empty=True)
            completion = _require_str(record, "completion")
            return [(prompt, False), (completion, True)], True
        text = _require_str(record, "text")
        return [(text, True)], True
    except chat.ChatFormatError as exc:
        raise DataError(f"{where}: field '{_main_field(fmt)}': {exc}") from None


def _main_field(fmt):
    return {"messages": "messages", "prompt_completion": "prompt", "text": "text"}[fmt]


def _split_at(segs, n_chars):
    out, pos = [], 0
    for text, flag in segs:
        if pos + len(text) <= n_chars:
            out.append((text, False))
        elif pos >= n_chars:
            out.append((text, flag))
        else:
            cut = n_chars - pos
            out += [(text[:cut], False), (text[cut:], flag)]
        pos += len(text)
    return out


@dataclass
class Tokenize:
    """Record -> fixed-length example (a Grain map transform; picklable)."""

    tokenizer: object
    chat_format: str
    max_length: int
    truncation: str = "keep_start"

    def __call__(self, record: dict) -> dict:
        segs, add_eos = segments(record, self.chat_format)
        tok = self.tokenizer
        end_marker = chat.END_OF_TURN[self.chat_format]
        marker_is_token = tok.token_id(end_marker) is not None
        ids = [tok.bos_id] if tok.bos_id is not None else []
        mask = [0] * len(ids)
        for text, trained in segs:
            eos_after = False
            if not marker_is_token and text.endswith(end_marker):
                text, eos_after = text[: -len(end_marker)], True
            piece = tok.encode(text)
            if eos_after:
                piece.append(tok.eos_id)
            ids += piece
            mask += [int(trained)] * len(piece)
        if add_eos and tok.eos_id is not None:
            ids.append(tok.eos_id)
            mask.append(1)
        return pad_example(ids, mask, self.max_length, tok.pad_id, self.truncation)


def pad_example(ids, mask, max_length, pad_id, truncation="keep_start") -> dict:
    truncated = len(ids) > max_length
    if truncated:
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


def validate(src, transform: Tokenize) -> dict:
    """Read and tokenize every record before training: a bad record stops the run here, with its
    file, line and field, instead of hours into it. Returns counts."""
    n, truncated, no_loss = len(src), 0, 0
    if n == 0:
        raise DataError(f"{getattr(src, 'path', getattr(src, 'name', '?'))}: no records")
    for i in range(n):
        ex = transform(src[i])
        truncated += int(ex["truncated"])
        no_loss += int(ex["loss_mask"].sum() == 0)
    return {"records": n, "truncated": truncated, "no_loss_tokens": no_loss}


def train_batches(src, transform: Tokenize, batch_size: int, seed: int, shuffle: bool = True):
    """Endless iterator of batches (dicts of [batch_size, max_length] arrays), epoch after epoch."""
    ds = grain.MapDataset.source(src)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None).map(transform).batch(batch_size, drop_remainder=True)
    return iter(ds.to_iter_dataset())


def eval_batches(src, transform: Tokenize, batch_size: int, limit: int = 0) -> list[dict]:
    """The first ``limit`` full batches of the eval split in order (all when 0); the last partial
    batch is padded with examples whose masks are zero, so every batch has the compiled shape."""
    n = len(src) if not limit else min(len(src), limit * batch_size)
    examples = [transform(src[i]) for i in range(n)]
    while len(examples) % batch_size:
        blank = {k: np.zeros_like(v) for k, v in examples[0].items()}
        examples.append(blank)
    return [
        {k: np.stack([e[k] for e in examples[i : i + batch_size]]) for k in examples[0]}
        for i in range(0, len(examples), batch_size)
    ]


def prompts_and_answers(src, chat_format: str, limit: int) -> list[tuple[list[tuple[str, bool]], str]]:
    """Held-out (prompt segments, reference answer) pairs for exact-match evaluation.

    A conversation whose last turn is the assistant's gives (the conversation before it, that
    turn); a prompt/completion record gives (prompt, completion).
    """
    out = []
    for i in range(len(src)):
        if len(out) >= limit:
            break
        record = src[i]
        fmt = detect_format(record)
        if fmt == "messages" and record["messages"][-1]["role"] == "assistant":
            prompt = chat.render(record["messages"][:-1], chat_format, add_generation_prompt=True)
            out.append((prompt, record["messages"][-1]["content"]))
        elif fmt == "prompt_completion":
            p, c = record["prompt"], record["completion"]
            if isinstance(p, list):
                out.append((chat.render(p, chat_format, add_generation_prompt=True), c[-1]["content"]))
            else:
                out.append(([(p, False)], c))
    return out
