"""Where metrics go: a small set of writers behind ``MetricsLog`` (``--report-to``), and the console.

- ``jsonl``: ``metrics.jsonl`` (one JSON object per logged step: ``{"step", "split", metric: value,
  ...}``) and ``completions.jsonl`` (one JSON object per logged completion);
- ``tensorboard``: tensorboardX events under ``tb/`` (scalars ``<split>/<metric>``; completions as
  text ``<split>/completions``);
- ``wandb``: Weights & Biases (imported only when asked; ``WANDB_PROJECT``, ``WANDB_ENTITY``,
  ``WANDB_MODE=offline`` as usual; the run's config is the W&B config; completions as a table).

A writer has ``scalars(record)``, ``completions(step, split, rows)`` and ``close()``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

# Completions shown in a TensorBoard text summary (completions.jsonl has all of them).
TEXT_ROWS = 16


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


def _json_value(value):
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, (int, float)) or hasattr(value, "__float__"):
        return _clean(value)
    return str(value)


class JsonlWriter:
    """``metrics.jsonl`` and ``completions.jsonl``. With ``keep_until`` (resuming), each is cut
    after that step, so steps redone after a crash are not logged twice."""

    def __init__(self, run_dir: Path, keep_until: int | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.completions_path = run_dir / "completions.jsonl"
        self._file = _reopen(self.path, keep_until)
        self._keep_until = keep_until
        # opened at the first completion; an old run's file is cut (or emptied) now
        self._completions = (_reopen(self.completions_path, keep_until)
                             if self.completions_path.exists() else None)

    def scalars(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        if self._completions is None:
            self._completions = _reopen(self.completions_path, self._keep_until)
        self._completions.writelines(
            json.dumps({"step": int(step), "split": split,
                        **{k: _json_value(v) for k, v in row.items()}}) + "\n" for row in rows)
        self._completions.flush()

    def close(self) -> None:
        for f in (self._file, self._completions):
            if f is not None:
                f.close()


def _reopen(path: Path, keep_until: int | None):
    """``path`` opened for appending: emptied for a fresh run; for a resumed one, cut after step
    ``keep_until``."""
    kept = []
    if keep_until is not None and path.exists():
        kept = [r for r in _read_jsonl(path) if r["step"] <= keep_until]
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return path.open("a")


class TensorBoardWriter:
    def __init__(self, run_dir: Path):
        self._tb = _summary_writer()(str(run_dir / "tb"))

    def scalars(self, record: dict) -> None:
        step, split = record["step"], record["split"]
        for name, value in record.items():
            if name not in ("step", "split"):
                self._tb.add_scalar(f"{split}/{name}", float(value), step)

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        if rows:
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
            raise SystemExit("error: --report-to wandb needs the wandb package: pip install wandb") \
                from None
        self._wandb = wandb
        id_file = run_dir / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "nnx_posttrain"),
                               name=run_dir.name, dir=str(run_dir), config=config or {},
                               id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self._run.id)

    def scalars(self, record: dict) -> None:
        step, split = record["step"], record["split"]
        self._run.log({f"{split}/{k}": float(v) for k, v in record.items()
                       if k not in ("step", "split")}, step=step)

    def completions(self, step: int, split: str, rows: list[dict]) -> None:
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            table = self._wandb.Table(columns=["step", *columns],
                                      data=[[step, *(row.get(c) for c in columns)] for row in rows])
            self._run.log({f"{split}/completions": table}, step=step)

    def close(self) -> None:
        self._run.finish()


def writers(report_to: str, run_dir: Path, keep_until: int | None, config: dict | None) -> list:
    names = [x.strip() for x in report_to.split(",") if x.strip() and x.strip() != "none"]
    out = []
    for name in dict.fromkeys(names):
        if name == "jsonl":
            out.append(JsonlWriter(run_dir, keep_until))
        elif name == "tensorboard":
            out.append(TensorBoardWriter(run_dir))
        elif name == "wandb":
            out.append(WandbWriter(run_dir, config, resuming=keep_until is not None))
        else:
            raise SystemExit(f"error: --report-to: unknown destination {name!r} "
                             "(tensorboard, jsonl, wandb or none)")
    return out


class MetricsLog:
    def __init__(self, run_dir: Path, keep_until: int | None = None, echo=print,
                 report_to: str = "tensorboard,jsonl", config: dict | None = None):
        """Writers for ``report_to`` (``--report-to``): a fresh log, or with ``keep_until``
        (resuming) the old one cut after that step. ``config``: the run's (for W&B)."""
        self.path = run_dir / "metrics.jsonl"
        self._writers = writers(report_to, run_dir, keep_until, config)
        self._echo = echo

    def log(self, step: int, split: str, metrics: dict, echo: bool = True) -> dict:
        record = {"step": int(step), "split": split, **{k: _clean(v) for k, v in metrics.items()}}
        for writer in self._writers:
            writer.scalars(record)
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
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read(run_dir: str | Path) -> list[dict]:
    return _read_jsonl(Path(run_dir) / "metrics.jsonl")


def read_completions(run_dir: str | Path) -> list[dict]:
    """The rows of a run's completions.jsonl ([] when it has none)."""
    path = Path(run_dir) / "completions.jsonl"
    return _read_jsonl(path) if path.exists() else []


class SecondaryLog:
    """Metrics of processes other than 0 of a multi-process run: returned, never written."""

    def log(self, step, split, metrics, echo=True):
        return {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()}}

    def completions(self, step, split, rows):
        pass

    def close(self):
        pass
