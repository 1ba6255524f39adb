"""The lighter install: nothing here needs TensorFlow. A fresh process where TensorFlow and
tensorflow-text cannot be imported (as in the README's install, which does not pull them) imports
the package, builds the micro model through KerasHub and trains 2 steps; in CI (the README's
command in a fresh environment) TensorFlow is not installed at all. That run does not import
PyTorch either (the test extra installs it, and tensorboardX would import it)."""

import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest

from support import MICRO, ROOT, records

ABSENT = """
import sys
BLOCKED = ("tensorflow", "tensorflow_text")
class Absent:  # every finder answers 'not found' for TensorFlow, as where it is not installed
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [Absent(f) for f in sys.meta_path]
import importlib.util
assert importlib.util.find_spec("tensorflow") is None
"""

BPE = """
import nnx_posttrain, keras_hub
from nnx_posttrain.model.load import Tokenizer
vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "\u0120": 4, "\u0120a": 5, "<|im_end|>": 6,
         "<|begin_of_text|>": 7, "<|end_of_text|>": 8, "<|start_header_id|>": 9,
         "<|end_header_id|>": 10, "<|eot_id|>": 11}
merges = ["a b", "\u0120 a"]
for cls in (keras_hub.models.QwenTokenizer, keras_hub.models.Llama3Tokenizer):
    tok = Tokenizer(cls(vocabulary=vocab, merges=merges))
    assert tok.encode("ab a") == [3, 5], tok.encode("ab a")
    assert tok.decode([3, 5]) == "ab a", repr(tok.decode([3, 5]))
print("BPE OK", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


TRAIN = ABSENT + """
sys.argv = ["experiments.sft", *sys.argv[1:]]
import runpy
try:
    runpy.run_module("experiments.sft", run_name="__main__")
except SystemExit as stop:  # the command's exit: on success, the tokenizers' check follows
    if stop.code:
        raise
finally:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("TENSORFLOW MODULES", loaded)
    print("PYTORCH IMPORTED", "torch" in sys.modules)  # installed here, never needed by a run
""" + BPE  # in the same process: one start of JAX and KerasHub less


@pytest.mark.slow
def test_trains_without_tensorflow(tmp_path):
    run_dir = tmp_path / "run"
    # NNX_POSTTRAIN_TENSORFLOW=1 lifts the package's own guard: only real absence is left
    env = dict(os.environ, PYTHONPATH=str(ROOT), NNX_POSTTRAIN_TENSORFLOW="1")
    out = subprocess.run([sys.executable, "-c", TRAIN, *MICRO, "--run-dir", str(run_dir),
                          "--steps", "2", "--batching.batch-size", "4", "--eval.batches", "1",
                          "--eval.exact-match", "4", "--eval.every", "0", "--log-every", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TENSORFLOW MODULES []" in out.stdout
    if importlib.util.find_spec("torch") is not None:  # tensorboardX would import it
        assert "PYTORCH IMPORTED False" in out.stdout
    assert [r["step"] for r in records(run_dir)] == [1, 2]
    # Llama 3 and Qwen's byte-pair tokenizers (KerasHub's, no SentencePiece fast path) encode
    # and decode without TensorFlow (KerasHub then returns str, not a tensor of bytes)
    assert "BPE OK []" in out.stdout


@pytest.mark.slow
def test_the_package_does_not_import_tensorflow():
    code = ("import sys, nnx_posttrain.tasks, nnx_posttrain.train, keras_hub; "
            "nnx_posttrain.tasks.register(); "
            "from nnx_posttrain import model; model.load('gemma_micro'); "
            "assert not [m for m in sys.modules if m.startswith('tensorflow') and sys.modules[m]]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_keras_hub_is_installed_without_tensorflow_text():
    """pyproject: keras-hub is not a dependency (its metadata would pull tensorflow-text and
    TensorFlow); its real runtime requirements are. In CI the README's install ran: no TF."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].split("!")[0]
             .strip().lower() for d in deps}
    assert "keras-hub" not in names and not {"tensorflow", "tensorflow-text"} & names
    assert {"absl-py", "regex", "rich", "kagglehub", "tokenizers", "sentencepiece"} <= names
    assert importlib.util.find_spec("keras_hub") is not None
    if os.environ.get("CI"):
        assert importlib.util.find_spec("tensorflow") is None, "the install pulled TensorFlow"
        assert importlib.util.find_spec("tensorflow_text") is None


def test_ci_runs_the_readmes_commands_install():
    """.ci/run runs the README's second command verbatim; the first installs the same way."""
    ci = (ROOT / ".ci" / "run").read_text().split("verbatim from here on ---\n", 1)[1].strip()
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("python3 -m venv .venv")]
    assert lines[1].endswith(" && " + ci), (lines[1], ci)
    keras_hub = 'pip install --no-deps "keras-hub>=0.32,<0.33"'
    assert keras_hub in lines[0] and keras_hub in ci
