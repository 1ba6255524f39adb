"""``--data`` values -> sources (``source``), and what a run records of its data (``signature``).

A value is 'builtin', a path (``.jsonl``, ``.parquet``, ``.arrow``, a Hugging Face ``datasets``
directory), or several separated by commas: concatenated, or mixed when each has a weight
(``a.jsonl:0.7,b.jsonl:0.3``).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from nnx_posttrain.data import hub
from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.sources import (ArrowSource, Concat, JsonlSource, ListSource, Mixture,
                                        ParquetSource, _builtin_provider, _dataset_dir,
                                        builtin_fingerprint)

# File names a --data entry may end with (before a mixture weight).
DATA_SUFFIXES = (".jsonl", ".parquet", ".arrow")

def source(spec: str, split: str = "train", builtin: str = "sft"):
    """A source from a ``--data`` value.

    ``spec`` is 'builtin' (the built-in task, see ``register_builtin``; 'builtin:NAME' another
    registered one, e.g. 'builtin:shapes'; in the format ``builtin`` names: 'sft',
    'preference', 'unpaired_preference' or 'prompt_only'), a path (``.jsonl``,
    ``.parquet``, ``.arrow``, or a Hugging Face ``datasets`` directory; for a ``DatasetDict``
    directory, ``split`` picks the split: 'eval' tries eval, validation, valid, test), or several
    of them separated by commas: concatenated (``Concat``), or, when every one has a weight
    (``a.jsonl:0.7,b.jsonl:0.3``), mixed in training with these weights (``Mixture``).
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


def _is_builtin(spec: str) -> bool:
    """'builtin' (the text task) or 'builtin:NAME' (another built-in task, e.g. the image one)."""
    return spec == "builtin" or (spec.startswith("builtin:") and not Path(spec).exists())


def _weighted(part: str) -> tuple[str, float | None]:
    head, sep, tail = part.rpartition(":")
    if not sep or not head:
        return part, None
    try:
        weight = float(tail)
    except ValueError:
        if Path(part).exists() or not (head.endswith(DATA_SUFFIXES) or Path(head).exists()):
            return part, None
        raise DataError(f"{part}: bad weight {tail!r} (a mixture weight is a positive number: "
                        f"{head}:0.7)") from None
    if not (math.isfinite(weight) and weight > 0):
        raise DataError(f"{part}: the mixture weight must be a positive number, got {tail!r}")
    return head, weight


def _one_source(spec: str, split: str, builtin: str = "sft"):
    if _is_builtin(spec):
        return ListSource(_builtin_provider(spec)(builtin, split), f"{spec}:{builtin}:{split}",
                          builtin_fingerprint(spec))
    if (found := hub.files(spec, split)) is not None:  # hf://, a folder of Parquet shards, a glob
        parts = [_one_source(str(f), split, builtin) for f in found]
        return parts[0] if len(parts) == 1 else Concat(parts)
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
        f"{spec}: unsupported data file (expected 'builtin', a .jsonl, .parquet or .arrow file, a "
        "Hugging Face datasets directory or Parquet folder, a glob, or hf://ORG/NAME)"
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


def signature(spec: str | None) -> list | None:
    """What a run's record keeps of its data, to refuse a resume on other data: per part of a
    ``--data`` value, its file name (not the directory: a moved file is the same data), weight,
    size and a SHA-256 of its first and last 64 KiB (every file of a directory); the built-in
    task's fingerprint for ``builtin``. A change inside a file that keeps its size and both ends
    is not seen (hashing whole data sets at every start would cost minutes)."""
    if not spec:
        return None
    out = []
    for part in (p.strip() for p in spec.split(",")):
        name, weight = (part, None) if Path(part).exists() else _weighted(part)
        if _is_builtin(name):
            out.append([name, weight, builtin_fingerprint(name)])
            continue
        path = Path(name)
        if name.startswith(hub.PREFIX) or (any(c in name for c in "*?[") and not path.exists()):
            # a Hub handle (its cached snapshot's files) or a glob: the files it names today
            found = hub.files(name, "train") or []
            out.append([name, weight, [[f.name, *_file_signature(f)] for f in found]])
            continue
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        out.append([path.name, weight, [[str(f.relative_to(path)) if path.is_dir() else f.name,
                                         *_file_signature(f)] for f in files]])
    return out


def _file_signature(path: Path, span: int = 1 << 16) -> list:
    if not path.is_file():
        return [None, None]
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            digest.update(f.read(span))
    return [size, digest.hexdigest()[:16]]
