"""Host memory on CPU: glibc's allocator set for XLA:CPU's step buffers, and the compiler's
memory handed back after each compile. Both in-process, through ``ctypes``; elsewhere than
Linux with glibc (macOS, musl) they do nothing.

XLA:CPU takes a step's buffers from ``malloc`` and frees them when the step ends. With glibc's
defaults a freed large block goes back to the kernel (a block of 32 MB or more, the largest a
heap arena holds, is a fresh ``mmap``; the heap's free top is trimmed past 128 KB), so the next
step's buffers are page-faulted in and zeroed again, 4 KB at a time (~13,400 faults, 52 MB, per
step of the built-in tiny SFT). ``set_allocator("heap")`` serves every block from the heap
(``mallopt(M_MMAP_MAX, 0)``) and keeps up to 1 GiB of its freed top (``M_TRIM_THRESHOLD``): the
tiny step then takes no fault. ``--host-allocator auto`` does that for models whose steps have no
block of 32 MB (the built-in tiny ones); for larger models the heap's fragmentation can cost more
than the faults, and glibc's huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, which only an
environment setting can give, docs: Scaling) are the setting to try. A ``GLIBC_TUNABLES`` set by
the user is left alone.

XLA's compiler works in memory it takes with ``malloc`` and frees when the program is built:
``release_after_compiles`` calls glibc's ``malloc_trim(0)`` after every backend compile of at
least ``MIN_COMPILE_S`` (the training and evaluation steps, the sampler; not the many small
programs of eager operations), so the process does not stay at the compiler's high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

MIN_COMPILE_S = 0.2
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's (a test checks)
MIN_BLOCK = 32 * 2**20  # glibc's largest heap block: from here on, every block is a fresh mmap
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
HEAP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 1 << 30}
_state = {"registered": False, "trims": 0, "setting": None}


def _libc():
    """glibc's C library, or None where this is not Linux with glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def has_large_blocks(vocab: int, width: int) -> bool:
    """Whether a model's steps have blocks of ``MIN_BLOCK`` or more: its float32 embedding (the
    size of its gradient, and of ~1,000 positions' logits) reaches it."""
    return vocab * width * 4 >= MIN_BLOCK


def choose(option: str, vocab: int, width: int) -> str:
    """``--host-allocator`` ('auto', 'heap', 'default') -> the setting a run applies."""
    if option != "auto":
        return option
    return "default" if has_large_blocks(vocab, width) else "heap"


def set_allocator(setting: str) -> str:
    """Apply ``setting`` ('heap' or 'default': nothing) to this process's allocator; returns the
    line the run's log prints. The heap setting stays for the rest of the process."""
    if setting != "heap":
        return "host allocator: glibc defaults"
    if "GLIBC_TUNABLES" in os.environ:
        return f"host allocator: GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']} (the user's)"
    libc = _libc()
    if libc is None:
        return "host allocator: the system's (not Linux with glibc)"
    for option, value in HEAP.items():
        if not libc.mallopt(option, value):
            return f"host allocator: glibc defaults (mallopt({option}, {value}) was refused)"
    _state["setting"] = setting
    return "host allocator: every block from the heap, kept between steps"


def release_after_compiles() -> bool:
    """Registers the malloc_trim listener once per process; False where there is no glibc."""
    if _state["registered"]:
        return True
    libc = _libc()
    if libc is None:
        return False
    import jax

    def listener(name: str, seconds: float, **_) -> None:
        if name == COMPILE_EVENT and seconds >= MIN_COMPILE_S:
            libc.malloc_trim(0)
            _state["trims"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    _state["registered"] = True
    return True


def trims() -> int:
    """How many times the listener has trimmed (for tests)."""
    return _state["trims"]
