"""Shared fixtures. ``nnx_posttrain.tasks.register()`` registers the built-in models and data
(``gemma_micro``, ``--data builtin``), as the training loop does; plain helpers (command lines of
the micro model, in-process runs, metric readers) live in ``support.py``.

JAX's persistent compilation cache is on for the session and every process it starts (set here,
before anything imports JAX): the many micro runs compile the same programs, and a program
compiled once is read back instead of compiled again. XLA's CPU backend compiles without LLVM
optimisation (``--xla_backend_optimization_level=0``) and emits its loop fusions with its older
LLVM IR emitters, not the MLIR fusion emitters (``--xla_cpu_use_fusion_emitters=false``), and
in one LLVM module (``--xla_cpu_parallel_codegen_split_count=1``: splitting it for parallel code
generation gains nothing on 2 cores and costs more): the micro models' steps take milliseconds
and their compilation seconds (a micro SFT step: 1.8 s to compile with the first flag alone, 0.6 s
with both; the fast tier's compilation ~60% shorter; with an empty cache, the attention tests
compiled for 61 s before the third flag, 52 s with it: ``tools.suite_compile``), so the suite is
far faster; the programs compute the same operations (equalities are asserted between
runs of one setting, ranges against recorded runs). The tests whose runs are long enough for
unoptimised code to cost more compile as a user's run does (the ``optimized`` fixture).
"""

import os
import tempfile
from pathlib import Path

# JAX on the CPU, in this process and those it starts: the test extra installs libtpu (the TPU
# compiler the plan tests compile with), and without this JAX would try the TPU runtime at start
# and log a page of warnings on a host without TPU chips
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(tempfile.gettempdir()) / "nnx_posttrain_jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
XLA_TEST_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()

import gc  # noqa: E402

# Python's cyclic garbage collector, less often: tracing a model makes hundreds of thousands of
# objects that live for the trace, so at the default threshold (700 allocations) many survive
# into the oldest generation, and a full collection of a test process (millions of objects
# after jax, keras, torch and many runs) costs 1-2 s; they came to ~10% of the suite's time.
# Objects are still freed by their reference count as before; cycles a little later.
gc.set_threshold(50_000, 20, 20)

import nnx_posttrain  # noqa: E402,F401  (the Keras backend, before keras is imported)
import nnx_posttrain.tasks  # noqa: E402
import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

from nnx_posttrain import model  # noqa: E402
from support import FAST_STEPS, MICRO, train_run  # noqa: E402

nnx_posttrain.tasks.register()  # the built-in models and data, as the training loop registers them


# memory per worker: the largest process of a fresh clone's whole suite peaked at 7.6 GiB, but
# workers peak at different moments (12 workers ran the suite in 45 GB: docs/contributing.md)
GIB_PER_WORKER = 3


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the README's command): one worker per core this process may run on, at most
    one per ``GIB_PER_WORKER`` GiB of available memory (the suite spends its time compiling
    and running programs, one core each; 2 cores: 2 workers, as CI has; 12 cores: ~10 minutes,
    docs/contributing.md)."""
    import psutil

    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # Linux
             else os.cpu_count() or 1)
    by_memory = psutil.virtual_memory().available // (GIB_PER_WORKER * 2**30)
    return max(1, min(cores, by_memory))


def pytest_collection_modifyitems(config, items):
    """The TPU tier (tests/test_tpu.py) runs only when selected, ``python -m pytest -m tpu``:
    deselected otherwise (CI and the README's command run on CPUs)."""
    if "tpu" in (config.option.markexpr or "").replace("not tpu", ""):
        return
    chip = [item for item in items if "tpu" in item.keywords]
    if chip:
        config.hook.pytest_deselected(items=chip)
        items[:] = [item for item in items if "tpu" not in item.keywords]


@pytest.fixture
def optimized(monkeypatch):
    """The processes a test starts compile with XLA's usual optimisation (as a user's run
    does): for the tests whose runs are long enough that -O0 code costs more than it saves."""
    flags = os.environ.get("XLA_FLAGS", "").replace(XLA_TEST_FLAGS, "").strip()
    monkeypatch.setenv("XLA_FLAGS", flags)


# Finished micro runs that many tests read (or copy, to change them): built once per test
# session, by the first worker that asks, in its own process; read-only for the tests.
SHARED_RUNS = {
    # 4 steps of the micro SFT, checkpoints at 2 and 4, no evaluation
    "sft": ("sft", [*MICRO, *FAST_STEPS]),
    # the same with LoRA rank 2 on the attention projections, a learning rate that moves them
    "sft_lora": ("sft", [*MICRO, *FAST_STEPS, "--lora.rank", "2", "--lora.targets", "attention",
                         "--optim.learning-rate", "1e-2"]),
}


@pytest.fixture(scope="module")
def micro():
    """The micro built-in Gemma (2 layers, hidden 32), seed 0: a fresh one per test module."""
    return model.load("gemma_micro", seed=0)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, worker_id):
    """``shared_run(name)``: the directory of the finished run ``SHARED_RUNS[name]``, trained
    once for the whole session (the xdist workers share one, under a file lock). Read it, or
    ``shutil.copytree`` it before changing anything."""
    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent

    def get(name: str) -> Path:
        algorithm, args = SHARED_RUNS[name]
        path = root / "shared_runs" / name
        with FileLock(str(root / f"shared_run_{name}.lock")):
            if not (path / "DONE").exists():
                if path.exists():  # a build a previous session left half done
                    import shutil

                    shutil.rmtree(path)
                train_run(algorithm, *args, "--run-dir", path, echo=lambda _: None)
                (path / "DONE").touch()
        return path

    return get

