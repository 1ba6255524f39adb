"""Orbax checkpoints and exact resume, with real subprocesses (exit, SIGTERM, SIGKILL)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nnx_posttrain  # noqa: F401
import jax
import numpy as np
import pytest

from nnx_posttrain import checkpoint, runs
from nnx_posttrain import errors
from support import MICRO, experiment_command, records, refusal, run_command, train_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


ARGS = ["--log-every", "1", "--checkpoint.every", "3", "--eval.every", "0", "--eval.batches", "1",
        "--eval.exact-match", "0", "--batching.batch-size", "4", "--optim.learning-rate", "1e-2",
        "--optim.schedule", "constant"]


def _cmd(run_dir, steps=STEPS, *extra):
    return experiment_command("sft", run_dir, "--steps", str(steps), *ARGS, *extra)


def _run(run_dir, steps=STEPS, *extra) -> str:
    """The run, in this process (the kills below need their own processes; a resume does not);
    returns what it printed."""
    said = []
    train_run("sft", *MICRO, "--run-dir", run_dir, "--steps", steps, *ARGS, *extra,
              echo=said.append)
    return "\n".join(said)


def _start(run_dir, *extra):
    return subprocess.Popen(_cmd(run_dir, STEPS, *extra), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_step(run_dir, step, proc, timeout=300):
    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and any(r["step"] >= step for r in records(run_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("timed out")


def _losses(run_dir):  # with TRL's num_tokens, which a resumed run takes on from its checkpoint
    return [(r["step"], r["loss"], r["num_tokens"]) for r in records(run_dir)]


def _final_params(run_dir):
    loaded = runs.load(run_dir)
    assert loaded.step == STEPS
    return {k: np.asarray(v) for k, v in runs.param_leaves(loaded.state).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _run(run_dir)
    return run_dir, _losses(run_dir), _final_params(run_dir)


def _assert_same_run(run_dir, reference):
    _, ref_losses, ref_params = reference
    assert _losses(run_dir) == ref_losses  # every step once, bitwise-equal losses
    params = _final_params(run_dir)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(value, ref_params[name], err_msg=name)


@pytest.mark.slow
def test_reference_run_keeps_the_last_checkpoints(reference):
    run_dir, losses, _ = reference
    assert [s for s, *_ in losses] == list(range(1, STEPS + 1))
    tokens = [n for *_, n in losses]
    assert all(0 < a < b for a, b in zip(tokens, tokens[1:]))  # every step's tokens, summed
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [6, 9, 12]  # keep 3, every 3 steps, always the last


@pytest.mark.slow
def test_exit_then_resume_equals_the_uninterrupted_run(reference, tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, STEPS // 2)
    assert [s for s, *_ in _losses(run_dir)][-1] == STEPS // 2
    out = _run(run_dir)  # checkpoints present: resumes automatically
    assert "resumed from" in out
    # a built-in tiny model's run takes every block from the heap (test_host_memory)
    assert "host allocator: every block from the heap" in out
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_sigterm_saves_exits_cleanly_and_resumes_exactly(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_step(run_dir, 4, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "SIGTERM: saved checkpoint at step" in stdout + stderr
    assert "Traceback" not in stderr
    stopped = _losses(run_dir)[-1][0]
    assert stopped < STEPS
    assert stopped in [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    _run(run_dir, STEPS, "--resume")
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_step_then_resume_is_exact(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_step(run_dir, 7, proc)  # after the checkpoint at 6, before 12
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    killed_at = _losses(run_dir)[-1][0]
    assert 7 <= killed_at
    _run(run_dir)
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_an_interrupted_checkpoint_is_never_picked_up(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    ckpts = run_dir / "checkpoints"
    partial = ckpts / "15.orbax-checkpoint-tmp-1795960000000000"  # what a killed save leaves
    shutil.copytree(ckpts / "12", partial)
    (partial / "state" / "manifest.ocdbt").write_bytes(b"truncated")
    assert runs.load(run_dir).step == 12


@pytest.mark.slow
def test_a_log_interval_cut_by_a_crash_averages_the_same_steps_after_the_resume(tmp_path):
    """Logged every 4 steps (each record the mean of its 4 steps, as TRL's), checkpointed every
    3: the checkpoint at step 9 holds step 9's metrics, so a run that crashed after it and
    resumed logs at step 12 the same mean of steps 9-12 as the uninterrupted run."""
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    _run(reference, STEPS, "--log-every", "4")
    untimed = [{k: v for k, v in r.items() if k not in ("tokens_per_second", "compile_seconds")}
               for r in records(reference)]
    assert [r["step"] for r in untimed] == [4, 8, 12]
    shutil.copytree(reference, crashed)
    shutil.rmtree(crashed / "checkpoints" / "12")  # as if killed between steps 9 and 12
    out = _run(crashed, STEPS, "--log-every", "4")
    assert "(step 9)" in out
    assert [{k: v for k, v in r.items() if k not in ("tokens_per_second", "compile_seconds")}
            for r in records(crashed)] == untimed


@pytest.mark.slow
def test_resume_without_a_checkpoint_fails_clearly(tmp_path):
    proc = run_command(_cmd(tmp_path / "run", STEPS, "--resume"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error: --resume: no complete checkpoint in" in proc.stderr


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    message = refusal("sft", *MICRO, "--run-dir", run_dir, "--steps", STEPS + 2, *ARGS,
                      "--lora.rank", "4", error=errors.CheckpointError)
    assert "different model configuration" in message
    assert "lora: checkpoint has" in message and "'rank': 4" in message


@pytest.mark.slow
def test_restore_in_another_process_for_inspection_and_on_another_device_count(tmp_path):
    """Trained on 2 devices in a process of its own; read back for inspection in this process,
    which has one device and never saw the run."""
    import jax.numpy as jnp

    from nnx_posttrain import model

    run_dir = tmp_path / "run2dev"
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=2")
    cmd = _cmd(run_dir, 3, "--mesh.data", "2")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh: data 2 x fsdp 1 x tensor 1" in out.stdout, out.stdout
    r = runs.load(run_dir)
    ids = jnp.array([[2, 5, 6, 7]])
    lp = model.token_logprobs(r.module, ids, jnp.ones_like(ids))
    devices = len(next(iter(runs.param_leaves(r.state).values())).devices())
    assert r.step == 3 and devices == 1 and np.isfinite(float(lp.sum()))


def test_keep_latest_plus_the_best_by_an_eval_metric(tmp_path):
    from nnx_posttrain import config

    cfg = config.CheckpointConfig(keep=2, keep_best="exact_match", best_mode="max", async_save=False)
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", cfg)
    state = {"params": {"w": np.arange(3.0, dtype=np.float32)}, "step": np.int32(0)}
    record = {"model_record": {"variables": checkpoint.shapes(state)}}
    scores = {1: 0.2, 2: 0.9, 3: None, 4: 0.5, 5: None, 6: 0.1}
    for step, score in scores.items():
        ckpt.save(step, state, {"i": step}, record, metrics=None if score is None else {"exact_match": score})
    ckpt.close()
    kept = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert kept == [2, 5, 6]  # the best (0.9 at step 2) and the latest two


@pytest.mark.slow
def test_lora_checkpoints_hold_only_the_adapters(tmp_path):
    from nnx_posttrain import config

    run_dir = tmp_path / "lora"
    _run(run_dir, 2, "--lora.rank", "2", "--lora.targets", "qv")
    loaded = runs.load(run_dir)
    names = sorted(runs.param_leaves(loaded.state))
    assert names[0] == "decoder_block_0/attention/query/lora_kernel_a"
    assert len(names) == 8 and all(n.endswith(("lora_kernel_a", "lora_kernel_b")) for n in names)
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", config.CheckpointConfig(async_save=False))
    saved = ckpt.read_record(2)["model_record"]
    ckpt.close()
    assert saved["model"] == "gemma_micro" and saved["lora"]["rank"] == 2  # the base to rebuild
    assert sorted(saved["variables"]) == names


def _small_state():
    import jax.numpy as jnp

    return {"params": {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones((4,), jnp.bfloat16)},
            "step": jnp.asarray(7, jnp.int32)}


def test_an_async_save_holds_a_device_copy_until_the_next_step_is_dispatched(tmp_path,
                                                                              monkeypatch):
    """A small state's save returns without calling Orbax (the transfer to the host would
    delay the next step); ``write_held`` hands it over, and the values written are those the
    state had when saved, though the step that followed donated (here: deleted) the originals.
    Any other use of the checkpointer writes a held save first, in order."""
    from nnx_posttrain import config as config_lib

    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", config_lib.CheckpointConfig())
    calls = []
    orbax_save = ckpt._manager.save
    monkeypatch.setattr(ckpt._manager, "save",
                        lambda step, **kw: (calls.append(step), orbax_save(step, **kw))[1])
    state = _small_state()
    expected = {k: np.asarray(v) for k, v in state["params"].items()}
    ckpt.save(3, state, {"pos": 1}, {"step": 3})
    assert calls == []  # held: Orbax not called yet
    for leaf in (state["params"]["w"], state["params"]["b"], state["step"]):
        leaf.delete()  # what the next step's donation does to the original buffers
    ckpt.write_held()
    assert calls == [3]
    ckpt.write_held()  # nothing held: nothing written again
    ckpt.save(4, _small_state(), {}, {"step": 4})
    ckpt.save(5, _small_state(), {}, {"step": 5})  # the held save of step 4 goes first
    assert calls == [3, 4]
    assert ckpt.all_steps() == [3, 4, 5] and calls == [3, 4, 5]  # a use writes what is held
    restored = ckpt.manager.restore(3)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(restored.state["params"][name]), value)
    assert int(restored.state["step"]) == 7 and restored.data == {"pos": 1}
    ckpt.close()


def test_a_failed_held_save_is_raised_at_the_next_use_and_close_still_closes(tmp_path,
                                                                             monkeypatch):
    """An error of a held save is not lost: the next use of the checkpointer (here the wait at
    the end) raises it; closing after it still closes Orbax's manager."""
    from nnx_posttrain import config as config_lib

    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", config_lib.CheckpointConfig())

    def failing_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt._manager, "save", failing_save)
    ckpt.save(1, _small_state(), {}, {"step": 1})
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.wait()
    closed = []
    monkeypatch.setattr(ckpt._manager, "close", lambda: closed.append(True))
    ckpt.save(2, _small_state(), {}, {"step": 2})
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.close()
    assert closed == [True]


def test_a_held_save_reads_its_record_when_handed_over_and_a_refusal_drops_it(tmp_path):
    """A record given as a function is read when the held save goes to Orbax (the loop's reads
    the step's non-finite flag then, the next step running); an exception it raises drops that
    save (nothing written) and the checkpointer goes on."""
    from nnx_posttrain import config as config_lib

    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", config_lib.CheckpointConfig())
    ckpt.prepare(_small_state())  # the copy compiled ahead (the loop: during its first step)
    compiled, read = [], []

    def heard(event, duration, **_):
        compiled.extend([event] * ("backend_compile" in event))

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        ckpt.save(1, _small_state(), {}, lambda: read.append(1) or {"step": 1})
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    assert compiled == []  # the save's copy was compiled by prepare
    assert read == []  # held: not read yet
    ckpt.write_held()
    assert read == [1]

    def refused():
        raise ValueError("step 2: non-finite loss")

    ckpt.save(2, _small_state(), {}, refused)
    with pytest.raises(ValueError, match="step 2: non-finite"):
        ckpt.write_held()
    ckpt.save(3, _small_state(), {}, {"step": 3})
    assert ckpt.all_steps() == [1, 3] and ckpt.read_record(3) == {"step": 3}
    ckpt.close()


def test_a_state_whose_copy_does_not_fit_is_saved_in_the_call(tmp_path, monkeypatch):
    """Where a copy would take over a quarter of the free memory, Orbax's save runs in the
    call itself (nothing held)."""
    from nnx_posttrain import config as config_lib
    from nnx_posttrain.model import device_memory

    monkeypatch.setattr(device_memory, "available_bytes", lambda: 100)  # 100 bytes free
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", config_lib.CheckpointConfig())
    ckpt.save(2, _small_state(), {}, {"step": 2})
    assert ckpt._held is None
    ckpt.wait()
    assert ckpt.all_steps() == [2]
    ckpt.close()
