"""The inspection notebook runs in a real Jupyter kernel on a run made by an experiment, and
``nnx-posttrain sample`` answers from a checkpoint."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from support import experiment_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("nb") / "run"
    cmd = experiment_command("sft", run, "--steps", "4", "--log-every", "1", "--eval.every", "2",
                             "--eval.batches", "1", "--eval.exact-match", "4",
                             "--batching.batch-size", "4")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.mark.slow
def test_inspect_run_notebook_executes_without_error(run_dir, monkeypatch):
    monkeypatch.setenv("NNX_RUN_DIR", str(run_dir))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    nb = nbformat.read(ROOT / "tools" / "inspect_run.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on any cell error
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "step 4" in text and "'total'" in text
    assert any("text/html" in o.get("data", {}) for o in outputs)  # treescope
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the metrics plot


@pytest.mark.slow
def test_sample_answers_from_a_checkpoint(run_dir):
    out = subprocess.run([sys.executable, "-m", "nnx_posttrain.cli", "sample", str(run_dir), "--prompt",
                          "What is 1 + 2?", "--prompt", "What is 3 + 4?", "--max-new-tokens", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("> What is") == 2
    missing = subprocess.run([sys.executable, "-m", "nnx_posttrain.cli", "sample", str(run_dir.parent / "nope"),
                              "--prompt", "hi"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert missing.returncode != 0 and "nope: not a run directory (no config.json)" in missing.stderr
