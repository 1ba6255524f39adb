"""The measured tables of the README and the docs are rendered from results/*.json by
``tools.results``: every page matches them, an edited number is caught; the experiment commands
the pages show validate as written; the README stays a page (at most 250 lines, a real model on
the user's file within the first 120)."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tools import ToolError
from tools import results as readme

ROOT = Path(__file__).resolve().parents[1]


def test_the_pages_match_their_results_files(capsys):
    assert readme.main(["--check"]) == 0, capsys.readouterr().err
    text = (readme.DOCS / "results.md").read_text()
    for name in ("default_run", "method_table", "fault_cases"):
        assert f"<!-- results:{name} -->" in text and (readme.RESULTS / f"{name}.json").exists()


def test_the_readme_is_a_page_that_starts_a_newcomer_on_a_real_model():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    head = "\n".join(lines[:120])
    assert "python -m experiments.sft" in head and "pip install" in head  # the two commands
    assert "--model gemma_2b --data pairs.jsonl" in head and "--config" in head  # your model, file
    assert "prompt" in head and "chosen" in head and "messages" in head  # the formats


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    monkeypatch.setattr(readme, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(readme, "README", tmp_path / "README.md")
    monkeypatch.setattr(readme, "DOCS", tmp_path / "docs")
    readme.record("t", "python -m tools.x", ["a", "b"], [[1, "2.5%"]], notes=["one run"],
                  data={"range": [0.1, 0.2]})
    readme.README.write_text("intro\n<!-- results:t -->\nold\n<!-- /results:t -->\nend\n")
    return tmp_path


def test_render_then_check_and_an_edited_number_fails(fake_repo, capsys):
    assert readme.main(["--check"]) == 1  # "old" is not what results/t.json renders to
    assert readme.main([]) == 0
    text = readme.README.read_text()
    assert "| 1 | 2.5% |" in text and "python -m tools.x" in text and text.endswith("end\n")
    assert readme.main(["--check"]) == 0
    readme.README.write_text(text.replace("2.5%", "3.5%"))
    assert readme.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    saved = json.loads((readme.RESULTS / "t.json").read_text())
    assert saved["data"] == {"range": [0.1, 0.2]} and saved["commit"] and saved["date"]


def test_a_missing_results_file_is_named(fake_repo):
    readme.README.write_text("<!-- results:nothing -->\n<!-- /results:nothing -->\n")
    with pytest.raises(ToolError, match="nothing.*does not exist"):
        readme.main(["--check"])


def test_a_pending_table_names_its_command(fake_repo):
    readme.pending("t", "python -m tools.x --seeds 3", "the loss changed")
    assert readme.main([]) == 0
    text = readme.README.read_text()
    assert "Not measured at this commit (the loss changed)" in text
    assert "`python -m tools.x --seeds 3`" in text and "2.5%" not in text


def test_record_refuses_a_ragged_table(fake_repo):
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        readme.record("u", "cmd", ["a", "b"], [[1]])


def _readme_commands():
    """Every ``python -m experiments.<name> ARGS`` in the README and the docs (continuation lines
    joined) whose arguments are literal (no ``...``, ``$VAR`` or ``<placeholder>``)."""
    text = "\n".join(p.read_text() for p in readme.pages()).replace("\\\n", " ")
    for m in re.finditer(r"python -m experiments\.([a-z_]+)([^\n`\"#|;)]*)", text):
        name, rest = m.group(1), m.group(2).split("&&")[0]
        if not any(t in rest for t in ("...", "$", "<", "[", "{", "--help")):
            yield name, shlex.split(rest)


@pytest.mark.slow
def test_every_command_the_pages_show_is_a_valid_configuration(monkeypatch):
    """A command the README or the docs show must at least parse and validate as written (the
    pod-slice command once asked for two '-1' mesh axes and was refused on every run)."""
    from nnx_posttrain import errors
    from nnx_posttrain.cli.train_command import config_from

    monkeypatch.chdir(ROOT)  # --config experiments/configs/... as a user in the repository runs it
    commands = list(_readme_commands())
    assert len(commands) >= 15, commands  # the extraction still finds them
    refused = []
    for name, args in commands:
        if "--config" in args and not (ROOT / args[args.index("--config") + 1]).exists():
            continue  # another run's config.json
        try:
            config_from(name, args, name)
        except (SystemExit, errors.UserError) as exc:
            refused.append((name, args, str(exc)))
    assert not refused, refused
