"""The TPU tier: what only a TPU can show, run where one is present.

    pip install -e ".[tpu,test]" && python -m pytest -m tpu          # on a Cloud TPU VM

Skipped unless selected with ``-m tpu`` (CI and the README's command run on CPUs), and skipped
with a note where no TPU answers. The suite's own process stays on the CPU (tests/conftest.py
pins it); each check runs in a process of its own on the chip, one at a time (one process at a
time may hold a TPU): the default run, SIGTERM and resume, and ``tests/tpu_checks.py`` (splash
attention against the ``xla`` formulation, the sampler's greedy tokens against the CPU's, a
bfloat16 step's loss against float32's).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from nnx_posttrain import runs
from support import MICRO, ROOT, records
from tools import seeds

pytestmark = pytest.mark.tpu

CHECKS = ROOT / "tests" / "tpu_checks.py"


def on_chip_env() -> dict:
    """This environment without the CPU pin and the CPU-only compiler flags of tests/conftest.py."""
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    cpu_only = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in cpu_only)
    return env


def on_chip(cmd: list, timeout: int = 1200, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, env=on_chip_env(), capture_output=True, text=True,
                         timeout=timeout, **kwargs)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="session")
def tpu():
    """The TPU's device kind, or a skip where JAX finds none."""
    probe = subprocess.run([sys.executable, "-c", "import jax; d = jax.devices()[0]; "
                            "print(d.platform, d.device_kind, sep='|')"],
                           env=on_chip_env(), capture_output=True, text=True, timeout=300)
    platform, _, kind = probe.stdout.strip().rpartition("\n")[-1].partition("|")
    if platform != "tpu":
        pytest.skip(f"no TPU here (JAX's first device: {platform or probe.stderr[-200:]})")
    return kind


@pytest.fixture(scope="session")
def chip_checks(tpu, tmp_path_factory):
    """tests/tpu_checks.py's results on the chip."""
    path = tmp_path_factory.mktemp("tpu") / "checks.json"
    on_chip([sys.executable, str(CHECKS), str(path)])
    return json.loads(path.read_text())


def test_the_default_run_lands_in_the_stated_range_on_the_chip(tpu, tmp_path):
    result = json.loads((ROOT / "results" / "default_run.json").read_text())
    low, high = result["data"]["range"]
    on_chip([sys.executable, "-m", "experiments.sft", "--run-dir", str(tmp_path / "sft"),
             "--eval.every", "0", "--checkpoint.every", "0"])
    final = seeds.evals(tmp_path / "sft")[-1]
    assert low <= final["exact_match"] <= high, (final, (low, high))


ARGS = [*MICRO, "--steps", "12", "--log-every", "1", "--checkpoint.every", "3", "--eval.every",
        "0", "--eval.batches", "1", "--eval.exact-match", "0", "--batching.batch-size", "4",
        "--optim.learning-rate", "1e-2", "--optim.schedule", "constant"]


def _sft(run_dir, *extra):
    return [sys.executable, "-m", "experiments.sft", *ARGS, "--run-dir", str(run_dir), *extra]


def _losses_and_weights(run_dir):
    loaded = runs.load(run_dir)
    weights = {k: np.asarray(v) for k, v in runs.param_leaves(loaded.state).items()}
    return [(r["step"], r["loss"]) for r in records(run_dir)], loaded.step, weights


def test_sigterm_then_resume_equals_the_uninterrupted_run_on_the_chip(tpu, tmp_path):
    on_chip(_sft(tmp_path / "whole"))
    proc = subprocess.Popen(_sft(tmp_path / "cut"), cwd=ROOT, env=on_chip_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not any(r["step"] >= 4 for r in _records_so_far(tmp_path / "cut")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM: saved checkpoint at step" in out + err
    on_chip(_sft(tmp_path / "cut", "--resume"))
    whole, cut = (_losses_and_weights(tmp_path / n) for n in ("whole", "cut"))
    assert cut[0] == whole[0] and cut[1] == whole[1] == 12  # every step once, bitwise losses
    for name, value in whole[2].items():
        np.testing.assert_array_equal(cut[2][name], value, err_msg=name)


def _records_so_far(run_dir):
    return records(run_dir) if (run_dir / "metrics.jsonl").exists() else []


@pytest.mark.parametrize("case", ["causal", "packed", "window", "packed_window_softcap"])
def test_splash_attention_on_the_chip_equals_the_reference_attention(chip_checks, case):
    """Values and gradients of the compiled Pallas kernel against the xla formulation (float32
    inputs at the highest matmul precision; the kernel's own arithmetic sets the tolerance)."""
    got = chip_checks["splash"][case]
    assert got["values"] < 2e-3 and got["grads"] < 2e-3, got


def test_the_samplers_greedy_tokens_on_the_chip_equal_the_cpus(chip_checks, tmp_path):
    path = tmp_path / "cpu.json"
    env = dict(on_chip_env(), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(CHECKS), str(path), "--only", "sampler"], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=600)
    assert chip_checks["sampler"]["tokens"] == json.loads(path.read_text())["sampler"]["tokens"]


def test_a_bfloat16_steps_loss_is_within_tolerance_of_float32s(chip_checks):
    losses = chip_checks["bf16_step"]["losses"]
    assert chip_checks["bf16_step"]["platform"] == "tpu"
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.02), losses
