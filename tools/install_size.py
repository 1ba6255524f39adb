"""Environment size and install time of the README's install against a plain pip resolution of
keras-hub (which pulls tensorflow-text, hence TensorFlow), each in a fresh virtual environment.

    python -m tools.install_size [--root /work/venvs] [--keep]

Writes results/install.json (rendered into the README by ``python -m tools.results``). Each
variant: ``python3 -m venv`` and a pip upgrade (as ``.ci/run``), then its install command from this checkout with pip's cache off
(``PIP_NO_CACHE_DIR=1``: every wheel fetched again), timed; the size is every file of the
environment (``du``-style, bytes on disk of regular files).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools import ToolError, exit_status, results as readme

ROOT = Path(__file__).resolve().parents[1]
KERAS_HUB = '"keras-hub>=0.32,<0.33"'
VARIANTS = {
    "README install (keras-hub --no-deps)": f"pip install -e . && pip install --no-deps {KERAS_HUB}",
    "plain pip resolution of keras-hub (as before)": 'pip install -e ".[keras-hub-tf]"',
}
PROBE = ("import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m "
         "in ('tensorflow', 'tensorflow_text', 'keras_hub', 'jax')}))")


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            p = Path(dirpath) / name
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def measure(name: str, command: str, venv: Path) -> dict:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, PIP_NO_CACHE_DIR="1", VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--upgrade", "pip"], env=env,
                   check=True)  # as .ci/run does, not timed
    cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))
    start, cpu_start = time.perf_counter(), cpu()
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds, cpu_seconds = time.perf_counter() - start, cpu() - cpu_start
    if out.returncode:
        raise ToolError(f"{name}: {command} failed:\n{out.stderr[-3000:]}")
    probe = json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], env=env,
                                      capture_output=True, text=True, check=True).stdout)
    packages = len(json.loads(subprocess.run(
        [str(venv / "bin" / "pip"), "list", "--format", "json"], env=env, capture_output=True,
        text=True, check=True).stdout))
    return {"variant": name, "command": command, "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu_seconds, 1), "load_before": os.getloadavg()[0],
            "bytes": _size(venv), "packages": packages, **probe}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="/work/venvs", help="where the fresh environments go")
    parser.add_argument("--keep", action="store_true", help="keep the environments")
    args = parser.parse_args(argv)
    results = []
    for i, (name, install) in enumerate(VARIANTS.items()):
        venv = Path(args.root) / f"install_size_{i}"
        results.append(measure(name, install, venv))
        print(json.dumps(results[-1]))
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
    rows = [[r["variant"], f"`{r['command']}`", f"{r['bytes'] / 1e9:.2f} GB", str(r["packages"]),
             f"{r['seconds']:.0f} s", f"{r['cpu_seconds']:.0f} s",
             "yes" if r["tensorflow"] else "no"] for r in results]
    readme.record("install", "python -m tools.install_size",
                  ["install", "command (in a fresh venv)", "environment size", "packages",
                   "install time (wall)", "install CPU time", "TensorFlow installed"], rows,
                  notes=["One measurement each, pip's cache off (every wheel downloaded or read "
                         "from the local package mirror again), one after the other on a machine "
                         "shared with other jobs: the sizes are exact, the times indicative (the "
                         "CPU time, pip's own work, is less sensitive to the load than the wall "
                         "time)."],
                  data={"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
