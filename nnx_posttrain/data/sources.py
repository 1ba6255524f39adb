"""Random-access sources (``len`` + ``[i]``; nothing is loaded whole into memory):

- ``.jsonl``: line offsets are indexed once, a record is parsed when it is read;
- ``.parquet``: read one row group at a time with pyarrow (the last decoded group is cached);
- a Hugging Face ``datasets`` directory (what ``Dataset.save_to_disk`` writes: ``state.json`` and
  Arrow IPC stream files ``data-*.arrow``), memory-mapped with pyarrow (no ``datasets`` needed);
  a ``DatasetDict`` directory gives the split asked for;
- ``builtin``: the built-in task (``register_builtin``); hf://, Parquet folders, globs: ``hub``.

``Concat`` reads files one after the other, ``Mixture`` mixes them with weights (deterministically,
with ``grain.MapDataset.mix``); ``specs.source`` builds them from a ``--data`` value. Every record
carries ``_where``
("path:line" for JSONL, "path:row N" with N counted from 0 for Parquet and Arrow) so that an error
names the file and the line or row.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from nnx_posttrain.data.errors import DataError

# Names tried, in order, for a split of a Hugging Face DatasetDict directory.
SPLIT_NAMES = {"train": ("train",), "eval": ("eval", "validation", "valid", "test")}



MAX_RECORD_BYTES = 16 * 2**20
"""The longest JSONL record (one line) read, in bytes: a longer one is refused by its line before
it is parsed or tokenized (a single 50 MB record once cost 12 GB of memory). Conversations of
long-context training are well under it; raise it for records that really are longer."""


def source_name(src) -> str:
    """How a message names a source: its file's path, else its name, else the object."""
    return str(getattr(src, "path", getattr(src, "name", src)))

def _line_index(path: Path, piece: int = 2**20):
    """(starts, lengths, line numbers) of the non-blank lines of ``path``, read ``piece`` bytes at
    most at a time: indexing costs the index, never the longest line."""
    starts, lengths, numbers = [], [], []
    with path.open("rb") as f:
        pos = start = 0
        number, text = 1, False
        while True:
            part = f.readline(piece)
            pos += len(part)
            text = text or bool(part.strip())
            if part.endswith(b"\n") or not part:  # a line ends, or the file
                if text:  # blank lines are not records
                    starts.append(start), lengths.append(pos - start), numbers.append(number)
                if not part:
                    return starts, lengths, numbers
                start, number, text = pos, number + 1, False


class JsonlSource:
    """Random-access JSONL source: line offsets are indexed once, records are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such data file")
        starts, lengths, numbers = _line_index(self.path)
        self._starts = np.asarray(starts, np.int64)
        self._lengths = np.asarray(lengths, np.int64)
        self._numbers = np.asarray(numbers, np.int64)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> dict:
        where = f"{self.path}:{int(self._numbers[index])}"
        size = int(self._lengths[index])
        if size > MAX_RECORD_BYTES:
            raise DataError(f"{where}: a record of {size:,} bytes, over the {MAX_RECORD_BYTES:,} "
                            "bytes a record may have (nnx_posttrain.data.sources.MAX_RECORD_BYTES)")
        with self.path.open("rb") as f:
            f.seek(int(self._starts[index]))
            raw = f.read(size)
        try:
            text = raw.rstrip(b"\r\n").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                            f"{exc.start + 1})") from None
        try:
            record = json.loads(text)  # an error's column is then on this line
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise DataError(f"{where}: JSON nested too deeply to read (a record of text is a few "
                            "levels deep)") from None
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
    """Records in memory. ``fingerprint``: a built-in task's (``register_builtin``), which
    changes whenever its records do; ``validate`` keeps its results per fingerprint."""

    def __init__(self, records: list[dict], name: str, fingerprint: str | None = None):
        self.records, self.name, self.fingerprint = records, name, fingerprint

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
        for part in self.sources:
            if not len(part):
                raise DataError(f"{getattr(part, 'path', part)}: no records (a part of a mixture "
                                "must have some)")


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


# ============================================================================= built-in task

_builtins: dict[str, tuple[Callable[[str, str], list[dict]], str]] = {}


def register_builtin(records: Callable[[str, str], list[dict]], fingerprint: str,
                     name: str = "builtin") -> None:
    """Register a built-in task: ``records(kind, split)`` -> the list of records (dicts) that
    ``source(name, split, builtin=kind)`` serves, ``kind`` one of 'sft', 'preference',
    'unpaired_preference', 'prompt_only' and ``split`` 'train' or 'eval'; ``fingerprint`` changes
    whenever the records do (caches keyed on the data use it). ``name`` is the ``--data`` value
    that reads it: 'builtin' (the text task) or 'builtin:NAME' (another one, e.g.
    'builtin:shapes'). A later registration of a name replaces an earlier one."""
    if name != "builtin" and not name.startswith("builtin:"):
        raise ValueError(f"a built-in task's name is 'builtin' or 'builtin:NAME', got {name!r}")
    _builtins[name] = (records, fingerprint)


def builtin_registered(name: str = "builtin") -> bool:
    """Whether a built-in task is registered under ``name`` (``register_builtin``)."""
    return name in _builtins


def builtin_fingerprint(name: str = "builtin") -> str:
    """The registered built-in task's fingerprint (see ``register_builtin``)."""
    _builtin_provider(name)
    return _builtins[name][1]


def _builtin_provider(name: str = "builtin") -> Callable[[str, str], list[dict]]:
    if name not in _builtins:
        known = f" (registered: {', '.join(sorted(_builtins))})" if _builtins else ""
        raise DataError(f"{name}: no built-in task is registered under this name{known} (the "
                        "module that provides it, e.g. nnx_posttrain.tasks.register(), calls "
                        "nnx_posttrain.data.register_builtin)")
    return _builtins[name][0]
