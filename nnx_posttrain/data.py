"""Data: records from files -> tokenized, fixed-length examples -> Grain batches.

Sources (random access, ``len`` + ``[i]``; nothing is loaded whole into memory):

- ``.jsonl``: line offsets are indexed once, a record is parsed when it is read;
- ``.parquet``: read one row group at a time with pyarrow (the last decoded group is cached);
- a Hugging Face ``datasets`` directory (what ``Dataset.save_to_disk`` writes: ``state.json`` and
  Arrow IPC stream files ``data-*.arrow``), memory-mapped with pyarrow (no ``datasets`` needed);
  a ``DatasetDict`` directory gives the split asked for;
- ``builtin``: the arithmetic task.

``--data a.jsonl,b.parquet`` concatenates files; ``--data a.jsonl:0.7,b.jsonl:0.3`` mixes them with
these weights (deterministically, with ``grain.MapDataset.mix``). Every record carries ``_where``
("path:line" for JSONL, "path:row N" with N counted from 0 for Parquet and Arrow) so that an error
names the file and the line or row.

Record formats follow TRL's column conventions, detected from the columns (``detect_format``) or
set explicitly; strings and conversations (lists of ``role``/``content`` messages) both work:

- language modelling: ``text``, or ``messages`` (the loss covers the assistant turns only);
- prompt-completion: ``prompt`` + ``completion`` (the loss covers the completion only);
- preference: ``chosen`` + ``rejected`` with an explicit or implicit ``prompt`` (see
  ``implicit_prompt``);
- unpaired preference: ``prompt`` + ``completion`` + ``label`` (a boolean);
- prompt-only: ``prompt`` alone (for RL; other columns are extras, see ``extra_columns``).

Tokenization follows TRL: plain text is BOS + prompt, then completion + EOS; a conversation is
rendered with the model family's chat template (``nnx_posttrain.chat``), the prompt ending with the
generation prompt. A transform turns a record into fixed-length numpy arrays:

- ``Tokenize`` (SFT): ``input_ids``, ``attention_mask``, ``loss_mask`` (1 where the token at that
  position is to be predicted), ``truncated``;
- ``TokenizePreference``: the same three arrays prefixed ``chosen_`` and ``rejected_``, ``truncated``;
- ``TokenizeUnpaired``: ``input_ids``, ``attention_mask``, ``loss_mask``, ``label`` (1.0 / 0.0),
  ``truncated``;
- ``TokenizePrompt``: ``prompt_ids`` left-padded to ``max_prompt_length``, ``prompt_mask``,
  ``truncated``, ``index`` (the record's index in the source, for ``extra_columns``).

Truncation: a prompt longer than ``max_prompt_length`` keeps its end (and its BOS); then a sequence
longer than ``max_length`` keeps its start or its end (``truncation``). ``truncated`` is 1 when
anything was cut.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import grain
import numpy as np

from nnx_posttrain import arithmetic, chat

# Data formats (the ``format`` option; "auto" detects them from the columns).
FORMATS = ("language_modeling", "prompt_completion", "preference", "unpaired_preference", "prompt_only")

# What ``detect_format`` returns (finer: a language-modelling record is "messages" or "text").
RECORD_FORMATS = ("messages", "text", "prompt_completion", "preference", "unpaired_preference",
                  "prompt_only")

# Names tried, in order, for a split of a Hugging Face DatasetDict directory.
SPLIT_NAMES = {"train": ("train",), "eval": ("eval", "validation", "valid", "test")}


class DataError(ValueError):
    """Bad input data; the message names the file, the line (or row) and the field."""


# ============================================================================= sources


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
            record = json.loads(raw.rstrip(b"\r\n"))  # an error's column is then on this line
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        record["_where"] = where
        return record

    def __repr__(self):
        return f"JsonlSource({str(self.path)!r}, {len(self)} records)"


def _row_index(index: int, length: int, name) -> int:
    index = int(index)
    if not 0 <= index < length:
        raise IndexError(f"{name}: index {index} out of range for {length} records")
    return index


class ParquetSource:
    """Random-access Parquet source: a row group is decoded when one of its rows is read; the
    last decoded row group is kept, so reading in order decodes each group once. Thread-safe
    (Grain reads with several threads): one reader at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such data file")
        pf = self._open()
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        self._offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self._file, self._cached = pf, (None, None)
        self._lock = threading.Lock()

    def _open(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path, memory_map=True)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.path}: not a readable Parquet file ({exc})") from None

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> dict:
        index = _row_index(index, len(self), self.path)
        group = int(np.searchsorted(self._offsets, index, side="right")) - 1
        with self._lock:  # a ParquetFile must not be read from two threads at once
            if self._cached[0] != group:
                if self._file is None:
                    self._file = self._open()
                self._cached = (group, self._file.read_row_group(group))
            table = self._cached[1]
        row = index - int(self._offsets[group])
        record = table.slice(row, 1).to_pylist()[0]
        record["_where"] = f"{self.path}:row {index}"
        return record

    def __getstate__(self):  # for Grain worker processes: reopen the file there
        state = dict(self.__dict__, _file=None, _cached=(None, None))
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self):
        return f"ParquetSource({str(self.path)!r}, {len(self)} records)"


class ArrowSource:
    """Random-access source over Arrow IPC files, memory-mapped (zero copy): a Hugging Face
    ``datasets`` directory written by ``save_to_disk`` (``state.json`` + ``data-*.arrow``), or one
    ``.arrow`` file. ``_where`` is "<file>:row N", N counted from 0 within that file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = _arrow_files(self.path)
        self._tables, self._lock = None, threading.Lock()
        sizes = [table.num_rows for table in self._load()]
        self._file_offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def _load(self):
        with self._lock:
            if self._tables is None:
                tables = [_read_arrow(f) for f in self.files]
                # per file: start row of each record batch, and the batches
                self._batches = [(np.cumsum([0] + [b.num_rows for b in t.to_batches()])[:-1],
                                  t.to_batches()) for t in tables]
                self._tables = tables
        return self._tables

    def __len__(self) -> int:
        return int(self._file_offsets[-1])

    def __getitem__(self, index: int) -> dict:
        index = _row_index(index, len(self), self.path)
        self._load()
        k = int(np.searchsorted(self._file_offsets, index, side="right")) - 1
        row = index - int(self._file_offsets[k])
        starts, batches = self._batches[k]
        b = int(np.searchsorted(starts, row, side="right")) - 1
        record = batches[b].slice(row - int(starts[b]), 1).to_pylist()[0]
        record["_where"] = f"{self.files[k]}:row {row}"
        return record

    def __getstate__(self):  # for Grain worker processes: memory-map the files again there
        state = dict(self.__dict__, _tables=None)
        state.pop("_batches", None)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self):
        return f"ArrowSource({str(self.path)!r}, {len(self)} records)"


def _arrow_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: no such data file or directory")
    state = path / "state.json"
    if state.is_file():
        try:
            names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{state}: not a Hugging Face datasets state file ({exc!r})") from None
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DataError(f"{state}: lists data files that do not exist: {missing}")
    else:
        files = sorted(path.glob("data-*.arrow"))
    if not files:
        raise DataError(
            f"{path}: not a Hugging Face datasets directory (no state.json, no data-*.arrow files)"
        )
    return files


def _read_arrow(path: Path):
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
    except OSError as exc:
        raise DataError(f"{path}: cannot open ({exc})") from None
    try:
        return pa.ipc.open_stream(source).read_all()  # what `datasets` writes
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path}: not an Arrow IPC file ({exc})") from None


def _dataset_dir(path: Path, split: str) -> Path:
    """A DatasetDict directory -> the directory of ``split``; a Dataset directory -> itself."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return path
    try:
        splits = list(json.loads(index.read_text())["splits"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{index}: not a Hugging Face DatasetDict file ({exc!r})") from None
    for name in SPLIT_NAMES.get(split, (split,)):
        if name in splits:
            return path / name
    raise DataError(
        f"{path}: a DatasetDict with splits {splits}, none of them is the {split!r} split "
        f"(tried {list(SPLIT_NAMES.get(split, (split,)))}); name a split directory, e.g. "
        f"{path / splits[0]}"
    )


class ListSource:
    def __init__(self, records: list[dict], name: str):
        self.records, self.name = records, name

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        return dict(self.records[index], _where=f"{self.name}[{index}]")

    def __repr__(self):
        return f"ListSource({self.name!r}, {len(self)} records)"


class Concat:
    """Several sources read one after the other (``--data a.jsonl,b.parquet``)."""

    def __init__(self, sources):
        self.sources = list(sources)
        self._offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def part(self, index: int) -> tuple[int, int]:
        """(source number, index in that source) of record ``index``."""
        index = _row_index(index, len(self), "concatenated data")
        k = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return k, index - int(self._offsets[k])

    def __getitem__(self, index: int) -> dict:
        k, i = self.part(index)
        return self.sources[k][i]

    def __repr__(self):
        return f"{type(self).__name__}({self.sources!r})"


class Mixture(Concat):
    """Sources mixed with weights in training (``--data a.jsonl:0.7,b.jsonl:0.3``).

    ``train_batches`` shuffles and repeats each source on its own and mixes them with
    ``grain.MapDataset.mix``; as a random-access source (validation, evaluation) it reads like
    ``Concat``, and its indices are the concatenation's."""

    def __init__(self, sources, weights):
        super().__init__(sources)
        self.weights = [float(w) for w in weights]
        if len(self.weights) != len(self.sources):
            raise ValueError("one weight per source")
        bad = [w for w in self.weights if not (math.isfinite(w) and w > 0)]
        if bad:
            raise DataError(f"mixture weights must be positive numbers, got {self.weights}")


class Subset:
    """The records of ``src`` at ``indices`` (e.g. the good ones, from ``validate``)."""

    def __init__(self, src, indices):
        self.src = src
        self.indices = np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return self.src[int(self.indices[_row_index(index, len(self), self.src)])]

    def __repr__(self):
        return f"Subset({self.src!r}, {len(self)} records)"


BUILTIN_KINDS = {
    "sft": lambda a, b: arithmetic.sft_record(a, b),
    "preference": lambda a, b: arithmetic.preference_record(a, b),
    "unpaired_preference": lambda a, b: arithmetic.unpaired_record(a, b),
    "prompt_only": lambda a, b: arithmetic.prompt_record(a, b),
}


def source(spec: str, split: str = "train", builtin: str = "sft"):
    """A source from a ``--data`` value.

    ``spec`` is 'builtin' (the arithmetic task, in the format ``builtin`` names: 'sft',
    'preference', 'unpaired_preference' or 'prompt_only'), a path (``.jsonl``, ``.parquet``, ``.arrow``, or a Hugging Face
    ``datasets`` directory; for a ``DatasetDict`` directory, ``split`` picks the split: 'eval' tries
    eval, validation, valid, test), or several of them separated by commas: concatenated
    (``Concat``), or, when every one has a weight (``a.jsonl:0.7,b.jsonl:0.3``), mixed in training
    with these weights (``Mixture``).
    """
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise DataError(f"{spec!r}: empty entry in the list of data files")
    named = [_weighted(p) for p in parts]
    weights = [w for _, w in named]
    sources = [_one_source(name, split, builtin) for name, _ in named]
    if all(w is None for w in weights):
        return sources[0] if len(sources) == 1 else Concat(sources)
    if any(w is None for w in weights):
        raise DataError(
            f"{spec}: give every file a weight (a.jsonl:0.7,b.jsonl:0.3) to mix them, or none to "
            "concatenate them"
        )
    return Mixture(sources, weights)


def _weighted(part: str) -> tuple[str, float | None]:
    head, sep, tail = part.rpartition(":")
    if not sep or not head:
        return part, None
    try:
        weight = float(tail)
    except ValueError:
        return part, None
    if not (math.isfinite(weight) and weight > 0):
        raise DataError(f"{part}: the mixture weight must be a positive number, got {tail!r}")
    return head, weight


def _one_source(spec: str, split: str, builtin: str = "sft"):
    if spec == "builtin":
        make = BUILTIN_KINDS[builtin]
        return ListSource([make(a, b) for a, b in arithmetic.problems(split)],
                          f"builtin:{builtin}:{split}")
    path = Path(spec)
    if path.is_dir():
        return ArrowSource(_dataset_dir(path, split))
    if spec.endswith(".jsonl"):
        return JsonlSource(path)
    if spec.endswith(".parquet"):
        return ParquetSource(path)
    if spec.endswith(".arrow"):
        return ArrowSource(path)
    if not path.suffix and not path.exists():
        raise DataError(f"{spec}: no such data file or directory")
    raise DataError(
        f"{spec}: unsupported data file (expected 'builtin', a .jsonl, .parquet or .arrow file, or a "
        "Hugging Face datasets directory)"
    )


def extra_columns(src, indices, exclude=("prompt",)) -> list[dict]:
    """The raw columns of the records at ``indices`` (e.g. a prompt-only batch's ``index``), minus
    ``exclude`` and the private ``_where``; index -1 (a padding row) gives ``{}``. For RL: reward
    functions get the extra columns of a dataset (an ``answer``, a test case, ...) this way."""
    out = []
    for i in np.asarray(indices).reshape(-1):
        if int(i) < 0:
            out.append({})
            continue
        record = src[int(i)]
        out.append({k: v for k, v in record.items() if k not in exclude and not k.startswith("_")})
    return out


# ============================================================================= formats


def _where(record) -> str:
    return record.get("_where", "?")


def _columns(record) -> set:
    """Columns that hold a value: a null (a missing value in Parquet / Arrow) counts as absent."""
    return {k for k, v in record.items() if not k.startswith("_") and v is not None}


def detect_format(record: dict) -> str:
    """The record's format from its columns: one of ``RECORD_FORMATS``."""
    keys = _columns(record)
    if {"chosen", "rejected"} <= keys:
        return "preference"
    if {"completion", "label"} <= keys:
        return "unpaired_preference"
    if "messages" in keys:
        return "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "text" in keys:
        return "text"
    if "prompt" in keys:
        return "prompt_only"
    raise DataError(
        f"{_where(record)}: cannot tell the format from columns {sorted(keys)}; expected 'messages' "
        "or 'text' (language modelling), 'prompt' + 'completion', 'chosen' + 'rejected' "
        "(preference), 'prompt' + 'completion' + 'label' (unpaired preference), or 'prompt' alone"
    )


def coarse_format(record_format: str) -> str:
    """'messages' / 'text' -> 'language_modeling'; the other formats are themselves."""
    return "language_modeling" if record_format in ("messages", "text") else record_format


def data_format(src, format: str = "auto", scan: int = 100) -> str:
    """The data's format (one of ``FORMATS``): ``format`` itself unless it is 'auto', else detected
    from the first of the first ``scan`` records that can be read and recognised."""
    if format != "auto":
        if format not in FORMATS:
            raise ValueError(f"unknown data format {format!r}; expected 'auto' or one of {FORMATS}")
        return format
    first_error = None
    for i in range(min(len(src), scan)):
        try:
            return coarse_format(detect_format(src[i]))
        except DataError as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    raise DataError(f"{src!r}: no records")


def _require_str(record, field, allow_empty=False):
    value = record.get(field)
    where = _where(record)
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return value


def _value(record, field, allow_empty=False):
    """A prompt / completion value: a string or a list of messages."""
    where = _where(record)
    if record.get(field) is None:
        raise DataError(f"{where}: field '{field}' is missing")
    value = record[field]
    if isinstance(value, str):
        if not allow_empty and not value.strip():
            raise DataError(f"{where}: field '{field}' is empty")
    elif isinstance(value, list):
        if not allow_empty and not value:
            raise DataError(f"{where}: field '{field}' is empty")
    else:
        raise DataError(
            f"{where}: field '{field}' must be a string or a list of messages, got {type(value).__name__}"
        )
    return value


def _same_kind(record, first, second, a, b):
    if isinstance(a, str) != isinstance(b, str):
        raise DataError(
            f"{_where(record)}: fields '{first}' and '{second}' must both be strings or both be lists "
            f"of messages, got {type(a).__name__} and {type(b).__name__}"
        )


def implicit_prompt(chosen, rejected):
    """TRL's implicit prompt: (prompt, chosen, rejected) where the prompt is the longest common
    prefix of chosen and rejected — the common leading messages of two conversations, or the
    common leading characters of two strings (as in TRL's ``extract_prompt``, a space just before
    the point where they differ goes to the completions, where a tokenizer expects it)."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and 0 < n < limit and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _lm_segments(record, fmt, chat_format):
    where = _where(record)
    if fmt == "messages":
        msgs = record["messages"]
        try:
            segs = chat.render(msgs, chat_format)
        except chat.ChatFormatError as exc:
            raise DataError(f"{where}: field 'messages': {exc}") from None
        if not any(flag for _, flag in segs):
            raise DataError(f"{where}: field 'messages' has no assistant turn to learn from")
        if any(m["role"] == "assistant" and not m["content"].strip() for m in msgs):
            raise DataError(f"{where}: field 'messages' has an empty assistant turn")
        return segs, False
    text = _require_str(record, "text")
    return [(text, True)], True


def _prompt_completion(record, pfield, cfield, chat_format, prompt=None, completion=None):
    """(prompt segments, completion segments, add_eos) of a prompt and a completion that are both
    strings or both message lists (read from the record's fields unless given)."""
    where = _where(record)
    if prompt is None:
        prompt = _value(record, pfield, allow_empty=True)
    if completion is None:
        completion = _value(record, cfield)
    _same_kind(record, pfield, cfield, prompt, completion)
    if isinstance(prompt, str):
        return [(prompt, False)] if prompt else [], [(completion, True)], True
    for field_name, msgs in ((pfield, prompt), (cfield, completion)):
        if msgs:
            try:
                chat.render(msgs, chat_format)
            except chat.ChatFormatError as exc:
                raise DataError(f"{where}: field '{field_name}': {exc}") from None
    if any(m["role"] == "assistant" and not m["content"].strip() for m in completion):
        raise DataError(f"{where}: field '{cfield}' has an empty assistant turn")
    full = chat.render(prompt + completion, chat_format)
    head = chat.to_text(prompt, chat_format, add_generation_prompt=True) if prompt else ""
    if not "".join(t for t, _ in full).startswith(head):  # the completion opens with no assistant turn
        head = chat.to_text(prompt, chat_format)
    before, after = _cut(full, len(head))
    if not any(flag for _, flag in after):
        raise DataError(f"{where}: field '{cfield}' has no assistant turn to learn from")
    # nothing in the prompt's text carries loss (not even a few-shot assistant turn); after it,
    # the template's own flags (assistant content + end-of-turn marker, not the turn headers)
    return [(t, False) for t, _ in before], after, False


def _cut(segs, n_chars):
    """Segments before and after character ``n_chars`` (a segment across it is split)."""
    before, after, pos = [], [], 0
    for text, flag in segs:
        if pos + len(text) <= n_chars:
            before.append((text, flag))
        elif pos >= n_chars:
            after.append((text, flag))
        else:
            cut = n_chars - pos
            before.append((text[:cut], flag))
            after.append((text[cut:], flag))
        pos += len(text)
    return before, after


# ============================================================================= tokenization


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


def _sequence(tok, chat_format, head, tail, add_eos, max_length, truncation, max_prompt_length):
    """BOS + prompt (kept to ``max_prompt_length``) + completion (+ EOS), padded to ``max_length``."""
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

    def __post_init__(self):
        _check_lengths(self)
        if self.format not in ("auto", "language_modeling", "prompt_completion"):
            raise ValueError(f"Tokenize: format must be 'auto', 'language_modeling' or "
                             f"'prompt_completion', got {self.format!r}")

    def __call__(self, record: dict) -> dict:
        fmt = self._record_format(record)
        tok = self.tokenizer
        if fmt == "prompt_completion":
            head, tail, add_eos = _prompt_completion(record, "prompt", "completion", self.chat_format)
            return _sequence(tok, self.chat_format, head, tail, add_eos, self.max_length,
                             self.truncation, self.max_prompt_length)
        segs, add_eos = _lm_segments(record, fmt, self.chat_format)
        return _sequence(tok, self.chat_format, [], segs, add_eos, self.max_length, self.truncation,
                         None)

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

    def __post_init__(self):
        _check_lengths(self)


@dataclass
class TokenizePreference(_SequenceTransform):
    """A preference record (``chosen``, ``rejected``, explicit or implicit ``prompt``) -> prompt +
    chosen and prompt + rejected, each ``max_length`` long: ``chosen_input_ids``,
    ``chosen_attention_mask``, ``chosen_loss_mask`` (the completion's tokens only), the same for
    ``rejected_``, and ``truncated`` (1 if either side was cut)."""

    kind: ClassVar[str] = "preference"

    def __call__(self, record: dict) -> dict:
        prompt, chosen, rejected = preference_parts(record)
        out, truncated = {}, 0
        for name, completion in (("chosen", chosen), ("rejected", rejected)):
            head, tail, add_eos = _prompt_completion(record, "prompt", name, self.chat_format,
                                                     prompt=prompt, completion=completion)
            ex = _sequence(self.tokenizer, self.chat_format, head, tail, add_eos, self.max_length,
                           self.truncation, self.max_prompt_length)
            truncated |= int(ex.pop("truncated"))
            out.update({f"{name}_{k}": v for k, v in ex.items()})
        out["truncated"] = np.int32(truncated)
        return out


def preference_parts(record: dict):
    """(prompt, chosen, rejected) of a preference record, the prompt implicit when absent."""
    where = _where(record)
    chosen, rejected = _value(record, "chosen"), _value(record, "rejected")
    _same_kind(record, "chosen", "rejected", chosen, rejected)
    if record.get("prompt") is not None:
        prompt = _value(record, "prompt", allow_empty=True)
        _same_kind(record, "prompt", "chosen", prompt, chosen)
        return prompt, chosen, rejected
    prompt, chosen, rejected = implicit_prompt(chosen, rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or (isinstance(value, str) and not value.strip()):
            raise DataError(
                f"{where}: field '{name}' is empty once the implicit prompt (the common start of "
                "'chosen' and 'rejected') is removed; give the prompt in a 'prompt' column"
            )
    return prompt, chosen, rejected


@dataclass
class TokenizeUnpaired(_SequenceTransform):
    """An unpaired preference record (``prompt``, ``completion``, boolean ``label``) ->
    ``input_ids``, ``attention_mask``, ``loss_mask`` (completion only), ``label`` (1.0 desirable,
    0.0 undesirable), ``truncated``."""

    kind: ClassVar[str] = "unpaired_preference"

    def __call__(self, record: dict) -> dict:
        where = _where(record)
        if record.get("label") is None:
            raise DataError(f"{where}: field 'label' is missing")
        label = record["label"]
        if not isinstance(label, (bool, np.bool_)):
            raise DataError(f"{where}: field 'label' must be a boolean (true or false), got "
                            f"{type(label).__name__}")
        head, tail, add_eos = _prompt_completion(record, "prompt", "completion", self.chat_format)
        ex = _sequence(self.tokenizer, self.chat_format, head, tail, add_eos, self.max_length,
                       self.truncation, self.max_prompt_length)
        ex["label"] = np.float32(bool(label))
        return ex


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

    def __post_init__(self):
        _check_lengths(self)

    def __call__(self, record: dict) -> dict:
        prompt = _value(record, "prompt")
        if isinstance(prompt, list):
            try:
                segs = chat.render(prompt, self.chat_format, add_generation_prompt=True)
            except chat.ChatFormatError as exc:
                raise DataError(f"{_where(record)}: field 'prompt': {exc}") from None
        else:
            segs = [(prompt, False)]
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
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": mask,
            "truncated": np.int32(truncated),
            "index": np.int64(record.get("_index", -1)),
        }


def make_transform(src, tokenizer, chat_format: str, max_length: int, truncation: str = "keep_start",
                   max_prompt_length: int | None = None, format: str = "auto"):
    """The transform for the data's format (``format``, or detected from ``src`` when 'auto'):
    ``Tokenize`` for language modelling and prompt-completion, ``TokenizePreference``,
    ``TokenizeUnpaired``, or ``TokenizePrompt`` (``max_prompt_length``, default ``max_length``).
    The transform's ``kind`` ('sft', 'preference', 'unpaired_preference', 'prompt_only') says what
    its examples hold. An algorithm that needs another view (e.g. prompts of preference data for
    RL) builds that transform itself."""
    fmt = data_format(src, format)
    if fmt in ("language_modeling", "prompt_completion"):
        return Tokenize(tokenizer, chat_format, max_length, truncation, max_prompt_length, format)
    if fmt == "preference":
        return TokenizePreference(tokenizer, chat_format, max_length, truncation, max_prompt_length)
    if fmt == "unpaired_preference":
        return TokenizeUnpaired(tokenizer, chat_format, max_length, truncation, max_prompt_length)
    return TokenizePrompt(tokenizer, chat_format, max_prompt_length or max_length)


# ============================================================================= validation


@dataclass
class ValidationReport:
    """What ``validate`` found. ``report["records"]`` also works (the former dict)."""

    records: int
    """Records read."""
    good_indices: np.ndarray
    """Indices (into the source) of the records that tokenize."""
    bad: int
    """Records skipped as bad (``skip_bad``)."""
    bad_examples: list[str] = field(default_factory=list)
    """The first few errors, each naming the file, the line or row and the field."""
    truncated: int = 0
    """Good records cut to fit ``max_length`` / ``max_prompt_length``."""
    no_loss_tokens: int = 0
    """Good records left with no token to learn from (a loss mask of zeros)."""

    def __getitem__(self, key):
        return getattr(self, key)


def validate(src, transform, skip_bad: bool = False, max_examples: int = 5) -> ValidationReport:
    """Read and tokenize every record before training, one at a time (nothing is kept).

    By default the first bad record (malformed JSON, a missing column, a value of the wrong type,
    an empty completion, ...) stops the run here with a ``DataError`` naming its file, line and
    field, instead of hours into training. With ``skip_bad`` bad records are counted and skipped:
    ``only_good(src, report)`` then serves the good ones; if none is good it still fails.
    """
    n = len(src)
    if n == 0:
        raise DataError(f"{_name(src)}: no records")
    good = np.zeros(n, bool)
    bad, examples, truncated, no_loss = 0, [], 0, 0
    for i in range(n):
        try:
            ex = transform(src[i])
        except DataError as exc:
            if not skip_bad:
                raise
            bad += 1
            if len(examples) < max_examples:
                examples.append(str(exc))
            continue
        good[i] = True
        truncated += int(ex["truncated"])
        no_loss += int(any(v.sum() == 0 for k, v in ex.items() if k.endswith("loss_mask")))
    if bad == n:
        raise DataError(f"{_name(src)}: all {n} records are bad; the first: {examples[0]}")
    return ValidationReport(n, np.flatnonzero(good), bad, examples, truncated, no_loss)


def _name(src) -> str:
    return str(getattr(src, "path", getattr(src, "name", src)))


def only_good(src, report: ValidationReport):
    """``src`` restricted to the records ``validate`` found good: ``src`` itself when all are,
    else a ``Subset`` (a ``Mixture`` of ``Subset``s for a mixture, its weights kept)."""
    indices = report.good_indices
    if len(indices) == len(src):
        return src
    if not isinstance(src, Mixture):
        return Subset(src, indices)
    parts = []
    for k, part in enumerate(src.sources):
        lo, hi = int(src._offsets[k]), int(src._offsets[k + 1])
        mine = indices[(indices >= lo) & (indices < hi)] - lo
        if not len(mine):
            raise DataError(f"{_name(part)}: no good records left in this part of the mixture")
        parts.append(part if len(mine) == len(part) else Subset(part, mine))
    return Mixture(parts, src.weights)


# ============================================================================= batches


class _WithIndex:
    """Adds ``_index`` (offset + index) to each record: a prompt-only example's ``index``."""

    def __init__(self, src, offset: int = 0):
        self.src, self.offset = src, offset

    def __len__(self):
        return len(self.src)

    def __getitem__(self, index):
        return dict(self.src[index], _index=self.offset + int(index))


def _part_seed(seed: int, part: int) -> int:
    return int(np.random.SeedSequence([seed, part]).generate_state(1)[0])


def records_dataset(src, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """An endless ``MapDataset`` of records: shuffled by ``seed`` and reshuffled every epoch; a
    ``Mixture`` shuffles and repeats each part on its own, then mixes them by weight."""
    if isinstance(src, Mixture):
        parts = []
        for k, part in enumerate(src.sources):
            ds = grain.MapDataset.source(_WithIndex(part, int(src._offsets[k])))
            if shuffle:
                ds = ds.shuffle(seed=_part_seed(seed, k))
            parts.append(ds.repeat(None))
        return grain.MapDataset.mix(parts, src.weights)
    ds = grain.MapDataset.source(_WithIndex(src))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None)


def train_batches(src, transform, batch_size: int, seed: int, shuffle: bool = True,
                  num_workers: int = 0) -> grain.DatasetIterator:
    """Endless iterator of batches (dicts of ``[batch_size, ...]`` arrays), epoch after epoch.

    The order depends on ``seed`` only (each epoch reshuffled); a batch may span two epochs. The
    iterator's ``get_state()`` / ``set_state()`` save and restore its position exactly.
    ``num_workers > 0`` tokenizes in that many Grain worker processes (same batches, same order);
    call ``close()`` on the iterator when done with it.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    ds = records_dataset(src, seed, shuffle).map(transform).batch(batch_size, drop_remainder=True)
    if num_workers == 0:  # a few threads, a few batches ahead (Grain's default is 500 batches)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)))
    from absl import flags  # Grain reads its absl flags; this program has no absl command line

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    # each worker makes every num_workers-th batch, one at a time, up to 2 ahead
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=1))
    return iter(it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                             per_worker_buffer_size=2)))


def _unpad(example: dict) -> dict:
    """A padded SFT example -> its real tokens (what packing needs); ``truncated`` rides along as
    a sequence whose first element is the flag, so a packed row sums its examples' flags."""
    n = int(example["attention_mask"].sum())
    flag = np.zeros(n, np.int32)
    flag[:1] = example["truncated"]
    return {"input_ids": example["input_ids"][:n], "loss_mask": example["loss_mask"][:n],
            "truncated": flag}


def _packed_row(row: dict) -> dict:
    segments = row["input_ids_segment_ids"].astype(np.int32)
    loss_mask = row["loss_mask"] * (row["input_ids_positions"] > 0)  # never predict across examples
    return {
        "input_ids": row["input_ids"].astype(np.int32),
        "attention_mask": (segments > 0).astype(np.int32),
        "loss_mask": loss_mask.astype(np.float32),
        "segment_ids": segments,
        "truncated": np.int32(row["truncated"].sum()),
    }


def packed_train_batches(src, transform, batch_size: int, seed: int, shuffle: bool = True,
                         num_workers: int = 0) -> grain.DatasetIterator:
    """Like ``train_batches`` for SFT, with several examples packed into each ``max_length`` row
    (Grain's first-fit packing): ``segment_ids`` number the examples of a row (0 = padding), and
    the model's attention never crosses them (``model.hidden_states``)."""
    if getattr(transform, "kind", "sft") != "sft":
        raise ValueError("packing applies to SFT data only")
    length = transform.max_length
    ds = records_dataset(src, seed, shuffle).map(transform).map(_unpad)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=4 if not num_workers else 1,
                                              prefetch_buffer_size=8))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"input_ids": length, "loss_mask": length, "truncated": length},
        num_packing_bins=batch_size, seed=seed, shuffle_bins=shuffle,
    )
    ds = ds.map(_packed_row).batch(batch_size, drop_remainder=True)
    if num_workers:
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                         per_worker_buffer_size=2))
    return iter(ds)


def eval_batches(src, transform, batch_size: int, limit: int = 0) -> list[dict]:
    """The first ``limit`` full batches of the eval split in order (all when 0); the last partial
    batch is padded with examples whose masks are zero (and ``index`` -1), so every batch has the
    compiled shape."""
    n = len(src) if not limit else min(len(src), limit * batch_size)
    examples = [transform(dict(src[i], _index=i)) for i in range(n)]
    while len(examples) % batch_size:
        blank = {k: (np.full_like(v, -1) if k == "index" else np.zeros_like(v))
                 for k, v in examples[0].items()}
        examples.append(blank)
    return [
        {k: np.stack([e[k] for e in examples[i : i + batch_size]]) for k in examples[0]}
        for i in range(0, len(examples), batch_size)
    ]


def prompts_and_answers(src, chat_format: str, limit: int) -> list[tuple[list[tuple[str, bool]], str]]:
    """Held-out (prompt segments, reference answer) pairs for exact-match evaluation.

    A conversation whose last turn is the assistant's gives (the conversation before it, that
    turn); a prompt/completion record gives (prompt, completion); a preference pair gives
    (prompt, chosen); an unpaired example labelled desirable gives (prompt, completion); a
    prompt-only record with an ``answer`` column gives (prompt, answer).
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
            continue
        if fmt == "preference":
            p, c, _ = preference_parts(record)
        elif fmt in ("prompt_completion", "unpaired_preference"):
            if fmt == "unpaired_preference" and not record["label"]:
                continue
            p, c = record["prompt"], record["completion"]
        elif fmt == "prompt_only" and isinstance(record.get("answer"), str):
            p, c = record["prompt"], record["answer"]
        else:
            continue
        if isinstance(p, list):
            answer = c[-1]["content"] if isinstance(c, list) else c
            out.append((chat.render(p, chat_format, add_generation_prompt=True), answer))
        else:
            out.append(([(p, False)], c if isinstance(c, str) else c[-1]["content"]))
    return out
