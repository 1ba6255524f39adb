"""Helpers the test modules share: command lines of the micro model and metric readers."""

import subprocess
import sys
from pathlib import Path

from nnx_posttrain import metrics_log

ROOT = Path(__file__).resolve().parents[1]

# the micro model on short sequences: what most end-to-end tests train
MICRO = ["--model", "gemma_micro", "--batching.max-length", "24"]


def experiment_command(algorithm: str, run_dir, *extra) -> list[str]:
    """``python -m experiments.<algorithm>`` on the micro model, writing ``run_dir``."""
    return [sys.executable, "-m", f"experiments.{algorithm}", *MICRO, "--run-dir", str(run_dir),
            *extra]


def run_command(cmd: list[str], check: bool = True, timeout: int = 600):
    """Run a command from the repository root; with ``check``, fail with its output's tail."""
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def records(run_dir, split: str = "train") -> list[dict]:
    """The ``split`` rows of a run's metrics.jsonl."""
    return [r for r in metrics_log.read(run_dir) if r["split"] == split]


def losses(run_dir) -> dict[int, float]:
    """{step: training loss} of a run."""
    return {r["step"]: r["loss"] for r in records(run_dir)}
