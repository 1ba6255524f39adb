"""The run directory before and around a run: the checks made before anything is written, the
lock that keeps a second process out, and ``history.jsonl``, the append-only record of every
start and resume with the settings it changed.

    runs/<name>/run.lock        {"pid", "host", "started"} of the process using the directory
    runs/<name>/history.jsonl   {"event": "start" | "resume", "step", "time", "host", "pid",
                                 "argv", "changed": {setting: [before, after]}} per line

The lock is an ``fcntl.flock`` on ``run.lock``: the kernel releases it when its process dies in
any way (SIGKILL included), so a lock file left behind by a dead process is taken over, with a
message naming it. It is removed on exit.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import gc
import json
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

from nnx_posttrain import errors

LOCK = "run.lock"
HISTORY = "history.jsonl"


def prepare(run_dir: Path) -> Path:
    """``run_dir`` created (with its parents) or refused with a message: a file, not writable, a
    run's checkpoints folder."""
    if run_dir.exists() and not run_dir.is_dir():
        raise errors.RunDirError(f"--run-dir {run_dir} is a file, not a directory")
    if run_dir.name == "checkpoints" and (run_dir.parent / "config.json").is_file():
        raise errors.RunDirError(
            f"--run-dir {run_dir} is the checkpoints folder of the run "
            f"{run_dir.parent}: give the run itself (--run-dir {run_dir.parent})")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise errors.RunDirError(
            f"--run-dir {run_dir}: cannot create it ({exc.strerror})") from None
    return run_dir


def remove_if_unused(run_dir: Path) -> None:
    """Remove ``run_dir`` if it holds no file (only empty folders): what a run refused before
    writing anything (bad data, a bad setting) leaves, so that the refusal leaves nothing behind."""
    if run_dir.is_dir() and not any(p.is_file() or p.is_symlink() for p in run_dir.rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a process that left no details"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started "
            f"{holder.get('started')}")


# the run directories this process holds -> the thread holding each: a second run of the same
# process (another thread, a notebook's second call) is told so, not "another process"
_HELD: dict[str, str] = {}
_HELD_LOCK = threading.Lock()


class RunLock:
    """``with RunLock(run_dir, echo):`` — this process alone writes ``run_dir`` until the end
    of the block, and within it one run at a time (``enabled=False``: a no-op, for processes
    other than 0 of a multi-process run, which share process 0's directory)."""

    def __init__(self, run_dir: Path, echo=print, enabled: bool = True):
        self.path, self.echo, self.enabled, self.fd = Path(run_dir) / LOCK, echo, enabled, None
        self._key = None

    def __enter__(self):
        if self.enabled:
            self._hold_in_process()
            try:
                self.acquire()
            except BaseException:
                self._let_go_in_process()
                raise
        return self

    def __exit__(self, *exc):
        self.release()
        self._let_go_in_process()

    def _hold_in_process(self) -> None:
        key = str(self.path.parent.resolve())
        with _HELD_LOCK:
            holder = _HELD.get(key)
            if holder is not None:
                raise errors.RunDirError(
                    f"{self.path.parent} is in use by another run of this process (thread "
                    f"{holder!r}, pid {os.getpid()}): two runs cannot write one run directory; "
                    "wait for it to finish, or give this run another run_dir / --run-dir")
            _HELD[key] = threading.current_thread().name
        self._key = key

    def _let_go_in_process(self) -> None:
        if self._key is not None:
            with _HELD_LOCK:
                _HELD.pop(self._key, None)
            self._key = None

    def acquire(self) -> None:
        run_dir = self.path.parent
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise errors.RunDirError(
                    f"--run-dir {run_dir} is not writable ({exc.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise errors.RunDirError(
                    f"{run_dir} is in use by another process ({_describe(holder)}); wait "
                    "for it to finish or stop it, or choose another --run-dir") from None
            try:  # the previous holder may have removed the file after we opened it: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _holder(fd)
        if previous:
            self.echo(f"{run_dir}: taking over the lock left by a process that is no longer "
                      f"running ({_describe(previous)})")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise errors.RunDirError(
                f"--run-dir {run_dir} is not writable ({exc.strerror})") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still holding it: the next process finds no file
        os.close(self.fd)
        self.fd = None


RETRY_S = 0.05  # a signal that arrived where its exception would be swallowed is sent again


def _swallowing(frame) -> bool:
    """Whether an exception raised in ``frame`` would be swallowed: Python prints and ignores one
    that escapes a garbage-collector callback (JAX registers one, which a signal can interrupt)
    or a ``__del__``."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def sigterm_exits():
    """SIGTERM before training starts (while the model loads, say) raises ``errors.Stopped``
    (exit status 143 on the command line), so that ``finally`` blocks run: the lock is released,
    nothing is left half-written. (During training ``hooks.StopSignals`` takes over: checkpoint,
    then the run returns, stopped.) A signal that lands inside a garbage-collector callback or a
    ``__del__``, where Python would print and ignore the exception, is sent again ``RETRY_S``
    later instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if _swallowing(frame):  # the exception would be printed and ignored: again in a moment
            threading.Timer(RETRY_S, os.kill, (os.getpid(), signum)).start()
            return
        print(f"stopped by {signal.Signals(signum).name} while no training step was running: "
              "nothing new to checkpoint", file=sys.stderr)
        raise errors.Stopped(signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# what a run starting from step 0 writes anew (history.jsonl, append-only, keeps every start)
EARLIER = ("config.json", "metrics.jsonl", "completions.jsonl", "exact_match.jsonl", "tb")


def keep_earlier(run_dir: Path, config: dict, echo=print) -> Path | None:
    """Before a run starts from step 0 in ``run_dir`` (no checkpoint left to resume from): the
    files of the earlier run there that it would rewrite (``EARLIER``) moved into
    ``run_dir/earlier-<time>/``, and said, where that run logged a record or ran with settings
    other than ``config`` (what this run writes as config.json); returns that folder, or None
    where there was nothing to keep."""
    from nnx_posttrain.train import storage

    present = [name for name in EARLIER if (run_dir / name).exists()]
    try:
        before = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        before = None
    logged = (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size
    if not present or (not logged and before in (None, config)):
        return None
    what = storage.logged_steps(run_dir)
    folder = run_dir / f"earlier-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    folder.mkdir()
    for name in present:
        (run_dir / name).rename(folder / name)
    echo(f"{run_dir} has no checkpoint to resume from: this run starts from step 0. The earlier "
         f"run's {', '.join(present)} ({what}"
         + ("" if before in (None, config) else "; other settings")
         + f") are kept in {folder}")
    return folder


def append_history(run_dir: Path, event: str, step: int, changed: dict | None = None,
                   config: dict | None = None) -> None:
    """One line in ``history.jsonl``: a start or a resume, the settings it changed, and the
    ``config.json`` it wrote (a later edit of the file is then seen)."""
    entry = {"event": event, "step": int(step),
             "time": datetime.datetime.now().isoformat(timespec="seconds"),
             "host": socket.gethostname(), "pid": os.getpid(), "argv": sys.argv,
             "changed": changed or {}, "config": config}
    with (run_dir / HISTORY).open("a") as f:
        f.write(json.dumps(entry) + "\n")


def written_config(run_dir: Path) -> dict | None:
    """The ``config.json`` the run last wrote (``history.jsonl``); None when no start recorded
    it (a run of an older version)."""
    path = Path(run_dir) / HISTORY
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    for line in reversed(lines):
        try:
            config = json.loads(line).get("config")
        except (ValueError, AttributeError):
            continue  # a line cut by a kill
        if isinstance(config, dict):
            return config
    return None
