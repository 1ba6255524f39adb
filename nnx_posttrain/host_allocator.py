"""glibc's allocator tuned for XLA:CPU's large step buffers: a training command restarts itself
once with ``GLIBC_TUNABLES`` set, when its model's steps have such buffers.

XLA:CPU takes a step's buffers from ``malloc`` and frees them when the step ends. glibc serves a
block of 32 MB or more (the most a thread's arena holds) with a fresh ``mmap`` and unmaps it when it
is freed, so every step's large buffers (the logits and their gradient, the embedding's gradient,
AdamW's intermediates) are page-faulted in and zeroed by the kernel again, 4 KB at a time: ~198,000
faults (775 MB) per step of the medium benchmark. ``TUNABLES``:

- ``glibc.malloc.hugetlb=1``: glibc advises transparent huge pages on the memory it takes, so
  those blocks fault in 2 MB at a time (512x fewer faults);
- ``glibc.malloc.mmap_threshold=32 MiB`` and ``glibc.malloc.trim_threshold=1 GiB``: smaller blocks
  come from the heap, which keeps its freed pages between steps instead of handing them back and
  faulting them in again (huge pages alone: the tiny SFT step 53 -> 83 ms). The compiler's freed
  memory is still handed back after each compile (``train.host_memory``).

Huge pages pay off only where a step has blocks of 32 MB or more (``worth_it``: an embedding, and so
the logits of ~1,000 positions, of at least 32 MB: every real model). Where it has none they cost:
the tiny benchmark's SFT step took 49-100 ms, erratic from one step to the next, with them and a
steady 56-60 ms without (``tools.bench --host-allocator``, four alternating runs), so the built-in
tiny models keep glibc's defaults.

glibc reads its tunables only when a process starts, so ``restart_tuned`` starts the same command
again (``os.execve``: the same process id, standard streams and arguments); ``experiment.main``
calls it once the command line is parsed, before the model is loaded. Nothing is changed where it
would not apply or the user decided: not Linux with glibc, transparent huge pages off (``never``),
``GLIBC_TUNABLES`` already set (the user's own settings win), or
``NNX_POSTTRAIN_HOST_ALLOCATOR=default``.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
            "glibc.malloc.trim_threshold=1073741824")
SWITCH = "NNX_POSTTRAIN_HOST_ALLOCATOR"  # "default": glibc's own settings, no restart
THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_BLOCK = 32 * 2**20  # glibc's largest heap block: from here on, every block is a fresh mmap


def worth_it(vocab: int, width: int) -> bool:
    """Whether a model's steps have blocks of ``MIN_BLOCK`` or more: its float32 embedding (the
    size of its gradient, and of ~1,000 positions' logits) reaches it."""
    return vocab * width * 4 >= MIN_BLOCK


def _thp_mode(path: str) -> str | None:
    """The kernel's transparent huge page mode (``always`` / ``madvise`` / ``never``), or None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def why_not(environ=None, thp_file: str = THP_FILE) -> str | None:
    """Why the tunables are not set for a process with ``environ``, or None when they apply."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH, "").lower() == "default":
        return f"{SWITCH}=default"
    if "GLIBC_TUNABLES" in environ:
        return "GLIBC_TUNABLES set by the user"
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "not Linux with glibc"
    mode = _thp_mode(thp_file)
    if mode not in ("always", "madvise"):
        return f"transparent huge pages {mode or 'unavailable'}"
    return None


def tuned_environment(environ=None, thp_file: str = THP_FILE) -> dict | None:
    """A copy of ``environ`` with ``GLIBC_TUNABLES = TUNABLES``, or None where they do not apply."""
    environ = os.environ if environ is None else environ
    if why_not(environ, thp_file) is not None:
        return None
    return dict(environ, GLIBC_TUNABLES=TUNABLES)


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


def restart_tuned() -> None:
    """Start this process's command again with the tunables (no return), where they apply and are
    not set yet; else nothing."""
    env = tuned_environment()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:  # the interpreter cannot be started again: go on with glibc's defaults
        print(f"host allocator: glibc defaults (restart failed: {e})", file=sys.stderr)


def describe(environ=None, reason: str | None = None) -> str:
    """One line for the run's log: the allocator settings this process runs with (``reason``:
    why it keeps glibc's defaults, where the caller decided that)."""
    environ = os.environ if environ is None else environ
    if environ.get("GLIBC_TUNABLES") == TUNABLES:
        return "host allocator: glibc tuned for XLA:CPU (huge pages for blocks >= 32 MB)"
    if "GLIBC_TUNABLES" in environ:
        return f"host allocator: GLIBC_TUNABLES={environ['GLIBC_TUNABLES']} (the user's)"
    why = why_not(environ) or reason
    return "host allocator: glibc defaults" + (f" ({why})" if why else "")
