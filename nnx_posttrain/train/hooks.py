"""What runs between optimizer steps: metric logging, evaluation, checkpoints, the stop signal.

A hook is ``fn(info)`` with a condition; ``Hooks.after(info)`` runs the ones due after a step, in
the order they were added (logging, evaluation, checkpoint, stop), Levanter's ``add_hook`` style.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from typing import Callable

import jax


@dataclasses.dataclass
class StepInfo:
    step: int
    state: dict
    metrics: dict  # the step's device metrics (fetched from the device only when logged)
    last: bool  # the run's final step
    stopping: bool  # a stop signal (SIGTERM, SIGINT) arrived
    boundary: bool  # a checkpoint may follow this step (BatchSource.checkpoint_ok)
    eval: dict | None = None  # set by the evaluation hook when it ran at this step


class Hooks:
    def __init__(self):
        self._hooks: list[tuple[Callable, Callable]] = []

    def add(self, fn: Callable[[StepInfo], None], every: int = 0,
            when: Callable[[StepInfo], bool] | None = None) -> None:
        """Run ``fn(info)`` after each step that ``every`` divides (0: never by count), or for
        which ``when(info)`` is true."""
        self._hooks.append((fn, lambda info: (every and info.step % every == 0)
                            or (when is not None and when(info))))

    def after(self, info: StepInfo) -> None:
        for fn, due in self._hooks:
            if due(info):
                fn(info)


class Throughput:
    """Training tokens per second since the last log, the first (compiling) step left out."""

    def __init__(self):
        self.t_last, self.tokens, self.compile_seconds = time.perf_counter(), 0, None

    def count(self, batch: dict) -> None:
        self.tokens += sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask"))

    def first_step_done(self, state) -> None:
        jax.block_until_ready(state)
        self.compile_seconds = time.perf_counter() - self.t_last
        self.t_last, self.tokens = time.perf_counter(), 0

    def read(self) -> dict:
        now = time.perf_counter()
        out = {"tokens_per_second": self.tokens / (now - self.t_last) if self.tokens else 0.0}
        if self.compile_seconds is not None:
            out["compile_seconds"], self.compile_seconds = self.compile_seconds, None
        self.t_last, self.tokens = time.perf_counter(), 0
        return out

    def pause_done(self) -> None:
        """Time spent outside training (evaluation) is not training throughput."""
        self.t_last = time.perf_counter()


class StopSignals:
    """SIGTERM (TPU VM preemption) and SIGINT: finish the current step, checkpoint, exit.
    A second SIGINT aborts at once."""

    def __init__(self):
        self.received = None

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
