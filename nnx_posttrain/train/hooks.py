"""What runs between optimizer steps: metric logging, evaluation, checkpoints, the stop signal,
and the guard against non-finite steps.

A hook is ``fn(info)`` with a condition; ``Hooks.after(info)`` runs the ones due after a step, in
the order they were added (logging, the non-finite check, evaluation, checkpoint, stop),
Levanter's ``add_hook`` style.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import signal
import sys
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
    """Training tokens per second since the last log, the first (compiling) step left out; and
    TRL's ``num_tokens``, the tokens of every step so far (a resumed run goes on from its
    checkpoint's count, ``seen``; None: not known, the metric is left out)."""

    def __init__(self, seen: int | None = 0):
        self.t_last, self.tokens, self.compile_seconds = time.perf_counter(), 0, None
        self.seen = seen

    def count(self, batch: dict) -> None:
        n = sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask"))
        self.tokens += n
        if self.seen is not None:
            self.seen += n

    def first_step_done(self, state) -> None:
        jax.block_until_ready(state)
        self.compile_seconds = time.perf_counter() - self.t_last
        self.t_last, self.tokens = time.perf_counter(), 0

    def read(self) -> dict:
        """``tokens_per_second`` (none when only the compiling step ran since the last log: it
        is not measured, rather than 0), ``num_tokens``, ``compile_seconds`` once."""
        now = time.perf_counter()
        out = {"tokens_per_second": self.tokens / (now - self.t_last)} if self.tokens else {}
        if self.seen is not None:
            out["num_tokens"] = float(self.seen)
        if self.compile_seconds is not None:
            out["compile_seconds"], self.compile_seconds = self.compile_seconds, None
        self.t_last, self.tokens = time.perf_counter(), 0
        return out

    def pause_done(self) -> None:
        """Time spent outside training (evaluation) is not training throughput."""
        self.t_last = time.perf_counter()


class FrozenCollector:
    """Python's garbage collector told to leave alone the objects alive after the first step
    (the model, the compiled step, the data pipeline: ``gc.freeze``), so that its full passes
    scan only what the loop makes since; unfrozen on exit. On the v5e chip's host, a full pass
    over a gemma_2b run's objects stopped the loop for ~0.3 s every ~10 steps
    (``tools.bench.loop_timeline``). Nothing changes where the caller had frozen objects
    itself."""

    def __enter__(self) -> "FrozenCollector":
        self.froze = False
        return self

    def freeze(self) -> None:
        if not self.froze and gc.get_freeze_count() == 0:
            gc.freeze()
            self.froze = True

    def __exit__(self, *exc) -> None:
        if self.froze:
            gc.unfreeze()


class PromptSwitches:
    """The interpreter handed back to the loop's thread within ``seconds`` (0.1 ms) instead of
    Python's 5 ms while the loop runs (``sys.setswitchinterval``; restored on exit, never raised
    above what the caller set). Each JAX array the loop frees (the donated state of the step
    before: 433 arrays for a LoRA run) gives the interpreter up once; while Orbax's commit threads
    run Python beside the loop after a checkpoint, taking it back cost up to the 5 ms interval
    each time: on the v5e chip's host the two steps after a save ran 0.05-0.1 s late, and on a
    2-core CPU freeing 433 donated arrays beside two busy Python threads took 0.3-1.1 s against
    3-6 ms at 0.1 ms (``tools.bench.loop_timeline``)."""

    def __init__(self, seconds: float = 1e-4):
        self.seconds = seconds

    def __enter__(self) -> "PromptSwitches":
        self.before = sys.getswitchinterval()
        sys.setswitchinterval(min(self.before, self.seconds))
        return self

    def __exit__(self, *exc) -> None:
        sys.setswitchinterval(self.before)


class NonFiniteStep(Exception):
    """A step's loss or gradient norm was NaN or infinite and the run must stop (the message
    names the step and the values)."""


class NonFiniteGuard:
    """Watches each step's ``nonfinite`` flag (the jitted step has already refused to apply such
    a step: weights and AdamW moments stay as they were).

    ``--optim.on-nonfinite stop`` raises ``NonFiniteStep``; ``skip`` counts the step and goes on,
    until ``patience`` non-finite steps in a row. The flag of step s is read when step s + 1 has
    been dispatched (``push``), so the host never waits for the device between two steps; a
    checkpoint, the last step and a stop first read the current step's flag (``flush``), so no
    checkpoint ever follows an unchecked step."""

    def __init__(self, mode: str, echo, patience: int = 10):
        self.mode, self.echo, self.patience = mode, echo, patience
        self.pending, self.skipped, self.in_a_row = None, 0, 0

    def push(self, step: int, metrics: dict) -> None:
        previous, self.pending = self.pending, (step, metrics)
        if previous is not None:
            self._check(*previous)

    def flush(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._check(*pending)

    def _check(self, step: int, metrics: dict) -> None:
        if not int(metrics["nonfinite"]):
            self.in_a_row = 0
            return
        loss, grad_norm = (float(jax.device_get(metrics[k])) for k in ("loss", "grad_norm"))
        bad = " and ".join(name for name, v in (("loss", loss), ("gradient norm", grad_norm))
                           if not math.isfinite(v))
        what = f"{bad or 'loss'} (loss {loss:.6g}, gradient norm {grad_norm:.6g})"
        self.skipped += 1
        self.in_a_row += 1
        if self.mode == "stop":
            raise NonFiniteStep(f"step {step}: non-finite {what}")
        if self.in_a_row >= self.patience:
            raise NonFiniteStep(f"{self.in_a_row} non-finite steps in a row, the last at step "
                                f"{step} ({what})")
        if self.skipped <= 5:
            self.echo(f"step {step}: non-finite {what}; the step was skipped "
                      "(--optim.on-nonfinite skip)")


def _quiet_interrupts(recorded: Callable[[], bool]):
    """Install a ``sys.unraisablehook`` that drops Python's "Exception ignored" page for a
    ``KeyboardInterrupt`` once ``recorded()`` (the signal handler noted it, and it is raised again
    where it can be), passing everything else to the hook it replaces; returns that hook."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not (recorded() and issubclass(unraisable.exc_type, KeyboardInterrupt)):
            previous(unraisable)

    sys.unraisablehook = hook
    return previous


class Interruptible:
    """Ctrl-C before and after the training loop (loading, compiling, evaluating; the loop has
    ``StopSignals``): stop at once. Python drops a ``KeyboardInterrupt`` raised inside a
    garbage-collector callback ("Exception ignored in ..."; JAX's runs while a model loads), which
    once let a run interrupted while loading go on to train to its end: the interrupt is recorded
    too (``interrupted``), and ``check`` raises it again."""

    def __init__(self):
        self.interrupted = False
        self._old = None

    def __enter__(self):
        self._old_unraisable = _quiet_interrupts(lambda: self.interrupted)
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.interrupted = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        sys.unraisablehook = self._old_unraisable


class StopSignals:
    """SIGTERM (TPU VM preemption) and SIGINT: finish the current step, checkpoint, exit.

    A second SIGINT aborts at once (``KeyboardInterrupt``), except while a checkpoint is being
    written (inside ``saving()``): there a Ctrl-C says so and the save completes (a first one also
    asks the run to stop after it); only the next one aborts. Orbax writes a checkpoint to a
    temporary directory and renames it when complete, so even an abort leaves the previous
    checkpoints intact.

    Python raises the handler's ``KeyboardInterrupt`` wherever the main thread is at that moment;
    where that is a garbage-collector callback or a finaliser, Python only prints it ("Exception
    ignored in ...") and goes on. So an abort is also recorded (``aborted``), that print dropped
    while these signals are handled, and ``check`` (after every step, after every save) raises it
    again."""

    def __init__(self, echo=print):
        self.received = None
        self.echo = echo
        self.aborted = False
        self._saving, self._warned = False, False

    def __enter__(self):
        self._old = {}
        logging.getLogger("absl").addFilter(_drop_interrupt_tracebacks)
        self._old_unraisable = _quiet_interrupts(lambda: self.aborted)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self._saving and not self._warned:
            self._warned = True  # the next one aborts
            self.received = self.received or signum
            if self.echo is not None:
                self.echo("SIGINT: a checkpoint is being written; waiting for it to finish "
                          "(Ctrl-C again aborts; the previous checkpoints stay intact)")
            return
        if signum == signal.SIGINT and (self.received == signal.SIGINT or self._saving):
            self.aborted = True
            raise KeyboardInterrupt
        self.received = signum

    def check(self) -> None:
        """Raise the abort again if it landed where Python could not raise it."""
        if self.aborted:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def saving(self):
        """A Ctrl-C inside this block waits for the checkpoint instead of aborting."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
        self.check()

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        sys.unraisablehook = self._old_unraisable
        logging.getLogger("absl").removeFilter(_drop_interrupt_tracebacks)


def _drop_interrupt_tracebacks(record: logging.LogRecord) -> bool:
    """Orbax logs (absl) the traceback of an exception raised while it waits for a save and
    re-raises it; for the Ctrl-C that aborts a save, the run's own message says it all."""
    return not (record.exc_info and record.exc_info[0] is KeyboardInterrupt)
