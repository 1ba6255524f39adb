"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a page outside the
navigation or an API reference to a name that moved fails it), and the developers' tools sit
apart from the library."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    train = (tmp_path / "site" / "reference" / "train" / "index.html").read_text()
    assert "prepare" in train and "evaluate_only" in train  # the reference came from docstrings


def test_only_the_library_is_installed_and_it_never_imports_the_tools():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert find["packages"]["find"]["include"] == ["nnx_posttrain*"]
    for path in (ROOT / "nnx_posttrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "tools" or n.startswith(("tools.", "experiments")) for n in names), \
                (path, names)
