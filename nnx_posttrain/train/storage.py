"""Faults of the storage under a run directory (a full disk, a quota, a read-only or removed
file system): one ``StorageError`` naming the run directory, what could not be written and what
is safe, instead of the tracebacks of the writers (Orbax's background threads, TensorBoard's
event file, the metrics log) that hit it.

    with storage.reported(run_dir):  # the first storage fault in an exception's chain
        ...                          # becomes its StorageError

``quiet_logs(run_dir)`` drops the error records Orbax logs (with their tracebacks) for a fault the run
reports itself; every other record passes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import threading
import traceback
from pathlib import Path

from nnx_posttrain import errors
from nnx_posttrain.model import device_memory

# OSErrors that say the storage is at fault, not the program
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ENOENT, errno.EACCES,
                  errno.EPERM, errno.ESTALE, errno.EFBIG, errno.ENOTDIR}
# the same faults as TensorStore reports them (a ValueError whose text carries the OS's), and
# the errno each stands for
STORAGE_TEXTS = {"No space left on device": errno.ENOSPC, "RESOURCE_EXHAUSTED": errno.ENOSPC,
                 "Disk quota exceeded": errno.EDQUOT, "Read-only file system": errno.EROFS,
                 "Input/output error": errno.EIO}


def _chain(exc: BaseException):
    """``exc`` and the exceptions it was raised from or while handling, earliest first."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return reversed(seen)


class FolderRemoved(OSError):
    """A checkpoint failed because its folder was removed while it was written."""


def fault_of(exc: BaseException, run_dir: Path | None = None) -> BaseException | None:
    """The earliest exception in ``exc``'s chain that is a storage fault, or None. With
    ``run_dir``, an error of a checkpoint's writer after ``run_dir/checkpoints`` was removed
    is one too (Orbax then fails on the files it had written)."""
    folder = Path(run_dir) / "checkpoints" if run_dir is not None else None
    if folder is not None and not folder.is_dir() and _what(exc).startswith("a checkpoint"):
        removed = FolderRemoved(errno.ENOENT, "the folder was removed while a checkpoint was "
                                "written", str(folder))
        removed.__traceback__ = exc.__traceback__
        return removed
    for e in _chain(exc):
        if device_memory.out_of_memory(e):  # the device's memory, not the disk's
            continue
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        if isinstance(e, (OSError, ValueError, RuntimeError)) and any(t in str(e)
                                                                      for t in STORAGE_TEXTS):
            return e
    return None


def _what(exc: BaseException, fault: BaseException | None = None) -> str:
    """Which writer hit the fault, from the files of the tracebacks in ``exc``'s chain; the
    file the ``fault`` names, if it does."""
    files = " ".join(f.filename for e in _chain(exc) for f in traceback.extract_tb(e.__traceback__))
    name = getattr(fault, "filename", None)
    where = f" ({name})" if name else ""
    if "orbax" in files or "tensorstore" in files or "etils" in files:
        return f"a checkpoint{where}"
    if "tensorboardX" in files:
        return f"the TensorBoard log{where}"
    if "metrics_log" in files:
        return f"the metrics log{where}"
    return f"a file of the run{where}"


def _reason(fault: BaseException) -> str:
    if isinstance(fault, OSError) and fault.strerror:
        return fault.strerror
    text = str(fault)
    return next((t for t in STORAGE_TEXTS if t in text), text.splitlines()[0][:200])


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the finished checkpoints in ``run_dir/checkpoints`` (a checkpoint being
    written is a ``*.orbax-checkpoint-tmp*`` folder, not counted)."""
    folder = Path(run_dir) / "checkpoints"
    try:
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()
                      and (p / "state").is_dir())
    except OSError:
        return []


def logged_steps(run_dir: Path) -> str:
    """'metrics.jsonl holds steps A-B' (its whole lines), or what is wrong with it."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"{path.name} cannot be read"
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the fault: a resume drops it
        if record.get("split") == "train":
            steps.append(int(record["step"]))
    return (f"{path.name} holds the training records of steps {min(steps)}-{max(steps)}"
            if steps else f"{path.name} holds no training record")


def error(run_dir: Path, exc: BaseException) -> errors.StorageError:
    """The message of the storage fault in ``exc``'s chain (``fault_of``): the run directory,
    what could not be written, what is safe (the last finished checkpoint, the steps the
    metrics hold) and how to go on."""
    fault = fault_of(exc, run_dir)
    kept = checkpoint_steps(run_dir)
    safe = (f"checkpoint {kept[-1]} ({Path(run_dir) / 'checkpoints' / str(kept[-1])}) is whole"
            if kept else f"no checkpoint is left in {Path(run_dir) / 'checkpoints'}")
    again = ("run the same command again to resume from it (or copy the run directory "
             "elsewhere and resume there)" if kept else "run the same command again")
    code = getattr(fault, "errno", None) or next(
        (c for text, c in STORAGE_TEXTS.items() if text in str(fault)), None)
    fix = {errno.ENOSPC: "Free space", errno.EDQUOT: "Free space or raise the quota",
           errno.EROFS: "Make the file system writable again",
           errno.ENOENT: "Leave the run directory's folders in place"}.get(code, "Fix the storage")
    return errors.StorageError(
        f"{run_dir}: the storage under the run failed while writing {_what(exc, fault)}: "
        f"{_reason(fault)}. Training stopped. Safe: {safe}; {logged_steps(run_dir)}. {fix}, "
        f"then {again}.")


@contextlib.contextmanager
def reported(run_dir: Path):
    """Within the block, an exception whose chain holds a storage fault becomes its
    ``StorageError`` (the chain's other exceptions are the fault's consequences)."""
    try:
        yield
    except errors.StorageError:
        raise
    except Exception as exc:
        if fault_of(exc, run_dir) is None:
            raise
        raise error(run_dir, exc) from None


class _StorageNoise(logging.Filter):
    def __init__(self, run_dir: Path):
        super().__init__()
        self.run_dir = run_dir

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and fault_of(exc, self.run_dir) is not None:
            return False
        text = record.getMessage()
        if "does not exist" in text and str(self.run_dir) in text:  # files of a removed folder
            return False
        return not any(t in text for t in STORAGE_TEXTS)


@contextlib.contextmanager
def quiet_logs(run_dir: Path):
    """While the block runs, the ``absl`` logger (Orbax's) drops its records of storage faults
    and a writer thread ended by one (TensorBoard's) prints no traceback: ``reported`` turns the
    fault into one message. Other records and thread errors pass; both hooks are put back."""
    noise, log, previous = _StorageNoise(run_dir), logging.getLogger("absl"), threading.excepthook

    def hook(args):
        if args.exc_value is None or fault_of(args.exc_value, run_dir) is None:
            previous(args)

    log.addFilter(noise)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
        log.removeFilter(noise)
