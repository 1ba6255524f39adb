"""Where the test suite's time goes to JAX: a pytest plugin that sums, per test, the seconds its
process spent tracing (jaxpr), lowering (to MLIR) and compiling programs (XLA's compile, or the
read back from the persistent compilation cache), as JAX's own monitoring events report them.

    python -m pytest -n auto -q -p tools.suite_compile             # appends to suite_compile.jsonl
    python -m tools.suite_compile suite_compile.jsonl           # the files and tests that cost most

One JSON line per test (``SUITE_COMPILE_OUT`` names the file): its id, its wall seconds (setup,
call and teardown), the three sums and the number of programs compiled (op-by-op work, each
operation its own program, shows as hundreds). A run with an empty compilation cache
(``JAX_COMPILATION_CACHE_DIR`` set to a new folder, as on CI) shows what compiling costs; with a
warm one, what tracing and lowering still cost. Programs compiled in processes a test starts are
not counted (their time is in the test's wall seconds).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_current: dict[str, float] = {}


def _listen(event: str, seconds: float, **_) -> None:
    kind = EVENTS.get(event)
    if kind:
        _current[kind] = _current.get(kind, 0.0) + seconds
    if kind == "compile":  # a program compiled or read back: op-by-op work shows as many
        _current["programs"] = _current.get("programs", 0) + 1


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)


def pytest_unconfigure(config):
    import jax.monitoring

    jax.monitoring.unregister_event_duration_listener(_listen)


def pytest_runtest_protocol(item, nextitem):
    _current.clear()
    _current["start"] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    start = _current.pop("start", None)
    if start is None:
        return
    line = {"test": nodeid, "wall": round(time.perf_counter() - start, 3),
            **{kind: round(_current.get(kind, 0.0), 3) for kind in EVENTS.values()},
            "programs": _current.get("programs", 0)}
    with open(os.environ.get("SUITE_COMPILE_OUT", "suite_compile.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def summary(path: Path, top: int = 25) -> str:
    """The files, then the tests, with the most compile seconds, and the totals."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_file = collections.defaultdict(lambda: collections.Counter())
    for row in rows:
        by_file[row["test"].split("::")[0]].update(
            {k: row[k] for k in ("wall", "trace", "lower", "compile")})
    total = sum((c for c in by_file.values()), collections.Counter())
    out = [f"{len(rows)} tests: wall {total['wall']:.0f} s, trace {total['trace']:.0f} s, "
           f"lower {total['lower']:.0f} s, compile {total['compile']:.0f} s (process seconds)",
           "", "file | wall | trace | lower | compile"]
    for name, c in sorted(by_file.items(), key=lambda kv: -kv[1]["compile"])[:top]:
        out.append(f"{name} | {c['wall']:.0f} | {c['trace']:.0f} | {c['lower']:.0f} | "
                   f"{c['compile']:.0f}")
    out += ["", "test | wall | compile | programs"]
    for row in sorted(rows, key=lambda r: -r["compile"])[:top]:
        out.append(f"{row['test']} | {row['wall']:.1f} | {row['compile']:.1f} | "
                   f"{row.get('programs', '')}")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(summary(args.jsonl, args.top))


if __name__ == "__main__":
    main()
