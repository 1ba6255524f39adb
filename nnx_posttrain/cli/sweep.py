"""``nnx-posttrain sweep ALGORITHM --grid KEY=V1,V2 ...``: each point of a cartesian grid as its
own run, one process per point, sequentially, resumable.

    nnx-posttrain sweep simpo --grid algo.beta=2,2.5 algo.gamma_beta_ratio=0.3,0.5 \\
        [--out runs/sweep_simpo] [-- extra overrides passed to every point]

Each point runs ``python -m nnx_posttrain.cli simpo --run-dir <out>/<name> --algo.beta 2
--algo.gamma-beta-ratio 0.3 <extra>`` where name is ``algo.beta=2,algo.gamma_beta_ratio=0.3``.
Every point's options are parsed as its command would parse them before the first point runs (a
bad value or key is refused up front). Run the same command again to continue a sweep: a point whose run is
complete (its last train record's step equals the steps in its config.json) and whose command is
the one ``sweep.json`` recorded is skipped; any other is run again, and the experiment resumes
from its latest checkpoint (refusing, as it always does, settings a resume cannot change; more
``--steps`` continue a finished point). Ctrl-C stops the sweep, not only the point it is in.
``<out>/sweep.json`` records the grid and each point's run directory, command and status; at the
end ``nnx_posttrain.compare`` compares every point that has metrics (tables printed, plots in
``<out>/compare/``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from nnx_posttrain import algorithms, errors

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*$")


class GridError(errors.ConfigError):
    """A malformed ``--grid``; the message names the item."""


def parse_grid(specs: list[str]) -> dict[str, list[str]]:
    """["algo.beta=2,2.5", ...] -> {"algo.beta": ["2", "2.5"], ...} (in the order given).
    GridError with the offending item for a malformed one."""
    if not specs:
        raise GridError("--grid needs at least one KEY=V1,V2,... item")
    grid: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not _KEY.match(key):
            raise GridError(f"bad grid item {spec!r}: expected KEY=V1,V2,... with a dotted config "
                            f"key, e.g. algo.beta=2,2.5")
        vals = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in vals):
            raise GridError(f"bad grid item {spec!r}: empty value (expected KEY=V1,V2,...)")
        if len(set(vals)) < len(vals):
            raise GridError(f"bad grid item {spec!r}: repeated value")
        norm = key.replace("-", "_")
        if any(k.replace("-", "_") == norm for k in grid):
            raise GridError(f"grid key {key!r} given twice")
        if norm == "run_dir":
            raise GridError("--run-dir is set by the sweep for each point; it cannot be a grid key")
        grid[key] = vals
    return grid


def expand(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """The cartesian product, first key varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_name(point: dict[str, str]) -> str:
    """{"algo.beta": "2", "algo.gamma_beta_ratio": "0.3"} -> "algo.beta=2,algo.gamma_beta_ratio=0.3"."""
    return ",".join(f"{k}={v}" for k, v in point.items()).replace("/", "_")


def command(algorithm: str, run_dir: Path, point: dict[str, str], extra: list[str]) -> list[str]:
    opts = []
    for key, value in point.items():
        option = key.replace("_", "-")
        if value.lower() in ("true", "false"):  # tyro flags: --a.flag / --a.no-flag
            head, _, last = option.rpartition(".")
            prefix = head + "." if head else ""
            opts.append(f"--{option}" if value.lower() == "true" else f"--{prefix}no-{last}")
        else:
            opts += ["--" + option, value]
    return [sys.executable, "-m", "nnx_posttrain.cli", algorithm, "--run-dir", str(run_dir),
            *opts, *extra]


def is_complete(run_dir: str | Path) -> bool:
    """True if the run's last train record is at the configured number of steps."""
    run_dir = Path(run_dir)
    try:
        steps = json.loads((run_dir / "config.json").read_text())["steps"]
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError, KeyError):
        return False
    last = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed process
        if record.get("split") == "train":
            last = record
    return last is not None and last.get("step") == steps


def check_points(algorithm: str, entries: list[dict]) -> None:
    """Parse every point's options as its command will, before any point runs: ``ConfigError``
    naming the point whose options are refused."""
    from nnx_posttrain.cli.train_command import config_from

    for entry in entries:
        args = entry["command"][3:]  # after "-m nnx_posttrain.cli ALGORITHM"
        try:
            config_from(algorithm, args, algorithm)
        except (SystemExit, errors.UserError) as exc:
            detail = (f": {exc}" if isinstance(exc, errors.UserError) else
                      "" if isinstance(exc.code, int) else f": {exc.code}")
            raise errors.ConfigError(f"sweep point {entry['name']}: {algorithm} refuses its "
                                     f"options{detail or ' (the message above)'}; nothing was "
                                     "run") from None


def _previous_commands(path: Path) -> dict[str, list[str]]:
    """{point name: command} of an earlier run of the sweep (``sweep.json``), {} if none."""
    try:
        return {p["name"]: p["command"] for p in json.loads(path.read_text())["points"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def algorithm_name(name: str) -> str:
    """``simpo`` or ``experiments.simpo`` -> ``simpo``; ``ConfigError`` for another name."""
    algorithm = name.removeprefix("experiments.")
    if algorithm not in algorithms.names():
        raise errors.ConfigError(f"no algorithm {name!r}: one of {', '.join(algorithms.names())}")
    return algorithm


def _write(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


def plan(algorithm: str, grid_specs: list[str], out: Path, extra: list[str]) -> dict:
    """The sweep's state (what ``sweep.json`` holds): every point's run directory and command,
    each checked as its command will parse it; ``ConfigError`` before anything runs."""
    grid = parse_grid(grid_specs)
    if any(a == "--run-dir" or a.startswith("--run-dir=") or a == "--run_dir" for a in extra):
        raise errors.ConfigError("--run-dir is set by the sweep for each point; give --out instead")
    entries = []
    for p in expand(grid):
        run_dir = out / point_name(p)
        entries.append({"name": point_name(p), "params": p, "run_dir": str(run_dir),
                        "command": command(algorithm, run_dir, p, extra)[1:],
                        "status": "pending"})
    check_points(algorithm, entries)
    return {"algorithm": algorithm, "grid": grid, "extra": extra, "points": entries}


def run_point(i: int, entry: dict, state: dict, out: Path, previous: dict, echo) -> str:
    """Run one point in its own process (or skip it: complete, with the command ``previous``
    (the last sweep's) recorded for it); returns its status."""
    run_dir, n = Path(entry["run_dir"]), len(state["points"])
    if is_complete(run_dir) and previous.get(entry["name"], entry["command"]) == entry["command"]:
        echo(f"[sweep {i}/{n}] {entry['name']}: complete, skipped")
        return "skipped (complete)"
    cmd = [sys.executable, *entry["command"]]
    entry["status"] = "running"
    _write(out / "sweep.json", state)
    echo(f"[sweep {i}/{n}] {entry['name']}: " + " ".join(cmd[1:]))
    try:
        rc = subprocess.run(cmd).returncode
    except KeyboardInterrupt:  # the point had Ctrl-C too and saved what it could
        rc = 130
    if rc == 0 and is_complete(run_dir):
        return "done"
    if rc in (130, -signal.SIGINT):
        return "interrupted"
    return f"failed (exit {rc})" if rc else "incomplete"


def compare_points(state: dict, out: Path, echo) -> None:
    """Every point with metrics compared: tables printed, plots and summary.md in out/compare."""
    from nnx_posttrain import compare

    runs = [e["run_dir"] for e in state["points"]
            if (Path(e["run_dir"]) / "metrics.jsonl").is_file()]
    if runs:
        result = compare.compare(runs, out=out / "compare", echo=echo)
        state["compare"] = {"plots": [str(p) for p in result["plots"]]}
        (out / "compare" / "summary.md").write_text(
            "## Eval metrics\n\n" + result["summary"] + "\n\n## Config differences\n\n"
            + result["config_diff"] + "\n")


def sweep(algorithm: str, grid_specs: list[str], out: str | Path | None = None,
          extra: list[str] = (), compare: bool = True, echo=None) -> dict:
    """Run (or continue) a sweep; returns the ``sweep.json`` content, whose points' statuses
    say how each ended ('interrupted': the sweep stopped there)."""
    echo = echo or (lambda msg: print(msg, flush=True))
    algorithm = algorithm_name(algorithm)
    out = Path(out) if out is not None else Path("runs") / f"sweep_{algorithm}"
    state = plan(algorithm, grid_specs, out, list(extra))
    out.mkdir(parents=True, exist_ok=True)
    previous = _previous_commands(out / "sweep.json")
    _write(out / "sweep.json", state)
    for i, entry in enumerate(state["points"], 1):
        entry["status"] = run_point(i, entry, state, out, previous, echo)
        if entry["status"] == "interrupted":
            echo(f"sweep: interrupted at point {i}/{len(state['points'])} ({entry['name']}); run "
                 "the same command again to continue it")
            break
        _write(out / "sweep.json", state)
    interrupted = any(e["status"] == "interrupted" for e in state["points"])
    if compare and not interrupted:
        compare_points(state, out, echo)
    _write(out / "sweep.json", state)
    return state


def main(argv: list[str], prog: str) -> int:
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("algorithm", help="the algorithm (sft, dpo, simpo, ...)")
    parser.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2",
                        help="config keys and their values, e.g. algo.beta=2,2.5 "
                             "optim.learning_rate=1e-4,3e-4")
    parser.add_argument("--out", default=None,
                        help="sweep directory (default: runs/sweep_<algorithm>)")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison at the end")
    args = parser.parse_args(argv)
    out = Path(args.out or Path("runs") / f"sweep_{algorithm_name(args.algorithm)}")
    state = sweep(args.algorithm, args.grid, args.out, extra, compare=not args.no_compare)
    statuses = [e["status"] for e in state["points"]]
    if "interrupted" in statuses:
        return 130
    failed = [s for s in statuses if not (s == "done" or s.startswith("skipped"))]
    print(f"sweep: {len(statuses) - len(failed)}/{len(statuses)} points complete; "
          f"{out / 'sweep.json'}", flush=True)
    if failed:
        raise errors.TrainingError(
            f"{len(failed)} of {len(statuses)} sweep points did not complete (see "
            f"{out / 'sweep.json'}); run the same command again to retry them")
    return 0
