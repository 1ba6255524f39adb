"""The memory checks see the process's memory cgroup (a container, a SLURM job): a run whose
step fits the host but not its cgroup's limit is refused with the estimate, not OOM-killed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnx_posttrain.model import device_memory
from support import ROOT

GiB = 1 << 30


def _tree(tmp_path, proc_line, files):
    for name, text in files.items():
        path = tmp_path / "cg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "cgroup").write_text(proc_line + "\n")
    return tmp_path / "cg", tmp_path / "cgroup"


def test_the_tightest_enclosing_limit_less_unreclaimable_usage_counts(tmp_path):
    # cgroup v2: the job's 4 GiB limit under a parent's 3 GiB; 1 GiB used, 0.25 of it page cache
    root, proc = _tree(tmp_path, "0::/job/step", {
        "memory.max": "max\n", "memory.current": str(GiB),
        "job/memory.max": str(3 * GiB), "job/memory.current": str(GiB),
        "job/memory.stat": f"anon 1\ninactive_file {GiB // 4}\n",
        "job/step/memory.max": str(4 * GiB), "job/step/memory.current": str(GiB)})
    assert device_memory.cgroup_headroom(root, proc) == 3 * GiB - (GiB - GiB // 4)
    # cgroup v1's memory controller, "no limit" written as a huge number
    root, proc = _tree(tmp_path / "v1", "4:memory:/process_api/x\n3:cpuset:/", {
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/memory.usage_in_bytes": str(5 * GiB),
        "memory/process_api/x/memory.limit_in_bytes": str(2 * GiB),
        "memory/process_api/x/memory.usage_in_bytes": str(GiB // 2),
        "memory/process_api/x/memory.stat": "total_inactive_file 0\n"})
    assert device_memory.cgroup_headroom(root, proc) == 2 * GiB - GiB // 2
    root, proc = _tree(tmp_path / "none", "0::/", {"memory.max": "max\n",
                                                   "memory.current": "1"})
    assert device_memory.cgroup_headroom(root, proc) is None
    assert device_memory.cgroup_headroom(tmp_path / "absent", tmp_path / "absent") is None


def _memory_cgroup(limit: int):
    """A new memory cgroup limited to ``limit`` bytes (v1 or v2), or None where none can be
    made (not root, a read-only cgroup filesystem)."""
    for base, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        group = base / f"nnx_posttrain_test_{os.getpid()}"
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit))
            return group
        except OSError:
            if group.is_dir():
                group.rmdir()
    return None


@pytest.mark.slow
def test_a_step_that_fits_the_host_but_not_its_cgroup_is_refused(tmp_path):
    group = _memory_cgroup(3 * GiB)
    if group is None:
        pytest.skip("no memory cgroup can be created here (needs root and a writable cgroupfs)")
    try:  # ~5 GB of activations: the host has them, the 3 GiB cgroup does not
        out = subprocess.run(
            [sys.executable, "-m", "experiments.sft", "--run-dir", str(tmp_path / "run"),
             "--model", "gemma_tiny", "--steps", "2", "--batching.batch-size", "64",
             "--batching.max-length", "512", "--eval.every", "0"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        group.rmdir()
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])  # not 137: the OOM killer
    assert "a training step needs an estimated" in out.stderr and "free on cpu" in out.stderr
