"""Where each step of a training command's loop spends its wall time, piece by piece.

Runs ``python -m experiments.ALGORITHM ARGS`` in this process with timers around the loop's
pieces — the batch (``source.next``), the step's dispatch, the held checkpoint's hand-over to
Orbax (``write_held``), the save hook, the log hook (which waits for the step's metrics), the
rest of the hooks — and writes one record per step: its wall seconds, each piece's seconds, and
the CPU seconds of the main thread and of the whole process over the step (the other threads':
Orbax's, Grain's)::

    python -m tools.bench.loop_timeline --out timeline.json -- simpo --model P --data D ...

The package is not changed: the timers wrap its methods in this process only (a measuring tool).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path


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


def instrument(steps_out: list[dict], freeze_after: int | None = None,
               early_host_copy: bool = False) -> None:
    """Wrap the loop's pieces; each finished step appends its record to ``steps_out``.
    ``freeze_after``: ``gc.freeze()`` after that step (the objects alive then are never
    scanned again by the garbage collector: a test of how much its passes cost the loop).
    ``early_host_copy``: the held checkpoint copy's transfer to the host is started when the
    copy is made (``copy_to_host_async``), before Orbax asks for it."""
    import gc

    from nnx_posttrain import checkpoint
    from nnx_posttrain.train import hooks, loop

    current: dict = {}
    collecting: dict = {}

    def on_gc(phase, info):
        if phase == "start":
            collecting["t"] = time.perf_counter()
        elif "t" in collecting:
            name = f"gc{info['generation']}"
            current[name] = current.get(name, 0.0) + time.perf_counter() - collecting.pop("t")
    gc.callbacks.append(on_gc)
    probe = StallProbe()
    if early_host_copy:
        device_copy = checkpoint.device_copy

        def copy_and_start(state):
            import jax

            copy = device_copy(state)
            for leaf in jax.tree.leaves(copy) if copy is not None else []:
                leaf.copy_to_host_async()
            return copy
        checkpoint.device_copy = copy_and_start

    def method(cls, name, label):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return _timed(current, label, functools.partial(original, self))(*args, **kwargs)
        setattr(cls, name, wrapper)

    method(checkpoint.Checkpointer, "write_held", "write_held")
    method(checkpoint.Checkpointer, "save", "checkpointer_save")
    method(loop.Steps, "log_train", "log_hook")
    method(loop.Steps, "save", "save_hook")
    method(hooks.NonFiniteGuard, "push", "guard")
    method(hooks.Hooks, "after", "hooks")
    loop.shard_batch = _timed(current, "to_device", loop.shard_batch)
    compile_step = loop.compile_step

    def timed_compile_step(run):
        step = compile_step(run)
        run.source.next = _timed(current, "batch", run.source.next)
        return _timed(current, "dispatch", step)
    loop.compile_step = timed_compile_step
    one_step = loop.Steps.one_step

    def timed_one_step(self, step, train_step, hooks):
        current.clear()
        wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        current["t0"] = wall
        one_step(self, step, train_step, hooks)
        current["stalls"] = probe.between(wall, time.perf_counter())
        del current["t0"]
        if step == freeze_after:
            gc.freeze()
        steps_out.append({"step": step, "wall_s": time.perf_counter() - wall,
                          "cpu_s": time.process_time() - cpu,
                          "main_thread_cpu_s": time.thread_time() - main, **current})
    loop.Steps.one_step = timed_one_step


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the per-step records (JSON)")
    parser.add_argument("--gc-freeze-after", type=int, default=None,
                        help="gc.freeze() after this step (the loop's objects left unscanned)")
    parser.add_argument("--early-host-copy", action="store_true",
                        help="start the held checkpoint copy's transfer to the host at once")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- ALGORITHM and the training command's options")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from nnx_posttrain.cli import main as cli_main

    records: list[dict] = []
    instrument(records, args.gc_freeze_after, args.early_host_copy)
    try:
        code = cli_main(command, own_process=True,
                        command_prog=f"python -m experiments.{command[0]}")
    finally:
        Path(args.out).write_text(json.dumps(records, indent=1))
    if code:
        raise SystemExit(code)
    return records


if __name__ == "__main__":
    main()
