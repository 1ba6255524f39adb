"""Where each step of a training command's loop spends its wall time, piece by piece.

Runs ``python -m experiments.ALGORITHM ARGS`` in this process with timers around the loop's
pieces — the batch (``source.next``), the step's dispatch, the held checkpoint's hand-over to
Orbax (``write_held``), the save hook, the log hook (which waits for the step's metrics), the
rest of the hooks — and writes one record per step: its wall seconds, each piece's seconds and
its start within the step (``at``), the garbage collector's passes (``gc0`` .. ``gc2``), the
stretches over 4 ms in which a probe thread could not run (``stalls``: the interpreter held
elsewhere), and the CPU seconds of the main thread and of the whole process over the step (the
other threads': Orbax's, Grain's)::

    python -m tools.bench.loop_timeline --out timeline.json -- simpo --model P --data D ...

The package is not changed: the timers wrap its methods in this process only (a measuring tool).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from pathlib import Path

from tools import exit_status


def _timed(record: dict, name: str, fn):
    """``fn`` adding its seconds to ``record[name]`` and its (name, start, seconds) to
    ``record["at"]`` (start: seconds since the step began, ``record["t0"]``)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            record[name] = record.get(name, 0.0) + took
            record.setdefault("at", []).append((name, round(start - record.get("t0", start), 4),
                                                round(took, 4)))
    return wrapper


class StallProbe:
    """A thread that wakes every millisecond and notes when it could not for longer than
    ``min_ms`` (the interpreter held by another thread, or the process descheduled): the
    main thread waits as long for its next Python statement."""

    def __init__(self, min_ms: float = 4.0):
        import threading

        self.min_s, self.stalls, self.running = min_ms / 1000, [], True
        self.thread = threading.Thread(target=self._run, daemon=True, name="stall-probe")
        self.thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while self.running:
            time.sleep(0.001)
            now = time.perf_counter()
            if now - last > self.min_s + 0.001:
                self.stalls.append((last, now - last - 0.001))
            last = now

    def between(self, start: float, end: float) -> list:
        """(start since ``start``, seconds) of the stalls that began in [start, end)."""
        return [(round(a - start, 4), round(d, 4)) for a, d in self.stalls if start <= a < end]


@contextlib.contextmanager
def timed_loop(steps_out: list[dict]):
    """Within it, the training loop's pieces are timed: each finished step appends its record
    to ``steps_out``; every wrapped function is restored on exit."""
    import gc

    from nnx_posttrain import checkpoint
    from nnx_posttrain.train import hooks, loop

    current: dict = {}
    collecting: dict = {}
    restore: list[tuple] = []

    def on_gc(phase, info):
        if phase == "start":
            collecting["t"] = time.perf_counter()
        elif "t" in collecting:
            name = f"gc{info['generation']}"
            current[name] = current.get(name, 0.0) + time.perf_counter() - collecting.pop("t")

    def replace(owner, name, new):
        restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def method(cls, name, label):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return _timed(current, label, functools.partial(original, self))(*args, **kwargs)
        replace(cls, name, wrapper)

    method(checkpoint.Checkpointer, "write_held", "write_held")
    method(checkpoint.Checkpointer, "save", "checkpointer_save")
    method(loop.Steps, "log_train", "log_hook")
    method(loop.Steps, "save", "save_hook")
    method(hooks.NonFiniteGuard, "push", "guard")
    method(hooks.Hooks, "after", "hooks")
    replace(loop, "shard_batch", _timed(current, "to_device", loop.shard_batch))
    compile_step, one_step = loop.compile_step, loop.Steps.one_step

    def timed_compile_step(run):
        step = compile_step(run)
        run.source.next = _timed(current, "batch", run.source.next)
        return _timed(current, "dispatch", step)

    def timed_one_step(self, step, train_step, hooks):
        current.clear()
        wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        current["t0"] = wall
        one_step(self, step, train_step, hooks)
        current["stalls"] = probe.between(wall, time.perf_counter())
        del current["t0"]
        steps_out.append({"step": step, "wall_s": time.perf_counter() - wall,
                          "cpu_s": time.process_time() - cpu,
                          "main_thread_cpu_s": time.thread_time() - main, **current})
    replace(loop, "compile_step", timed_compile_step)
    replace(loop.Steps, "one_step", timed_one_step)
    gc.callbacks.append(on_gc)
    probe = StallProbe()
    try:
        yield steps_out
    finally:
        probe.running = False
        gc.callbacks.remove(on_gc)
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


def main(argv=None) -> int:
    """Runs the command with the timers, writes ``--out``; the command's exit status."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the per-step records (JSON)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- ALGORITHM and the training command's options")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from nnx_posttrain.cli import main as cli_main

    records: list[dict] = []
    try:
        with timed_loop(records):
            code = cli_main(command, own_process=True,
                            command_prog=f"python -m experiments.{command[0]}")
    finally:
        Path(args.out).write_text(json.dumps(records, indent=1))
    return code


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
