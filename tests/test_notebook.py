"""The inspection notebook runs in a real Jupyter kernel on a finished run, and
``nnx-posttrain sample`` answers from a checkpoint."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from support import MICRO, cli_error, train_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("nb") / "run"
    train_run("sft", *MICRO, "--run-dir", run, "--steps", "4", "--log-every", "1",
              "--eval.every", "2", "--eval.batches", "1", "--eval.exact-match", "4",
              "--batching.batch-size", "4")
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
def test_sample_answers_from_a_checkpoint(run_dir, capsys):
    from nnx_posttrain import cli

    assert cli.main(["sample", str(run_dir), "--prompt", "What is 1 + 2?", "--prompt",
                     "What is 3 + 4?", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.count("> What is") == 2
    cli_error(capsys, ["sample", str(run_dir.parent / "nope"), "--prompt", "hi"],
              match="nope: not a run directory \\(no config.json\\)")
