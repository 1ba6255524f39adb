"""Multi-host training without a cluster: two local processes (loopback coordinator, gloo CPU
collectives) train on a 2-process mesh and save a sharded Orbax checkpoint; one process resumes it
and continues with the losses of an uninterrupted one-process run."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import nnx_posttrain  # noqa: F401
import numpy as np
import pytest

from support import MICRO, losses as _losses, session_xla_flags, train_run

ROOT = Path(__file__).resolve().parents[1]


def _args(data, run_dir, steps):
    return [
        *MICRO, "--data", str(data), "--run-dir", str(run_dir),
        "--steps", str(steps), "--log-every", "1", "--checkpoint.every", "3",
        "--checkpoint.no-async-save", "--batching.batch-size", "4", "--batching.grad-accum", "1",
        "--optim.learning-rate", "1e-2", "--optim.warmup-steps", "0", "--optim.schedule", "constant",
    ]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sft(args):
    return train_run("sft", *args, recipe=False)


@pytest.mark.slow
def test_two_processes_train_and_save_one_process_resumes(tmp_path):
    data = tmp_path / "sums.jsonl"  # a small file: no eval split, quick validation
    rng = np.random.default_rng(0)
    with data.open("w") as f:
        for a, b in rng.integers(0, 50, size=(64, 2)):
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "completion": str(a + b)}) + "\n")
    run_dir, reference = tmp_path / "multi", tmp_path / "reference"

    port = _free_port()
    t0 = time.perf_counter()
    procs = []
    for pid in range(2):
        env = dict(os.environ, XLA_FLAGS=" ".join(session_xla_flags()))
        cmd = [sys.executable, "-m", "experiments.sft", *_args(data, run_dir, 3),
               "--mesh.coordinator-address", f"127.0.0.1:{port}", "--mesh.num-processes", "2",
               "--mesh.process-id", str(pid)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    two_process_seconds = time.perf_counter() - t0
    assert "2 process(es)" not in outs[0][1]  # no mesh error
    assert (run_dir / "checkpoints" / "3").is_dir()
    two = _losses(run_dir)
    assert sorted(two) == [1, 2, 3]  # process 0 alone writes the metrics, each step once

    _sft(_args(data, run_dir, 6))  # this process: one device; resumes the 2-process checkpoint
    _sft(_args(data, reference, 6))  # uninterrupted, one process
    resumed, ref = _losses(run_dir), _losses(reference)
    print(f"2-process part {two_process_seconds:.1f}s; losses 2-process+resume {resumed}, "
          f"1 process {ref}")
    assert sorted(resumed) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([resumed[s] for s in range(1, 7)], [ref[s] for s in range(1, 7)],
                               rtol=2e-5)
    assert ref[6] != ref[3]  # it trained after the resume
