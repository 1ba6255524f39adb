"""glibc's allocator tuned for XLA:CPU's step buffers: a training command restarts itself once
with ``GLIBC_TUNABLES`` set.

XLA:CPU takes a step's buffers from ``malloc`` and frees them when the step ends. glibc hands a
large freed block back to the kernel (a block of 32 MB or more, the most a thread's arena holds,
is a fresh ``mmap``, unmapped when freed; the heap's free top is trimmed), so the next step's
buffers are page-faulted in and zeroed by the kernel again, 4 KB at a time: ~198,000 faults
(775 MB) per step of the medium benchmark, ~13,400 (52 MB) per tiny SFT step. Two settings, by
the size of the step's blocks (``tunables_for``):

- ``TUNABLES``, for models whose steps have blocks of 32 MB or more (``worth_it``: an embedding,
  and so the logits of ~1,000 positions, of at least 32 MB: every real model):
  ``glibc.malloc.hugetlb=1`` advises transparent huge pages on the memory glibc takes, so those
  blocks fault in 2 MB at a time (512x fewer faults); ``mmap_threshold=32 MiB`` and
  ``trim_threshold=1 GiB`` keep the smaller blocks in the heap between steps.
- ``HEAP``, for the others (the built-in tiny models): ``glibc.malloc.mmap_max=0`` serves every
  block from the heap and ``trim_threshold=1 GiB`` keeps its freed pages between steps: the tiny
  SFT step takes no fault at all (huge pages there made it erratic, 49-100 ms, from 2 MB pages
  zeroed again every step). At the medium size this setting was slower than huge pages.

The compiler's freed memory is still handed back after each compile (``train.host_memory``).

glibc reads its tunables only when a process starts, so ``restart_tuned`` starts the same command
again (``os.execve``: the same process id, standard streams and arguments); ``experiment.main``
calls it once the command line is parsed, before the model is loaded. Nothing is changed where it
would not apply or the user decided: not Linux with glibc, transparent huge pages off (``never``,
for ``TUNABLES``), ``GLIBC_TUNABLES`` already set (the user's own settings win), or
``NNX_POSTTRAIN_HOST_ALLOCATOR=default``.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
            "glibc.malloc.trim_threshold=1073741824")  # steps with blocks >= 32 MB: huge pages
HEAP = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"  # the others: the heap
SETTINGS = {TUNABLES: "huge pages for blocks >= 32 MB",
            HEAP: "every block from the heap, kept between steps"}
SWITCH = "NNX_POSTTRAIN_HOST_ALLOCATOR"  # "default": glibc's own settings, no restart
THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_BLOCK = 32 * 2**20  # glibc's largest heap block: from here on, every block is a fresh mmap


def worth_it(vocab: int, width: int) -> bool:
    """Whether a model's steps have blocks of ``MIN_BLOCK`` or more: its float32 embedding (the
    size of its gradient, and of ~1,000 positions' logits) reaches it."""
    return vocab * width * 4 >= MIN_BLOCK


def tunables_for(vocab: int, width: int) -> str:
    """The setting for a model's steps: ``TUNABLES`` (huge pages) where they have blocks of
    ``MIN_BLOCK`` or more, else ``HEAP``."""
    return TUNABLES if worth_it(vocab, width) else HEAP


def _thp_mode(path: str) -> str | None:
    """The kernel's transparent huge page mode (``always`` / ``madvise`` / ``never``), or None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def why_not(environ=None, thp_file: str = THP_FILE, tunables: str = TUNABLES) -> str | None:
    """Why ``tunables`` are not set for a process with ``environ``, or None when they apply."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH, "").lower() == "default":
        return f"{SWITCH}=default"
    if "GLIBC_TUNABLES" in environ:
        return "GLIBC_TUNABLES set by the user"
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "not Linux with glibc"
    if "hugetlb" not in tunables:
        return None
    mode = _thp_mode(thp_file)
    if mode not in ("always", "madvise"):
        return f"transparent huge pages {mode or 'unavailable'}"
    return None


def tuned_environment(environ=None, thp_file: str = THP_FILE,
                      tunables: str = TUNABLES) -> dict | None:
    """A copy of ``environ`` with ``GLIBC_TUNABLES = tunables``, or None where they do not apply."""
    environ = os.environ if environ is None else environ
    if why_not(environ, thp_file, tunables) is not None:
        return None
    return dict(environ, GLIBC_TUNABLES=tunables)


def started_as_command(package: str = "experiments") -> bool:
    """Whether this process was started as ``python [options] -m PACKAGE[.module] ...`` or as the
    ``nnx-posttrain`` console script (not: a test runner, a notebook, a script calling the
    library)."""
    argv = sys.orig_argv
    if len(argv) > 1 and os.path.basename(argv[1]) == "nnx-posttrain":
        return True
    if "-m" not in argv[1:-1]:
        return False
    module = argv[argv.index("-m", 1) + 1]
    return module == package or module.startswith(package + ".")


def restart_tuned(tunables: str = TUNABLES) -> None:
    """Start this process's command again with ``tunables`` (no return), where they apply and are
    not set yet; else nothing."""
    env = tuned_environment(tunables=tunables)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:  # the interpreter cannot be started again: go on with glibc's defaults
        print(f"host allocator: glibc defaults (restart failed: {e})", file=sys.stderr)


def describe(environ=None) -> str:
    """One line for the run's log: the allocator settings this process runs with."""
    environ = os.environ if environ is None else environ
    if environ.get("GLIBC_TUNABLES") in SETTINGS:
        return f"host allocator: glibc tuned for XLA:CPU ({SETTINGS[environ['GLIBC_TUNABLES']]})"
    if "GLIBC_TUNABLES" in environ:
        return f"host allocator: GLIBC_TUNABLES={environ['GLIBC_TUNABLES']} (the user's)"
    why = why_not(environ)
    return "host allocator: glibc defaults" + (f" ({why})" if why else "")
