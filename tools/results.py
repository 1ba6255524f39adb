"""The measured tables of the README and the docs, rendered from result files (claims are
generated, not typed).

A tool that measures something writes ``results/<name>.json`` with :func:`record`: the table's
columns and rows (already formatted), the command that measured it, the commit and the date. A
page (``README.md``, ``docs/**/*.md``) holds each table between markers::

    <!-- results:NAME -->
    ... (written by this tool; do not edit by hand) ...
    <!-- /results:NAME -->

    python -m tools.results            # rewrite every marked block of every page from results/*.json
    python -m tools.results --check    # exit 1 when a block differs from what its file renders to

A table that must be measured again (e.g. after a change to what it measures) can be marked
pending with :func:`pending`: its block then names the command instead of showing old numbers.

A test runs ``--check``, so a number on a page can only change by rerunning the tool that
measured it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

from tools import ToolError, exit_status

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
                    re.DOTALL)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        # the pages and results files do not change what is measured: not "+changes"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!README.md", ":!results", ":!docs"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    import os

    return f"{os.cpu_count()}-core {platform.machine()} CPU, {platform.python_implementation()} {platform.python_version()}"


def record(name: str, command: str, columns: list[str], rows: list[list], notes: list[str] = (),
           data: dict | None = None, where: str | None = None) -> Path:
    """Write ``results/<name>.json`` (rows formatted as strings) and return its path. ``data``
    keeps the raw numbers beside the formatted table; ``where``: the machine that measured it,
    when not this one (an accelerator's results recorded here)."""
    if any(len(r) != len(columns) for r in rows):
        raise ValueError(f"{name}: every row needs {len(columns)} cells")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({
        "name": name, "command": command, "commit": _commit(),
        "date": datetime.date.today().isoformat(), "machine": where or machine(),
        "columns": list(columns), "rows": [[str(c) for c in r] for r in rows],
        "notes": list(notes), "data": data or {},
    }, indent=1) + "\n")
    return path


def pending(name: str, command: str, reason: str) -> Path:
    """Write ``results/<name>.json`` for a table not measured at this commit: its block then
    says so and names the command that measures it (no numbers)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"name": name, "command": command, "pending": reason}, indent=1)
                    + "\n")
    return path


def publish(name: str, command: str, columns: list[str], rows: list[list], notes: list[str] = (),
            data: dict | None = None, echo=print) -> Path | None:
    """What a table tool ends with: the table printed, and unless ``name`` is 'none' recorded
    (``record``); the path written, or None."""
    echo(render({"name": name, "command": command, "commit": "", "date": "", "machine": "",
                 "columns": columns, "rows": [[str(c) for c in r] for r in rows],
                 "notes": list(notes)}))
    if name == "none":
        return None
    path = record(name, command, columns, rows, notes, data)
    echo(f"written {path}; render it into the pages with python -m tools.results")
    return path


def render(result: dict) -> str:
    """The Markdown of one result: the table, then how it was measured."""
    if result.get("pending"):
        return (f"*Not measured at this commit ({result['pending']}): run `{result['command']}`, "
                "then `python -m tools.results`.*\n")
    lines = ["| " + " | ".join(result["columns"]) + " |",
             "|" + "---|" * len(result["columns"])]
    lines += ["| " + " | ".join(row) + " |" for row in result["rows"]]
    lines.append("")
    lines.append(f"<sub>Measured by `{result['command']}` at commit {result['commit']} on "
                 f"{result['date']} ({result['machine']}); rendered by `python -m tools.results` "
                 f"from `results/{result['name']}.json`.</sub>")
    lines += [""] + [f"<sub>{note}</sub>" for note in result.get("notes", [])] if result.get("notes") else []
    return "\n".join(lines) + "\n"


def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise ToolError(f"results block {name!r}: {path} does not exist (run the tool that "
                         "measures it)")
    return json.loads(path.read_text())


def rendered(text: str) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + render(load(m.group("name"))) + m.group(4), text)


def pages() -> list[Path]:
    """Every page that may hold results blocks: the README and the docs."""
    return [README, *sorted(DOCS.rglob("*.md"))] if DOCS.is_dir() else [README]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    stale, count = [], 0
    for page in pages():
        text = page.read_text()
        names = [m.group("name") for m in _BLOCK.finditer(text)]
        if not names:
            continue
        count += len(names)
        new = rendered(text)
        if new != text:
            stale.append(f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}: "
                         f"{', '.join(n for n in names if render(load(n)) not in text)}")
            if not args.check:
                page.write_text(new)
    if args.check:
        if stale:
            print("stale pages (their blocks differ from results/*.json; run python -m "
                  "tools.results):\n  " + "\n  ".join(stale), file=sys.stderr)
            return 1
        print(f"{count} marked tables match their results files")
        return 0
    print(f"rendered {count} tables; rewrote {len(stale)} page(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
