"""Validation before training: every record is read and tokenized once, bad ones reported (or
skipped), and the source restricted to the good ones. A process that validates the same data
the same way again (runs of a sweep, a notebook, the tests) reuses the first report: data known
by its content (a built-in task's fingerprint; a file's path, size and times) and a transform
known by its settings and its tokenizer's fingerprint (``_key``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nnx_posttrain.data import sources
from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.sources import Concat, ListSource, Mixture, Subset, source_name

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
    no_loss_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Their indices (``only_good(..., drop_no_loss=True)`` leaves them out)."""
    identical_pairs: int = 0
    """Preference pairs whose chosen and rejected sides tokenize to the same sequence (no
    preference to learn)."""
    desirable: int = 0
    """Good unpaired-preference records labelled desirable (KTO)."""
    undesirable: int = 0
    """... and undesirable."""

    def __getitem__(self, key):
        return getattr(self, key)


def validate(src, transform, skip_bad: bool = False, max_examples: int = 5) -> ValidationReport:
    """Read and tokenize every record before training, one at a time (nothing is kept).

    By default the first bad record (malformed JSON, a missing column, a value of the wrong type,
    an empty completion, ...) stops the run here with a ``DataError`` naming its file, line and
    field, instead of hours into training. With ``skip_bad`` bad records are counted and skipped:
    ``only_good(src, report)`` then serves the good ones; if none is good it still fails.
    The same data validated the same way again in this process returns the first report (a
    copy) without reading a record; a changed file is validated again (``_key``).
    """
    key = _key(src, transform, skip_bad, max_examples)
    if key is not None and key in _REPORTS:
        return _copy(_REPORTS[key])
    report = _validate(src, transform, skip_bad, max_examples)
    if key is not None:
        while len(_REPORTS) >= _KEEP:
            _REPORTS.pop(next(iter(_REPORTS)))
        _REPORTS[key] = _copy(report)
    return report


def _validate(src, transform, skip_bad: bool, max_examples: int) -> ValidationReport:
    n = len(src)
    if n == 0:
        raise DataError(f"{source_name(src)}: no records")
    good, no_loss = np.zeros(n, bool), np.zeros(n, bool)
    bad, examples, truncated, identical, labels = 0, [], 0, 0, [0, 0]
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
        no_loss[i] = any(v.sum() == 0 for k, v in ex.items() if k.endswith("loss_mask"))
        if "label" in ex:
            labels[int(ex["label"] > 0)] += 1
        if "chosen_input_ids" in ex:
            identical += int(np.array_equal(ex["chosen_input_ids"], ex["rejected_input_ids"])
                             and np.array_equal(ex["chosen_loss_mask"], ex["rejected_loss_mask"]))
    if bad == n:
        raise DataError(f"{source_name(src)}: all {n} records are bad; the first: {examples[0]}")
    return ValidationReport(n, np.flatnonzero(good), bad, examples, truncated,
                            int(no_loss.sum()), np.flatnonzero(no_loss), identical,
                            labels[1], labels[0])


# Reports of this process's validations: (data, transform, skip_bad, max_examples) -> report;
# the oldest dropped past _KEEP
_REPORTS: dict = {}
_KEEP = 16
_PLAIN = (str, int, float, bool, type(None))


def _copy(report: ValidationReport) -> ValidationReport:
    return dataclasses.replace(report, good_indices=report.good_indices.copy(),
                               bad_examples=list(report.bad_examples),
                               no_loss_indices=report.no_loss_indices.copy())


def _key(src, transform, skip_bad: bool, max_examples: int):
    """What a validation's report depends on, or None where it cannot be told (not kept): the
    data's content (``_data_key``) and the transform's class, settings and tokenizer (its
    ``fingerprint``; a transform with other state, a vision model's images, is not kept)."""
    data = _data_key(src)
    if data is None or not dataclasses.is_dataclass(transform):
        return None
    settings = []
    for f in dataclasses.fields(transform):
        value = getattr(transform, f.name)
        if f.name == "tokenizer":
            value = getattr(value, "fingerprint", None)
            if value is None:
                return None
        elif not isinstance(value, _PLAIN):
            return None
        settings.append((f.name, value))
    kind = f"{type(transform).__module__}.{type(transform).__qualname__}"
    return data, kind, tuple(settings), bool(skip_bad), int(max_examples)


def _data_key(src):
    """A built-in task's records: its name and fingerprint. A JSONL or Parquet file: its path,
    size, modification and change times and inode (any write changes one), and the record size
    limit. Concatenations, mixtures and subsets of those: their parts'. Else None."""
    if isinstance(src, ListSource):
        fingerprint = getattr(src, "fingerprint", None)
        return None if fingerprint is None else ("builtin", src.name, fingerprint, len(src))
    if isinstance(src, Subset):
        inner = _data_key(src.src)
        return None if inner is None else ("subset", inner, src.indices.tobytes())
    if isinstance(src, Concat):
        parts = tuple(_data_key(part) for part in src.sources)
        weights = tuple(src.weights) if isinstance(src, Mixture) else None
        return None if None in parts else ("concat", parts, weights)
    if isinstance(src, (sources.JsonlSource, sources.ParquetSource)):
        path = Path(src.path).resolve()
        if not path.is_file():
            return None
        st = path.stat()
        return ("file", str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                sources.MAX_RECORD_BYTES)
    return None


def only_good(src, report: ValidationReport, drop_no_loss: bool = False):
    """``src`` restricted to the records ``validate`` found good (and, with ``drop_no_loss``,
    with a token to learn from): ``src`` itself when all are, else a ``Subset`` (a ``Mixture`` of
    ``Subset``s for a mixture, its weights kept)."""
    indices = report.good_indices
    if drop_no_loss and len(report.no_loss_indices):
        indices = np.setdiff1d(indices, report.no_loss_indices)
    if len(indices) == len(src):
        return src
    if not isinstance(src, Mixture):
        return Subset(src, indices)
    parts = []
    for k, part in enumerate(src.sources):
        lo, hi = int(src._offsets[k]), int(src._offsets[k + 1])
        mine = indices[(indices >= lo) & (indices < hi)] - lo
        if not len(mine):
            raise DataError(f"{source_name(part)}: no good records left in this part of the mixture"
                            + (" (bad, or with no loss token left)" if drop_no_loss else ""))
        parts.append(part if len(mine) == len(part) else Subset(part, mine))
    return Mixture(parts, src.weights)
