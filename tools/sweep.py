"""Grid sweep: each point of a cartesian grid as its own run, sequentially, resumable.

    python -m tools.sweep experiments.simpo --grid algo.beta=2,2.5 algo.gamma_beta_ratio=0.3,0.5 \\
        [--out runs/sweep_simpo] [-- extra overrides passed to every point]

Each point runs ``python -m experiments.simpo --run-dir <out>/<name> --algo.beta 2
--algo.gamma-beta-ratio 0.3 <extra>`` where name is ``algo.beta=2,algo.gamma_beta_ratio=0.3``.
Every point's options are parsed by the experiment before the first point runs (a bad value or
key is refused up front). Run the same command again to continue a sweep: a point whose run is
complete (its last train record's step equals the steps in its config.json) and whose command is
the one ``sweep.json`` recorded is skipped; any other is run again, and the experiment resumes
from its latest checkpoint (refusing, as it always does, settings a resume cannot change; more
``--steps`` continue a finished point). Ctrl-C stops the sweep, not only the point it is in.
``<out>/sweep.json`` records the grid and each point's run directory, command and status; at the
end ``tools.compare`` compares every point that has metrics (tables printed, plots in
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

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*$")


class GridError(ValueError):
    pass


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


def command(module: str, run_dir: Path, point: dict[str, str], extra: list[str]) -> list[str]:
    opts = []
    for key, value in point.items():
        option = key.replace("_", "-")
        if value.lower() in ("true", "false"):  # tyro flags: --a.flag / --a.no-flag
            head, _, last = option.rpartition(".")
            prefix = head + "." if head else ""
            opts.append(f"--{option}" if value.lower() == "true" else f"--{prefix}no-{last}")
        else:
            opts += ["--" + option, value]
    return [sys.executable, "-m", module, "--run-dir", str(run_dir), *opts, *extra]


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


def check_points(module: str, entries: list[dict]) -> None:
    """Parse every point's options with the experiment's own parser (its DEFAULT / BUILTIN
    configs), before any point runs: SystemExit naming the point whose options it refuses."""
    import importlib

    mod = importlib.import_module(module)
    if not hasattr(mod, "DEFAULT"):
        return  # not one of our experiments: its own run will judge
    from nnx_posttrain import experiment

    for entry in entries:
        args = entry["command"][2:]  # after "-m module"
        try:
            experiment.parse_config(
                experiment.defaults_for(mod.DEFAULT, getattr(mod, "BUILTIN", None), args), args)
        except SystemExit as exc:
            detail = "" if isinstance(exc.code, int) else f": {exc.code}"
            raise SystemExit(f"error: sweep point {entry['name']}: {module} refuses its options"
                             f"{detail or ' (the message above)'}; nothing was run") from None


def _previous_commands(path: Path) -> dict[str, list[str]]:
    """{point name: command} of an earlier run of the sweep (``sweep.json``), {} if none."""
    try:
        return {p["name"]: p["command"] for p in json.loads(path.read_text())["points"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _module(name: str) -> str:
    return name if "." in name else f"experiments.{name}"


def _write(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


def sweep(experiment: str, grid_specs: list[str], out: str | Path | None = None,
          extra: list[str] = (), compare: bool = True, echo=None) -> dict:
    """Run (or continue) a sweep; returns the sweep.json content. SystemExit on a bad grid."""
    echo = echo or (lambda msg: print(msg, flush=True))
    try:
        grid = parse_grid(grid_specs)
    except GridError as exc:
        raise SystemExit(f"error: {exc}") from None
    extra = list(extra)
    if any(a == "--run-dir" or a.startswith("--run-dir=") or a == "--run_dir" for a in extra):
        raise SystemExit("error: --run-dir is set by the sweep for each point; give --out instead")
    module = _module(experiment)
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        raise SystemExit(f"error: no experiment module {module!r} (e.g. experiments.simpo)")
    out = Path(out) if out is not None else Path("runs") / f"sweep_{module.rsplit('.', 1)[-1]}"
    out.mkdir(parents=True, exist_ok=True)
    points = expand(grid)
    entries = []
    for p in points:
        run_dir = out / point_name(p)
        entries.append({"name": point_name(p), "params": p, "run_dir": str(run_dir),
                        "command": command(module, run_dir, p, extra)[1:], "status": "pending"})
    check_points(module, entries)
    previous = _previous_commands(out / "sweep.json")
    state = {
        "experiment": module,
        "grid": grid,
        "extra": extra,
        "points": entries,
    }
    _write(out / "sweep.json", state)
    failed = 0
    for i, entry in enumerate(state["points"], 1):
        run_dir = Path(entry["run_dir"])
        if is_complete(run_dir) and previous.get(entry["name"], entry["command"]) == entry["command"]:
            entry["status"] = "skipped (complete)"
            echo(f"[sweep {i}/{len(points)}] {entry['name']}: complete, skipped")
        else:
            cmd = [sys.executable, *entry["command"]]
            entry["status"] = "running"
            _write(out / "sweep.json", state)
            echo(f"[sweep {i}/{len(points)}] {entry['name']}: " + " ".join(cmd[1:]))
            try:
                rc = subprocess.run(cmd).returncode
            except KeyboardInterrupt:  # the point had Ctrl-C too and saved what it could
                rc = 130
            if rc == 0 and is_complete(run_dir):
                entry["status"] = "done"
            elif rc in (130, -signal.SIGINT):
                entry["status"] = "interrupted"
                _write(out / "sweep.json", state)
                echo(f"sweep: interrupted at point {i}/{len(points)} ({entry['name']}); run the "
                     "same command again to continue it")
                raise SystemExit(130)
            else:
                entry["status"] = f"failed (exit {rc})" if rc else "incomplete"
                failed += 1
        _write(out / "sweep.json", state)
    if compare:
        from tools import compare as compare_lib

        runs = [e["run_dir"] for e in state["points"] if (Path(e["run_dir"]) / "metrics.jsonl").is_file()]
        if runs:
            result = compare_lib.compare(runs, out=out / "compare", echo=echo)
            state["compare"] = {"plots": [str(p) for p in result["plots"]]}
            (out / "compare" / "summary.md").write_text(
                "## Eval metrics\n\n" + result["summary"] + "\n\n## Config differences\n\n"
                + result["config_diff"] + "\n")
            _write(out / "sweep.json", state)
    echo(f"sweep: {len(points) - failed}/{len(points)} points complete; {out / 'sweep.json'}")
    if failed:
        raise SystemExit(f"error: {failed} of {len(points)} sweep points did not complete "
                         f"(see {out / 'sweep.json'}); run the same command again to retry them")
    return state


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", help="experiments.<algorithm> (or just the algorithm name)")
    parser.add_argument("--grid", nargs="+", required=True, metavar="KEY=V1,V2",
                        help="config keys and their values, e.g. algo.beta=2,2.5 optim.learning_rate=1e-4,3e-4")
    parser.add_argument("--out", default=None, help="sweep directory (default: runs/sweep_<algorithm>)")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison at the end")
    args = parser.parse_args(argv)
    return sweep(args.experiment, args.grid, args.out, extra, compare=not args.no_compare)


if __name__ == "__main__":
    main()
