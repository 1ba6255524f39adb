"""The process's host memory on CPU (``train.host_memory``): glibc's allocator set in-process
for XLA's step buffers, and the compiler's freed memory handed back after each compile. Fresh
processes: both change the process they run in."""

import os
import platform
import subprocess
import sys

import pytest

from support import ROOT

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


# ``nnx_posttrain.train.host_memory`` alone, read from its file: the package's ``train`` imports
# the loop (Keras, the model families: seconds a process), and nothing it imports sets the
# allocator (glibc's mmap threshold stops rising at 32 MB: the 64 MB blocks below are mmapped
# under its defaults whatever ran before)
HOST_MEMORY = """
import importlib.util
_spec = importlib.util.spec_from_file_location("host_memory", "nnx_posttrain/train/host_memory.py")
host_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_memory)
"""


def _python(code: str, *args, **env) -> str:
    """``code`` in a fresh process: without a GLIBC_TUNABLES, and without the test session's
    compilation cache (a compile read back from it is no compile)."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GLIBC_TUNABLES", "JAX_COMPILATION_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                         text=True, env=dict(clean, PYTHONPATH=str(ROOT), **env), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_memory_is_trimmed_after_each_compile_that_counts():
    """The listener hears JAX's backend-compile event (a renamed event would leave it deaf):
    a compile of >= MIN_COMPILE_S trims once; with the threshold raised, a compile does not."""
    out = _python(
        HOST_MEMORY +
        "import jax, jax.numpy as jnp\n"
        "assert host_memory.release_after_compiles() and host_memory.release_after_compiles()\n"
        "x = jnp.ones(4)\n"
        "before = host_memory.trims()\n"
        "host_memory.MIN_COMPILE_S = 0.0\n"
        "jax.jit(lambda x: jnp.tanh(x) * 3).lower(x).compile()\n"
        "print('TRIMS', host_memory.trims() - before)\n"
        "host_memory.MIN_COMPILE_S = 1e9\n"
        "jax.jit(lambda x: jnp.sin(x) * 2).lower(x).compile()\n"
        "print('TRIMS AFTER', host_memory.trims() - before)\n")
    assert "TRIMS 1" in out and "TRIMS AFTER 1" in out


FAULTS = HOST_MEMORY + """
import resource, sys
import numpy as np
print(host_memory.set_allocator(sys.argv[1]))
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # 64 MB blocks, allocated, written and freed as a step's buffers are
    block = np.ones(8 * 2**20)
    del block
before = faults()
for _ in range(5):
    block = np.ones(8 * 2**20)
    del block
print("FAULTS", faults() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")
def test_the_heap_setting_keeps_freed_blocks_mapped_in_process():
    """What the setting is for: a block freed and allocated again takes no page fault (glibc's
    defaults hand a 64 MB block back to the kernel and fault it in again, 4 KB at a time)."""
    def faults(setting):
        out = _python(FAULTS, setting).splitlines()
        return out[0], int(out[-1].split()[1])

    said, default = faults("default")
    assert said == "host allocator: glibc defaults"
    said, heap = faults("heap")
    assert said == "host allocator: every block from the heap, kept between steps"
    assert heap * 10 < default and heap < 200, (heap, default)
    said = _python(FAULTS, "heap", GLIBC_TUNABLES="glibc.malloc.arena_max=2").splitlines()[0]
    assert said == "host allocator: GLIBC_TUNABLES=glibc.malloc.arena_max=2 (the user's)"


def test_auto_takes_the_heap_for_models_without_blocks_of_32_mb():
    from nnx_posttrain.train import host_memory

    assert host_memory.choose("auto", 314, 128) == "heap"  # the built-in tiny models
    assert host_memory.choose("auto", 256000, 2048) == "default"  # gemma_2b's embedding: 2 GB
    assert host_memory.choose("heap", 256000, 2048) == "heap"  # as asked
    assert host_memory.choose("default", 314, 128) == "default"
