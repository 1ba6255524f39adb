"""The memory free on the device a run computes on, for the checks that refuse what clearly
cannot fit (a training step, a generation's KV cache) before anything is allocated.

On CPU that is the host's ``MemAvailable``, or less where the process runs in a memory cgroup
(a container, a SLURM job, ``systemd-run -p MemoryMax``): the kernel's OOM killer acts on the
cgroup's limit, not on the host's free memory, so the tightest enclosing limit (cgroup v2
``memory.max`` or v1 ``memory.limit_in_bytes``) minus what the cgroup holds that the kernel cannot
reclaim (its usage less its inactive page cache) counts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax

GiB = 1 << 30
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def available_bytes() -> int | None:
    """Free memory of the first local device (an accelerator's own; on CPU the host's
    MemAvailable, bounded by the process's memory cgroup); None where it cannot be told."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    free = _meminfo_available()
    headroom = cgroup_headroom()
    if headroom is None:
        return free
    return headroom if free is None else min(free, headroom)


def in_use_bytes() -> int | None:
    """Memory this process holds on the first local device (an accelerator's bytes in use; on
    CPU the process's resident memory, from ``/proc/self/statm``); None where it cannot be told."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> tuple[int, str] | None:
    """The most memory this process has held, and where: the first local accelerator's
    high-water mark (``memory_stats()["peak_bytes_in_use"]``, "device"), or on CPU the process's
    peak resident memory (``VmHWM``, "host RSS"); None where neither can be told."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "host RSS"
    except OSError:
        pass
    return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_headroom(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> int | None:
    """What the tightest memory cgroup enclosing this process still lets it allocate (its limit
    less its unreclaimable usage), v2 or v1; None where no limit applies or none can be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2's unified hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                            "total_inactive_file")
        else:
            continue
        for directory in _enclosing(base, path):
            room = _headroom(directory, *files)
            if room is not None:
                best = room if best is None else min(best, room)
    return best


def _enclosing(base: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``base`` and its parents up to ``base`` (a
    container that mounts its own cgroup as the root sees only ``base``)."""
    directory = base / path.strip("/")
    if not directory.is_dir():
        return [base] if base.is_dir() else []
    out = [directory]
    while directory != base and base in directory.parents:
        directory = directory.parent
        out.append(directory)
    return out


def _headroom(directory: Path, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    try:
        limit = (directory / limit_file).read_text().strip()
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
        return None
    cache = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == reclaimable:
                cache = int(value)
    except (OSError, ValueError):
        pass
    return max(int(limit) - max(usage - cache, 0), 0)


_REFUSED = re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds? available HBM "
                      r"\(([\d.]+)([KMGT]?)\)")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is XLA's out-of-device-memory error (the TPU compiler's refusal of a
    program that does not fit, a buffer it could not allocate), which says RESOURCE_EXHAUSTED as
    TensorStore says of a full disk."""
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text and any(
        w in text.lower() for w in ("out of memory", "hbm", "allocat"))


def refused_figures(exc: BaseException) -> tuple[int, int] | None:
    """(memory required, memory available) in bytes from the TPU compiler's refusal of a
    program that does not fit (its figures, "17.79G": GiB), or None for another error. What it
    calls "HLO temporaries" is the program's whole need, its arguments included: a step of
    14.02 GiB of arguments and 4.94 GiB of temporaries (its buffer assignment) is refused as
    "HLO temporaries (18.96G)"."""
    match = _REFUSED.search(str(exc))
    if match is None:
        return None
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    a, ua, b, ub = match.groups()
    return int(float(a) * scale[ua]), int(float(b) * scale[ub])
