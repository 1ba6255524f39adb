"""Where metrics go: ``metrics.jsonl`` (one JSON object per logged step), tensorboardX events under
``tb/``, and the console.

``metrics.jsonl`` is append-only: a resumed run removes only the records of steps after the
checkpoint it restarts from (which it logs again), rewriting the file atomically (a temporary
file renamed over it); a partial last line (a process killed mid-write) is dropped with a
message; a log that is missing, or removed while the run writes it, is created again, with a
message. ``--eval-only`` records are never removed (they carry ``"eval_only"``: which checkpoint
they scored).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path


def _summary_writer():
    """tensorboardX's SummaryWriter. tensorboardX imports torch whenever it is installed (only to
    accept torch tensors, which never reach it here): ~1,200 modules, seconds of start-up and
    resident memory in every training process of an environment that also has torch (e.g. the
    bench extra). Hidden from that import unless something already imported it."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX goes without
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _clean(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


class MetricsLog:
    def __init__(self, run_dir: Path, keep_until: int | None = None, echo=print):
        """The run's log, opened for appending. ``keep_until`` (a training run starting from
        that step; -1 from scratch): the records of later steps are removed first, except
        ``--eval-only`` ones; None (``--eval-only``): nothing is removed."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self._echo = echo
        if keep_until is not None:
            trim(self.path, keep_until, self._say)
        self._file = self._open()
        self._tb = _summary_writer()(str(Path(run_dir) / "tb"))

    def _say(self, text: str) -> None:
        if self._echo is not None:
            self._echo(text)

    def _open(self):
        return self.path.open("a")

    def _write(self, line: str, step: int) -> None:
        try:  # removed or replaced while the run writes it: a new file, said once
            replaced = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:
            self._file.close()
            self._file = self._open()
            self._say(f"{self.path} was removed during the run; writing a new one from step "
                      f"{step} (earlier records are not in it)")
        self._file.write(line)
        self._file.flush()

    def log(self, step: int, split: str, metrics: dict, echo: bool = True,
            fields: dict | None = None) -> dict:
        """Append one record; ``fields``: non-metric entries of the JSON record only."""
        record = {"step": int(step), "split": split, **{k: _clean(v) for k, v in metrics.items()}}
        record.update(fields or {})
        self._write(json.dumps(record) + "\n", step)
        for name, value in metrics.items():
            self._tb.add_scalar(f"{split}/{name}", float(value), int(step))
        if echo and self._echo is not None:
            shown = "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            self._echo(f"[{split} step {step}] {shown}")
        return record

    def close(self):
        self._file.close()
        self._tb.close()


def trim(path: Path, keep_until: int, echo=print) -> None:
    """Remove the records of steps after ``keep_until`` from the log at ``path`` (but not the
    ``--eval-only`` ones, nor lines that are not JSON in the middle of the file), atomically;
    a partial last line is dropped; a missing log is reported."""
    if not path.exists():
        if keep_until > 0:
            echo(f"{path} is missing; starting a new one (the records up to step {keep_until} "
                 "are not in it)")
        return
    lines = path.read_text().splitlines(keepends=True)
    kept, dropped, later = [], 0, 0
    for n, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines) - 1:
                echo(f"{path}: dropped a partial last line (a process stopped while writing it)")
                dropped += 1
            else:
                kept.append(line)
            continue
        if record.get("eval_only") or record.get("step", 0) <= keep_until:
            kept.append(line if line.endswith("\n") else line + "\n")
        else:
            dropped, later = dropped + 1, later + 1
    if later:
        echo(f"{path}: removed {later} records of steps after {max(keep_until, 0)} (this run "
             "logs those steps again)")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _fmt(v) -> str:
    v = float(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"


def read(run_dir: str | Path) -> list[dict]:
    """The records of a run's log (a partial last line, of a process killed mid-write, left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for n, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if n < len(lines) - 1:
                raise
    return out


class SecondaryLog:
    """Metrics of processes other than 0 of a multi-process run: returned, never written."""

    def log(self, step, split, metrics, echo=True, fields=None):
        return {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()},
                **(fields or {})}

    def close(self):
        pass
