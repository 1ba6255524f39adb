"""The process's host memory: Keras imported without its optional pandas / matplotlib imports
(``nnx_posttrain/__init__``), and the compiler's freed memory handed back after each compile
(``train.host_memory``). Fresh processes: both act at first import / first compile."""

import os
import subprocess
import sys

import pytest

from support import ROOT


def _python(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), **env), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(not (_installed("pandas") and _installed("matplotlib")),
                    reason="pandas / matplotlib not installed: Keras would not import them anyway")
def test_keras_is_imported_without_pandas_and_matplotlib_which_stay_importable():
    out = _python(
        "import sys, importlib.machinery\n"
        "import nnx_posttrain, keras, keras_hub\n"
        "print('LOADED', sorted(m for m in ('pandas', 'matplotlib') if m in sys.modules))\n"
        "from keras.src.trainers.data_adapters import array_slicing\n"
        "print('KERAS PANDAS', array_slicing.pandas)\n"
        "print('LOADER', type(keras.__spec__.loader).__name__, type(keras.__loader__).__name__)\n"
        "print('FINDERS', [type(f).__name__ for f in sys.meta_path if 'Keras' in type(f).__name__])\n"
        "import pandas, matplotlib.pyplot as plt\n"
        "print('USER IMPORTS', pandas.DataFrame({'a': [1]}).shape, plt.__name__)\n")
    assert "LOADED []" in out
    assert "KERAS PANDAS None" in out
    assert "LOADER SourceFileLoader SourceFileLoader" in out  # Keras' own loader put back
    assert "FINDERS []" in out  # used once, gone
    assert "USER IMPORTS (1, 1) matplotlib.pyplot" in out


@pytest.mark.skipif(not _installed("pandas"), reason="pandas not installed")
def test_an_extra_imported_first_or_the_switch_leaves_keras_as_it_is():
    first = _python("import pandas, nnx_posttrain, keras\n"
                    "from keras.src.trainers.data_adapters import array_slicing\n"
                    "print('KERAS PANDAS', array_slicing.pandas is pandas)\n")
    assert "KERAS PANDAS True" in first
    switched = _python("import sys, nnx_posttrain, keras\n"
                       "print('LOADED', 'pandas' in sys.modules)\n",
                       NNX_POSTTRAIN_KERAS_EXTRAS="1")
    assert "LOADED True" in switched


def test_memory_is_trimmed_after_each_compile_that_counts():
    """The listener hears JAX's backend-compile event (a renamed event would leave it deaf):
    a compile of >= MIN_COMPILE_S trims once; with the threshold raised, a compile does not."""
    out = _python(
        "import nnx_posttrain, jax, jax.numpy as jnp\n"
        "from nnx_posttrain.train import host_memory\n"
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


@pytest.mark.skipif(not _installed("torch"), reason="torch not installed")
def test_tensorboardx_is_imported_without_torch_which_stays_importable():
    """The same hiding for tensorboardX's torch (``metrics_log``); a torch imported first is
    tensorboardX's to use."""
    out = _python("import sys\n"
                  "from nnx_posttrain import metrics_log\n"
                  "metrics_log._summary_writer()\n"
                  "print('LOADED', 'torch' in sys.modules)\n"
                  "import torch\n"
                  "print('USER IMPORT', torch.zeros(2).shape[0])\n")
    assert "LOADED False" in out and "USER IMPORT 2" in out
    first = _python("import torch\n"
                    "from nnx_posttrain import metrics_log\n"
                    "metrics_log._summary_writer()\n"
                    "import tensorboardX.writer as w\n"
                    "print('TENSORBOARDX TORCH', w.numpy_compatible is torch.Tensor)\n")
    assert "TENSORBOARDX TORCH True" in first


# ----------------------------------------------------------------------------- glibc's tunables


def test_the_tunables_apply_only_where_they_can_and_the_user_has_not_decided(tmp_path):
    from nnx_posttrain import host_allocator as ha

    thp = tmp_path / "enabled"
    linux_glibc = sys.platform == "linux" and __import__("platform").libc_ver()[0] == "glibc"
    for mode, applies in (("always madvise [never]", False), ("always [madvise] never", True),
                          ("[always] madvise never", True)):
        thp.write_text(mode + "\n")
        env = ha.tuned_environment({"PATH": "/bin"}, str(thp))
        if applies and linux_glibc:
            assert env == {"PATH": "/bin", "GLIBC_TUNABLES": ha.TUNABLES}
        else:
            assert env is None
    thp.write_text("always [madvise] never\n")
    assert ha.why_not({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, str(thp)) == \
        "GLIBC_TUNABLES set by the user"
    assert ha.why_not({ha.SWITCH: "default"}, str(thp)) == f"{ha.SWITCH}=default"
    assert ha.why_not({}, str(tmp_path / "missing")) in (
        "transparent huge pages unavailable", "not Linux with glibc")
    assert ha.describe({"GLIBC_TUNABLES": ha.TUNABLES}).startswith("host allocator: glibc tuned")
    assert ha.describe({"GLIBC_TUNABLES": "x=1"}) == "host allocator: GLIBC_TUNABLES=x=1 (the user's)"
    assert ha.describe({ha.SWITCH: "default"}) == \
        f"host allocator: glibc defaults ({ha.SWITCH}=default)"
    # the heap setting (models without blocks of 32 MB) needs no huge pages, else the same rules
    thp.write_text("always madvise [never]\n")
    env = ha.tuned_environment({"PATH": "/bin"}, str(thp), ha.HEAP)
    assert env == ({"PATH": "/bin", "GLIBC_TUNABLES": ha.HEAP} if linux_glibc else None)
    assert ha.why_not({"GLIBC_TUNABLES": "x=1"}, str(thp), ha.HEAP) == "GLIBC_TUNABLES set by the user"
    assert ha.why_not({ha.SWITCH: "default"}, str(thp), ha.HEAP) == f"{ha.SWITCH}=default"
    assert ha.describe({"GLIBC_TUNABLES": ha.HEAP}) == \
        "host allocator: glibc tuned for XLA:CPU (every block from the heap, kept between steps)"
    assert "mmap_max=0" in ha.HEAP and "hugetlb" not in ha.HEAP
    assert ha.tunables_for(512, 128) == ha.HEAP and ha.tunables_for(32000, 512) == ha.TUNABLES


def test_a_command_restarts_once_with_the_tunables_keeping_its_arguments(tmp_path):
    """The mechanism ``experiment.main`` uses, on a package of its own: ``python -u -m pkg.show``
    starts again with GLIBC_TUNABLES (same process id, same arguments), and only once; importing
    the package from other code, or the switch, restarts nothing."""
    from nnx_posttrain import host_allocator as ha

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os, sys\n"
        "from nnx_posttrain import host_allocator\n"
        "print('START', os.getpid(), flush=True)\n"
        "if host_allocator.started_as_command('pkg'):\n"
        "    host_allocator.restart_tuned()\n")
    (pkg / "show.py").write_text(
        "import os, sys\n"
        "print('RUN', os.getpid(), sys.argv[1:], os.environ.get('GLIBC_TUNABLES'))\n")

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", ha.SWITCH)}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"

    def run(args, **extra):
        out = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                             env=dict(env, **extra), timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.splitlines()

    expected = ha.TUNABLES if ha.tuned_environment(env) else None
    lines = run(["-u", "-m", "pkg.show", "a", "--b"])
    starts = [l for l in lines if l.startswith("START")]
    assert len(starts) == (2 if expected else 1), lines
    assert len({l.split()[1] for l in starts}) == 1  # os.execve: the same process
    assert lines[-1] == f"RUN {starts[0].split()[1]} ['a', '--b'] {expected}"
    # imported by other code (here: python -c), nothing restarts
    assert run(["-c", "import pkg; import pkg.show"])[-1].endswith(" [] None")
    off = run(["-m", "pkg.show"], **{ha.SWITCH: "default"})
    assert len([l for l in off if l.startswith("START")]) == 1 and off[-1].endswith(" None")


def test_a_training_command_restarts_with_huge_pages_for_a_real_model(tmp_path):
    """``experiment.main`` decides once the command line is parsed, before the model loads: a
    model that is not a built-in tiny one (here a preset directory that does not exist: the run
    then fails with its own message) restarts the command with huge pages (a built-in tiny
    model's command restarts with the heap setting: tests/test_checkpoint.py)."""
    from nnx_posttrain import experiment, host_allocator as ha

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", ha.SWITCH)}
    cmd = [sys.executable, "-m", "experiments.sft", "--run-dir", str(tmp_path / "run"),
           "--steps", "1", "--model", str(tmp_path / "no_such_preset")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "no_such_preset" in out.stderr, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == ha.describe(ha.tuned_environment(env) or env), lines
    # in-process (a test, a notebook): the line only, never a restart
    assert experiment.host_allocator_for("gemma_micro") == ha.describe()
    assert experiment.host_allocator_for(str(tmp_path / "preset")) == ha.describe()
