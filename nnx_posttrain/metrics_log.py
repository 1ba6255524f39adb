"""Where metrics go: a small set of writers behind ``MetricsLog`` (``--report-to``), and the console.

- ``jsonl``: ``metrics.jsonl`` (one JSON object per logged step: ``{"step", "split", metric: value,
  ...}``) and ``completions.jsonl`` (one JSON object per logged completion);
- ``tensorboard``: tensorboardX events under ``tb/`` (scalars ``<split>/<metric>``; completions as
  text ``<split>/completions``);
- ``wandb``: Weights & Biases (imported only when asked; ``WANDB_PROJECT``, ``WANDB_ENTITY``,
  ``WANDB_MODE=offline`` as usual; the run's config is the W&B config; completions as a table).

A writer has ``scalars(record, metrics)`` (the JSON record; its metrics alone),
``completions(step, split, rows)`` and ``close()``.

The JSONL files are append-only: a resumed run removes only the records of steps after the
checkpoint it restarts from (which it logs again), rewriting the file atomically (a temporary
file renamed over it); a partial last line (a process killed mid-write) is dropped with a
message; a log that is missing, or removed while the run writes it, is created again, with a
message. ``--eval-only`` records are never removed (they carry ``"eval_only"``: which checkpoint
they scored).
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

from nnx_posttrain import errors

# Completions shown in a TensorBoard text summary (completions.jsonl has all of them).
TEXT_ROWS = 16


def _summary_writer():
    """tensorboardX's SummaryWriter, imported when a run first logs to TensorBoard. Without
    PyTorch: tensorboardX imports it where it is installed (to accept its tensors; a run logs
    floats), seconds of a run's start and hundreds of MB of memory; a process that has already
    imported PyTorch keeps it."""
    import sys

    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError, as where it is absent
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


def _clean(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _json_value(value):
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, (int, float)) or hasattr(value, "__float__"):
        return _clean(value)
    return str(value)


class _AppendFile:
    """A JSONL file opened for appending, created again (with a message) when it is removed or
    replaced while the run writes it."""

    def __init__(self, path: Path, say):
        self.path, self._say = path, say
        self._file = path.open("a")

    def write(self, lines: list[str], step: int) -> None:
        try:
            replaced = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:
            self._file.close()
            self._file = self.path.open("a")
            self._say(f"{self.path} was removed during the run; writing a new one from step "
                      f"{step} (earlier records are not in it)")
        self._file.writelines(lines)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class JsonlWriter:
    """``metrics.jsonl`` and ``completions.jsonl``. ``keep_until``: a training run starting from
    that step (-1 from scratch) first removes the records of later steps (``trim``); None
    (``--eval-only``) removes nothing."""

    def __init__(self, run_dir: Path, keep_until: int | None = None, say=print):
        self.path = run_dir / "metrics.jsonl"
        self.completions_path = run_dir / "completions.jsonl"
        self._say = say
        if keep_until is not None:
            trim(self.path, keep_until, say)
            trim(self.completions_path, keep_until, say, missing_ok=True)
        self._file = _AppendFile(self.path, say)
        self._completions = None  # opened at the first completion

    def scalars(self, record: dict, metrics: dict) -> None:
        self._file.write([json.dumps(record) + "\n"], record["step"])

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        if not rows:
            return
        if self._completions is None:
            self._completions = _AppendFile(self.completions_path, self._say)
        self._completions.write(
            [json.dumps({"step": int(step), "split": split,
                         **{k: _json_value(v) for k, v in row.items()}}) + "\n" for row in rows],
            step)

    def close(self) -> None:
        for f in (self._file, self._completions):
            if f is not None:
                f.close()


def trim(path: Path, keep_until: int, echo=print, missing_ok: bool = False) -> None:
    """Remove the records of steps after ``keep_until`` from the log at ``path`` (but not the
    ``--eval-only`` ones, nor lines that are not JSON in the middle of the file), atomically;
    a partial last line is dropped; a missing log is reported."""
    if not path.exists():
        if keep_until > 0 and not missing_ok:
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


class TensorBoardWriter:
    """tensorboardX's writer, whose thread writes the event file. A failed write ends that
    thread (a full disk, say) and would leave the next events blocked on its queue: each event
    first checks the thread, and a dead one raises its error here, in the run."""

    def __init__(self, run_dir: Path):
        self._dir = run_dir / "tb"
        self._tb = _summary_writer()(str(self._dir), max_queue=1000)

    def _check(self) -> None:
        worker = getattr(getattr(self._tb.file_writer, "event_writer", None), "_worker", None)
        if worker is not None and not worker.is_alive():
            self._tb.flush()  # raises the write's error (ENOSPC, ...) where it can
            raise OSError(errno.EIO, "TensorBoard's event writer stopped", str(self._dir))

    def scalars(self, record: dict, metrics: dict) -> None:
        for name, value in metrics.items():
            self._check()
            self._tb.add_scalar(f"{record['split']}/{name}", float(value), record["step"])

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        if rows:
            self._check()
            self._tb.add_text(f"{split}/completions", markdown_table(rows[:TEXT_ROWS]), int(step))

    def close(self) -> None:
        self._tb.close()


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (what TensorBoard's text plugin renders)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    cell = lambda v: (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("|", "\\|") \
        .replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class WandbWriter:
    """A W&B run in ``run_dir/wandb``; a resumed training run continues the same W&B run."""

    def __init__(self, run_dir: Path, config: dict | None, resuming: bool):
        try:
            import wandb
        except ImportError:
            raise errors.ConfigError(
                "--report-to wandb needs the wandb package: pip install wandb") \
                from None
        self._wandb = wandb
        id_file = run_dir / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "nnx_posttrain"),
                               name=run_dir.name, dir=str(run_dir), config=config or {},
                               id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self._run.id)

    def scalars(self, record: dict, metrics: dict) -> None:
        self._run.log({f"{record['split']}/{k}": float(v) for k, v in metrics.items()},
                      step=record["step"])

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            table = self._wandb.Table(columns=["step", *columns],
                                      data=[[step, *(row.get(c) for c in columns)] for row in rows])
            self._run.log({f"{split}/completions": table}, step=step)

    def close(self) -> None:
        self._run.finish()


def writers(report_to: str, run_dir: Path, keep_until: int | None, config: dict | None,
            say=print) -> list:
    names = [x.strip() for x in report_to.split(",") if x.strip() and x.strip() != "none"]
    out = []
    for name in dict.fromkeys(names):
        if name == "jsonl":
            out.append(JsonlWriter(run_dir, keep_until, say))
        elif name == "tensorboard":
            out.append(TensorBoardWriter(run_dir))
        elif name == "wandb":
            out.append(WandbWriter(run_dir, config, resuming=keep_until != -1))
        else:
            raise errors.ConfigError(
                f"--report-to: unknown destination {name!r} "
                "(tensorboard, jsonl, wandb or none)")
    return out


class MetricsLog:
    def __init__(self, run_dir: Path, keep_until: int | None = None, echo=print,
                 report_to: str = "tensorboard,jsonl", config: dict | None = None):
        """Writers for ``report_to`` (``--report-to``), appending. ``keep_until``: a training run
        starting from that step (-1 from scratch) first removes the records of later steps,
        except ``--eval-only`` ones; None (``--eval-only``): nothing is removed. ``config``: the
        run's (for W&B)."""
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self._echo = echo
        self._writers = writers(report_to, run_dir, keep_until, config, self._say)

    def _say(self, text: str) -> None:
        if self._echo is not None:
            self._echo(text)

    def log(self, step: int, split: str, metrics: dict, echo: bool = True,
            fields: dict | None = None) -> dict:
        """Append one record; ``fields``: non-metric entries of the JSON record only."""
        record = {"step": int(step), "split": split, **{k: _clean(v) for k, v in metrics.items()}}
        record.update(fields or {})
        for writer in self._writers:
            writer.scalars(record, metrics)
        if echo and self._echo is not None:
            shown = "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            self._echo(f"[{split} step {step}] {shown}")
        return record

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        """Logged completions (TRL's ``log_completions``): one dict per completion (prompt,
        completion, reference / reward columns)."""
        if rows:
            for writer in self._writers:
                writer.completions(step, split, rows)

    def close(self):
        for writer in self._writers:
            writer.close()


def _fmt(v) -> str:
    v = float(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"


def _read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log (a partial last line, of a process killed mid-write, left out)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for n, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if n < len(lines) - 1:
                raise
    return out


def read(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return _read_jsonl(Path(run_dir) / "metrics.jsonl")


def read_completions(run_dir: str | Path) -> list[dict]:
    """The rows of a run's completions.jsonl ([] when it has none)."""
    path = Path(run_dir) / "completions.jsonl"
    return _read_jsonl(path) if path.exists() else []


class SecondaryLog:
    """Metrics of processes other than 0 of a multi-process run: returned, never written."""

    def log(self, step, split, metrics, echo=True, fields=None):
        return {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()},
                **(fields or {})}

    def completions(self, step, split, rows):
        pass

    def close(self):
        pass
