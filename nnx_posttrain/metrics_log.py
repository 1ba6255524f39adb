"""Where metrics go: ``metrics.jsonl`` (one JSON object per logged step), tensorboardX events under
``tb/``, and the console."""

from __future__ import annotations

import json
import math
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
        """A fresh log, or with ``keep_until`` (resuming) the old one cut after that step, so
        steps redone after a crash are not logged twice."""
        self.path = run_dir / "metrics.jsonl"
        kept = []
        if keep_until is not None and self.path.exists():
            kept = [r for r in read(run_dir) if r["step"] <= keep_until]
        with self.path.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self._file = self.path.open("a")
        self._tb = _summary_writer()(str(run_dir / "tb"))
        self._echo = echo

    def log(self, step: int, split: str, metrics: dict, echo: bool = True) -> dict:
        record = {"step": int(step), "split": split, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for name, value in metrics.items():
            self._tb.add_scalar(f"{split}/{name}", float(value), int(step))
        if echo and self._echo is not None:
            shown = "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            self._echo(f"[{split} step {step}] {shown}")
        return record

    def close(self):
        self._file.close()
        self._tb.close()


def _fmt(v) -> str:
    v = float(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"


def read(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class SecondaryLog:
    """Metrics of processes other than 0 of a multi-process run: returned, never written."""

    def log(self, step, split, metrics, echo=True):
        return {"step": int(step), "split": split, **{k: float(v) for k, v in metrics.items()}}

    def close(self):
        pass
