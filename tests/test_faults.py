"""Fault injection (issue 18): a run is never lost, two runs never mix, garbage never trains in
silence. Each case reproduces a fault a user met and checks the fix: non-finite steps, changed
settings on resume, config.json and metrics.jsonl kept, the run-directory lock, records with no
loss token, damaged checkpoints, bad data, settings refused up front, Ctrl-C twice, and
--eval-only without optimizer state. In-process runs where they suffice (micro model, 4 steps),
real subprocesses where a process must die or compete."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nnx_posttrain  # noqa: F401
import numpy as np
import pytest

from nnx_posttrain import api, checkpoint, cli, config, data, errors, metrics_log, runs
from nnx_posttrain.algorithms import DPO, SFT, registry
from nnx_posttrain.cli.train_command import parse
from nnx_posttrain.train import hooks, resume, rundir
from support import FAST_STEPS, MICRO, ROOT, builtin_file, cli_error, records, train_run

FAST = [*MICRO, *FAST_STEPS]


def sft(run_dir, *extra):
    return train_run("sft", *FAST, "--run-dir", run_dir, *extra)


def dpo(run_dir, *extra):
    return train_run("dpo", *FAST, "--run-dir", run_dir, "--init-from", "", *extra)


def refusal(fn, *args) -> str:
    """The message of the ``UserError`` that ``fn(*args)`` raises (it must raise one)."""
    with pytest.raises(errors.UserError) as info:
        fn(*args)
    return str(info.value)


def steps_of(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())


def jsonl(path, rows) -> Path:
    with open(path, "wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else (json.dumps(row) + "\n").encode())
    return Path(path)


def pc(i):
    return {"prompt": f"What is {i} + 1?", "completion": str(i + 1)}


@pytest.fixture(scope="module")
def finished(shared_run):
    """A finished 4-step SFT run: checkpoints 2 and 4 (the session's shared one: copy it)."""
    run = shared_run("sft")
    assert steps_of(run) == [2, 4]
    return run


@pytest.fixture
def copy(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def _files(run):
    return {name: (run / name).read_text() for name in ("config.json", "metrics.jsonl")}


# ----------------------------------------------------------------------------- 1. non-finite


@pytest.mark.parametrize("args, option", [
    (["--optim.learning-rate", "nan"], "--optim.learning-rate"),
    (["--optim.learning-rate", "inf"], "--optim.learning-rate"),
    (["--optim.b1", "nan"], "--optim.b1"),
    (["--lora.alpha", "inf"], "--lora.alpha"),
    (["--algo.beta", "nan"], "--algo.beta"),
])
def test_non_finite_option_values_are_refused_up_front(args, option):
    with pytest.raises(errors.ConfigError) as info:
        parse(api.config_type(DPO)(), args=args)
    assert f"{option} must be a finite number" in str(info.value)


@pytest.mark.slow
def test_non_finite_training_stops_naming_the_step_and_keeps_only_good_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    msg = refusal(sft, run, "--optim.learning-rate", "1e30", "--optim.max-grad-norm", "0",
                  "--optim.schedule", "constant", "--steps", "12")
    assert "non-finite" in msg and "the update was not applied and training stopped" in msg
    bad_step = int(msg.split("step ")[1].split(":")[0])
    kept = steps_of(run)
    assert all(s < bad_step for s in kept)  # nothing written after the bad step
    for step in kept:  # and every kept checkpoint is finite
        leaves = runs.param_leaves(runs.load(run, step=step).state).values()
        assert all(np.isfinite(np.asarray(v)).all() for v in leaves), step
    assert f"steps {', '.join(map(str, kept))}" in msg


@pytest.mark.slow
def test_a_non_finite_last_step_is_not_saved(tmp_path):
    """The last step's flag is read before its save (by the end's evaluation): a non-finite
    last step leaves the checkpoints before it, none of its own."""
    run = tmp_path / "run"  # step 1's update of 1e30 makes step 2's loss non-finite
    data = builtin_file(tmp_path / "train.jsonl")  # no held-out split: no evaluation at the end
    msg = refusal(sft, run, "--data", data, "--optim.learning-rate", "1e30", "--optim.max-grad-norm", "0",
                  "--optim.schedule", "constant", "--optim.warmup-steps", "0", "--steps", "2",
                  "--checkpoint.every", "1")
    assert "step 2: non-finite" in msg and "kept in" in msg and "steps 1." in msg, msg
    assert steps_of(run) == [1]


@pytest.mark.slow
def test_skip_mode_goes_on_but_not_forever(tmp_path):
    msg = refusal(sft, tmp_path / "run", "--optim.learning-rate", "1e30", "--optim.max-grad-norm",
                  "0", "--optim.schedule", "constant", "--steps", "20", "--optim.on-nonfinite",
                  "skip")
    assert "10 non-finite steps in a row" in msg
    train = records(tmp_path / "run")
    assert train[-1]["skipped_steps"] >= 9


def test_guard_reads_each_flag_one_step_late_and_skip_counts():
    said = []
    guard = hooks.NonFiniteGuard("skip", said.append, patience=3)
    ok, bad = {"nonfinite": 0}, {"nonfinite": 1, "loss": float("nan"), "grad_norm": 1.0}
    guard.push(1, ok)
    guard.push(2, bad)
    assert guard.skipped == 0  # step 2 is still running: read when step 3 is pushed
    guard.push(3, ok)
    assert guard.skipped == 1 and "step 2: non-finite loss (loss nan, gradient norm 1)" in said[0]
    guard.flush()
    stop = hooks.NonFiniteGuard("stop", said.append)
    stop.push(7, bad)
    with pytest.raises(hooks.NonFiniteStep, match=r"step 7: non-finite loss \(loss nan"):
        stop.flush()


@pytest.mark.slow
def test_a_non_finite_step_changes_neither_weights_nor_optimizer_state(micro):
    import jax
    import jax.numpy as jnp

    from nnx_posttrain import model, train

    graphdef, params, frozen = model.split(micro.module)
    tx, lr = train.optimizer(config.OptimConfig(learning_rate=1e-2, warmup_ratio=0.0), 10)
    algo = SFT(SFT.Config(), logprob_chunk=8)

    def loss(module, batch, reference):  # scaled by the batch's "scale": NaN poisons it
        total, weight, metrics = algo.loss(module, batch, reference)
        return total * batch["scale"][0], weight, metrics

    step = jax.jit(train.make_train_step(graphdef, loss, tx, lr))
    ids = jnp.arange(2 * 8, dtype=jnp.int32).reshape(1, 2, 8) % 50 + 3
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids),
             "loss_mask": jnp.ones(ids.shape, jnp.float32)}
    state = train.init_state(params, tx, seed=0)
    state, m = step(state, {"model": frozen, "reference": None}, dict(batch, scale=jnp.ones((1, 2))))
    assert int(m["nonfinite"]) == 0
    before = jax.tree.map(np.asarray, state)
    state, m = step(state, {"model": frozen, "reference": None},
                    dict(batch, scale=jnp.full((1, 2), jnp.nan)))
    assert int(m["nonfinite"]) == 1 and int(state["step"]) == 2
    for a, b in zip(jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"]),
                    jax.tree.leaves(state["params"]) + jax.tree.leaves(state["opt_state"])):
        np.testing.assert_array_equal(a, np.asarray(b))


# ----------------------------------------------------------------------------- 2, 3. the record


def test_every_setting_of_every_algorithm_is_classified_for_resume():
    for name in registry.names():
        cfg = api.config_type(registry.get(name))()
        for key in resume.flatten(config.to_dict(cfg)):
            assert "not classified" not in resume.classify(key)[1], (name, key)


def test_another_algorithm_cannot_resume_a_run(copy):
    before = _files(copy)
    msg = refusal(dpo, copy, "--steps", "6")
    assert "algorithm: 'sft' -> 'dpo' (refused" in msg
    assert _files(copy) == before and steps_of(copy) == [2, 4]


def test_changed_settings_are_refused_with_the_list_of_differences(copy):
    before = _files(copy)
    msg = refusal(sft, copy, "--steps", "6", "--optim.learning-rate", "1e-2",
                  "--batching.batch-size", "8", "--seed", "3")
    assert "optim.learning_rate: 0.001 -> 0.01 (allowed with --resume-changed optim.learning_rate)" in msg
    assert "batching.batch_size: 4 -> 8 (refused: the saved data position counts batches" in msg
    assert "seed: 0 -> 3 (refused" in msg
    assert not any(line.strip().startswith("steps:") for line in msg.splitlines())  # announced
    assert _files(copy) == before and steps_of(copy) == [2, 4]  # nothing written


def test_a_directory_that_is_not_a_run_is_named_not_a_traceback(tmp_path, capsys):
    """An exported model's directory (its config.json is Hugging Face's) or a cut config.json
    given where a run belongs: runs.load, --init-from, nnx-posttrain export say what it is."""
    hf, cut = tmp_path / "hf", tmp_path / "cut"
    hf.mkdir(), cut.mkdir()
    (hf / "config.json").write_text('{"architectures": ["GemmaForCausalLM"]}')
    (cut / "config.json").write_text('{"model": "gemma_micro", "dty')
    with pytest.raises(runs.NotARunError, match=r"not a run's config.json \(no 'model', 'lora'\)"):
        runs.load(hf)
    with pytest.raises(runs.NotARunError, match=r"config.json: not JSON \(Unterminated string"):
        runs.load(cut)
    with pytest.raises(errors.CheckpointError, match="--init-from .*an exported model loads "
                                                     "with --model DIR"):
        runs.check_init_from(hf, "gemma_micro")
    cli_error(capsys, ["export", str(cut), "--to", str(tmp_path / "out")],
              match=r"error: .*cut/config.json: not JSON")
    # a run's checkpoint given for the run
    step = tmp_path / "run" / "checkpoints" / "40"
    step.mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text('{"model": "gemma_micro", "lora": {}}')
    with pytest.raises(runs.NotARunError, match=f"{step}: a checkpoint, not a run directory: give "
                                                f"the run, {tmp_path / 'run'}"):
        runs.load(step)
    with pytest.raises(errors.CheckpointError, match="a checkpoint, not a run directory"):
        runs.check_init_from(step, "gemma_micro")


@pytest.mark.slow
def test_reading_a_run_whose_checkpoint_rotation_removes_the_latest_meanwhile(copy, monkeypatch):
    """sample / export / runs.load on a run that is still training: its rotation
    can remove the checkpoint picked while the model is built (seconds to minutes). The latest
    is picked again after the build; an explicit --step that is gone is named as removed."""
    build = runs.build_model

    def build_while_rotating(*args, **kwargs):
        out = build(*args, **kwargs)
        if (copy / "checkpoints" / "4").exists():
            shutil.rmtree(copy / "checkpoints" / "4")  # as the live run's --checkpoint.keep
        return out

    monkeypatch.setattr(runs, "build_model", build_while_rotating)
    assert runs.load(copy).step == 2
    shutil.copytree(copy / "checkpoints" / "2", copy / "checkpoints" / "4")
    real_restore = checkpoint.Checkpointer.restore_weights

    def removed_while_read(self, step, *args):
        shutil.rmtree(copy / "checkpoints" / str(step))
        return real_restore(self, step, *args)

    monkeypatch.setattr(checkpoint.Checkpointer, "restore_weights", removed_while_read)
    with pytest.raises(FileNotFoundError, match="checkpoint 2 was removed while it was read .a "
                                                "run still training there keeps only its last "
                                                "--checkpoint.keep checkpoints.; read it again "
                                                "with a later --step"):
        runs.load(copy, step=2)


@pytest.mark.slow
def test_a_resume_keeps_the_init_from_checkpoint_it_started_from(finished, tmp_path, capsys):
    """The --init-from run trains on after a DPO run started from it: the resumed DPO run still
    starts (and takes its reference model) from the checkpoint it began with, and equals a run
    that was never interrupted; a resume whose starting checkpoint is gone is refused. The
    starting run is the session's finished one, first without its step 4 (its latest is 2),
    then with it back (the run has moved on), not two SFT runs of its own."""
    base, control, resumed = tmp_path / "base", tmp_path / "control", tmp_path / "resumed"
    shutil.copytree(finished, base)
    shutil.rmtree(base / "checkpoints" / "4")
    assert steps_of(base) == [2]
    dpo(control, "--init-from", str(base), "--steps", "4")
    dpo(resumed, "--init-from", str(base), "--steps", "2")
    shutil.copytree(finished / "checkpoints" / "4", base / "checkpoints" / "4")
    assert steps_of(base) == [2, 4]  # the starting run moved on: its latest is step 4 now
    capsys.readouterr()
    dpo(resumed, "--init-from", str(base), "--steps", "4")
    assert f"initialised from {base} (step 2," in capsys.readouterr().out

    def last(run_dir):
        return [r for r in metrics_log.read(run_dir) if "loss" in r and "time" not in r][-1]

    assert last(resumed) == last(control) and last(resumed)["step"] == 4
    shutil.rmtree(base / "checkpoints" / "2")
    msg = refusal(dpo, resumed, "--init-from", str(base), "--steps", "6")
    assert "this run started from its checkpoint at step 2, which is gone (it has [4])" in msg


@pytest.mark.slow
def test_named_changes_are_accepted_and_recorded(copy, capsys):
    sft(copy, "--steps", "6", "--optim.learning-rate", "1e-2", "--resume-changed",
        "optim.learning-rate")
    out = capsys.readouterr().out
    assert "changed: optim.learning_rate: 0.001 -> 0.01" in out and "changed: steps: 4 -> 6" in out
    history = [json.loads(line) for line in (copy / "history.jsonl").read_text().splitlines()]
    assert [h["event"] for h in history] == ["start", "resume"]
    assert history[-1]["changed"] == {"optim.learning_rate": [0.001, 0.01], "steps": [4, 6]}
    assert json.loads((copy / "config.json").read_text())["optim"]["learning_rate"] == 0.01
    assert steps_of(copy)[-1] == 6 and [r["step"] for r in records(copy)] == list(range(1, 7))


def test_resume_changed_names_only_settings_a_resume_may_change():
    assert resume.allowed_keys("--optim.learning-rate, optim.weight_decay") == {
        "optim.learning_rate", "optim.weight_decay"}
    with pytest.raises(errors.ConfigError, match="nonsense: not a setting"):
        resume.allowed_keys("nonsense")
    with pytest.raises(errors.ConfigError, match=r"optim.lr: not a setting \(did you mean "
                                         r"optim.learning_rate\?\)"):
        resume.allowed_keys("optim.lr")
    with pytest.raises(errors.ConfigError, match="batching.batch_size: a resume cannot change it"):
        resume.allowed_keys("batching.batch-size")
    with pytest.raises(errors.ConfigError, match="algo.beta: a resume cannot change it"):
        resume.allowed_keys("algo.beta")


def test_clipping_switched_on_or_off_is_refused_even_when_named():
    saved = {"algorithm": "sft", "config": {"optim": {"max_grad_norm": 0.0}},
             "data_signature": {"train": None, "eval": None}}
    current = {"algorithm": "sft", "config": {"optim": {"max_grad_norm": 1.0}},
               "data_signature": {"train": None, "eval": None}}
    with pytest.raises(checkpoint.CheckpointMismatchError, match="clipping on / off"):
        resume.check(saved, current, {"optim.max_grad_norm"}, "x", "run")


@pytest.mark.slow
def test_other_data_is_refused_even_under_the_same_file_name(tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [pc(i) for i in range(8)])
    run = tmp_path / "run"
    sft(run, "--data", str(path))
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(path, moved / "a.jsonl")  # the same data elsewhere: still the run's data
    sft(run, "--data", str(moved / "a.jsonl"), "--steps", "5")
    jsonl(moved / "a.jsonl", [pc(i) for i in range(20, 30)])
    msg = refusal(sft, run, "--data", str(moved / "a.jsonl"), "--steps", "6")
    assert "data: " in msg and "(changed since)" in msg and "refused" in msg


# ----------------------------------------------------------------------------- 4, 7. files kept


@pytest.mark.slow
def test_refused_and_eval_only_commands_leave_config_and_log_alone(copy, capsys):
    before = _files(copy)
    refusal(sft, copy, "--lora.rank", "4")  # another model: refused
    sft(copy, "--eval-only", "--steps", "100", "--batching.batch-size", "8")
    out = capsys.readouterr().out
    assert "--eval-only: scoring checkpoint 4" in out
    assert (copy / "config.json").read_text() == before["config.json"]
    log = (copy / "metrics.jsonl").read_text()
    assert log.startswith(before["metrics.jsonl"])  # appended, not rewritten
    assert json.loads(log.splitlines()[-1])["eval_only"] == "checkpoint 4"
    assert runs.load(copy).step == 4  # runs.load (and --init-from, export) still read the run


@pytest.mark.slow
def test_an_eval_only_score_on_other_data_names_them_and_is_never_the_runs_own_eval(copy,
                                                                                     tmp_path):
    from nnx_posttrain import compare

    sft(copy, "--eval-data", "builtin", "--resume", "--steps", "5", "--eval.every", "5",
        "--eval.exact-match", "0")  # the run's own eval, on the built-in eval split
    own = compare.summarize(compare.load_run(copy), "loss")
    other = jsonl(tmp_path / "other.jsonl", [pc(i) for i in range(8)])
    sft(copy, "--eval-only", "--eval-data", str(other), "--eval.exact-match", "0")
    record = metrics_log.read(copy)[-1]
    assert record["split"] == "eval_only" and record["eval_only"] == "checkpoint 5"
    assert record["eval_data"] == str(other) and len(record["eval_data_signature"]) == 16
    assert record["eval_settings"].startswith("batches 1, exact_match 0, max_new_tokens")
    assert record["loss"] != own["final"]
    assert compare.summarize(compare.load_run(copy), "loss") == own  # not the run's final / best
    shown = compare.compare([copy], out=tmp_path / "plots", echo=lambda text: None)
    assert str(other) in shown["eval_only"] and record["eval_data_signature"] in shown["eval_only"]
    assert str(other) not in shown["summary"]


@pytest.mark.slow
def test_a_hand_edited_config_is_never_silently_overwritten_by_a_resume(copy, capsys):
    path = copy / "config.json"
    config = json.loads(path.read_text())
    wrote = config["optim"]["learning_rate"]
    config["optim"]["learning_rate"] = 0.002
    path.write_text(json.dumps(config, indent=1))
    msg = refusal(sft, copy, "--resume", "--steps", "6")
    assert msg.startswith(f"{path} was edited since the run wrote it, and this command's settings "
                          "differ from the edit:\n  optim.learning_rate: the run wrote "
                          f"{wrote!r}, the file has 0.002, this command {wrote!r}\n")
    assert f"pass --config {path}" in msg and json.loads(path.read_text()) == config  # kept
    msg = refusal(sft, copy, "--resume", "--steps", "6", "--config", path)  # the edit, applied:
    assert "optim.learning_rate" in msg and "--resume-changed" in msg  # ... a resume's rule
    sft(copy, "--resume", "--steps", "6", "--config", path, "--resume-changed",
        "optim.learning-rate")
    assert json.loads(path.read_text())["optim"]["learning_rate"] == 0.002
    assert f"changed: optim.learning_rate: {wrote!r} -> 0.002" in capsys.readouterr().out
    sft(copy, "--resume", "--steps", "7", "--config", path)  # the file is the run's again


@pytest.mark.slow
def test_a_finished_run_rerun_with_fewer_steps_says_only_that_it_is_complete(copy, capsys):
    before = _files(copy)
    sft(copy, "--steps", "2")
    out = capsys.readouterr().out
    assert f"{copy} is already complete at step 4 (--steps 2); nothing to do" in out
    assert "changed:" not in out and "schedule now spans" not in out  # nothing was changed
    assert _files(copy) == before


def test_a_missing_data_file_is_refused_before_the_model_loads(tmp_path):
    # the model named here cannot load: the data's message shows the model was never reached
    message = refusal(sft, tmp_path / "run", "--data", str(tmp_path / "nothere.jsonl"),
                      "--model", str(tmp_path / "no_model"))
    assert "nothere.jsonl: no such data file" in message and "no_model" not in message


@pytest.mark.slow
def test_a_refused_run_leaves_no_new_directory_and_an_existing_one_as_it_was(tmp_path):
    bad = jsonl(tmp_path / "bad.jsonl", [pc(1), {"prompt": 3, "completion": "4"}])
    fresh = tmp_path / "fresh"
    assert "bad.jsonl:2: field 'prompt'" in str(refusal(sft, fresh, "--data", str(bad)))
    assert not fresh.exists()
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    refusal(sft, mine, "--data", str(bad))
    assert (mine / "notes").is_dir()  # a directory the user made is theirs


@pytest.mark.slow
def test_eval_only_without_checkpoint_keeps_the_log_and_says_it_scores_the_initial_weights(
        tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "split": "train", "loss": 5.0} for s in (1, 2, 3)]
    jsonl(run / "metrics.jsonl", lines)  # a run killed before its first checkpoint
    sft(run, "--eval-only")
    assert "scoring the initial weights (no checkpoint in" in capsys.readouterr().out
    kept = metrics_log.read(run)
    assert kept[:3] == lines and kept[3]["eval_only"] == "initial weights"
    assert not (run / "config.json").exists()


@pytest.mark.slow
def test_eval_only_of_an_online_method_says_how_it_evaluates(tmp_path):
    msg = refusal(train_run, "grpo", *FAST, "--run-dir", tmp_path / "run", "--init-from", "",
                  "--eval-only", "--algo.num-generations", "2", "--algo.rewards", "exact_match")
    assert "evaluated by generation" in msg and "--eval.exact-match" in msg


def test_metrics_log_trim_keeps_earlier_steps_eval_only_records_and_drops_a_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "split": "train"}, {"step": 2, "split": "train"},
            {"step": 2, "split": "eval", "eval_only": "checkpoint 2"}, {"step": 3, "split": "train"}]
    jsonl(path, rows)
    with path.open("a") as f:
        f.write('{"step": 4, "spl')  # killed mid-write
    said = []
    metrics_log.trim(path, 1, said.append)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [rows[0], rows[2]]
    assert "partial last line" in said[0] and "removed 2 records of steps after 1" in said[1]
    assert not list(tmp_path.glob("*.tmp"))
    path.unlink()
    metrics_log.trim(path, 3, said.append)
    assert "is missing; starting a new one" in said[-1]


def test_metrics_log_removed_mid_run_is_created_again(tmp_path):
    said = []
    log = metrics_log.MetricsLog(tmp_path, keep_until=-1, echo=said.append)
    log.log(1, "train", {"loss": 1.0}, echo=False)
    (tmp_path / "metrics.jsonl").unlink()
    log.log(2, "train", {"loss": 2.0}, echo=False)
    log.log(3, "train", {"loss": 3.0}, echo=False)
    log.close()
    assert [r["step"] for r in metrics_log.read(tmp_path)] == [2, 3]
    assert sum("was removed during the run" in s for s in said) == 1


@pytest.mark.slow
def test_metrics_log_missing_on_resume_is_recreated(copy, capsys):
    (copy / "metrics.jsonl").unlink()
    sft(copy, "--steps", "5")
    assert "metrics.jsonl is missing; starting a new one" in capsys.readouterr().out
    assert [r["step"] for r in records(copy)] == [5]


# ----------------------------------------------------------------------------- 5. the lock


@pytest.mark.slow
def test_a_held_run_directory_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with rundir.RunLock(run):  # this process: said so (another process: the slow test below)
        msg = refusal(sft, run)
    assert f"is in use by another run of this process (thread 'MainThread', pid {os.getpid()})" \
        in msg
    assert not (run / "run.lock").exists() and not (run / "checkpoints").exists()
    (run / "run.lock").write_text(json.dumps({"pid": 999999, "host": "h", "started": "then"}))
    sft(run)  # nobody holds the file's lock: its writer is dead
    assert "taking over the lock left by a process that is no longer running (pid 999999" in (
        capsys.readouterr().out)
    assert steps_of(run) == [2, 4] and not (run / "run.lock").exists()


def _start(run_dir, *extra):
    # -X faulthandler: a stalled process dumps every thread's stack on SIGABRT (see _wait_for)
    cmd = [sys.executable, "-X", "faulthandler", "-m", "experiments.sft", *FAST, "--run-dir",
           str(run_dir), *extra]
    # unbuffered: what it printed reaches the pipe before a test kills it
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGABRT)  # where it stalled: its threads' stacks, on its stderr
    _, err = proc.communicate(timeout=60)
    raise AssertionError(f"timed out; the process's stderr ends with:\n{err[-6000:]}")


@pytest.mark.slow
def test_second_process_refused_log_removed_mid_run_recreated_killed_holder_taken_over(
        tmp_path, capsys):
    """The holder is a process of its own; the runs that meet its lock run in this process (the
    lock is the file's: another process holds it, or held it and died). The command's exit on
    a refusal (status 1, one line, no traceback) is test_checkpoint's."""
    run = tmp_path / "run"
    proc = _start(run, "--steps", "100000", "--checkpoint.every", "0")
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and len(records(run)) >= 2, proc)
        msg = refusal(sft, run)
        assert f"is in use by another process (pid {proc.pid} on host" in msg
        (run / "metrics.jsonl").unlink()
        # a record in the new file: its message was printed before (the file is created first)
        _wait_for(lambda: (run / "metrics.jsonl").exists() and records(run), proc)
    finally:
        proc.kill()
    out, _ = proc.communicate(timeout=60)
    assert "metrics.jsonl was removed during the run; writing a new one from step" in out
    assert records(run)  # the rest of the run is logged
    capsys.readouterr()
    assert sft(run).step == 4
    assert f"taking over the lock left by a process that is no longer running (pid {proc.pid}" in (
        capsys.readouterr().out)


# ----------------------------------------------------------------------------- 6, 12. data


@pytest.mark.slow
def test_records_with_no_loss_token_are_refused_when_none_or_most_and_left_out_otherwise(
        tmp_path, capsys):
    long = {"prompt": "word " * 40, "completion": "1"}
    msg = refusal(sft, tmp_path / "a", "--data", str(jsonl(tmp_path / "a.jsonl", [long] * 8)))
    assert "none of the 8 records has a token to learn from" in msg and "--batching.max-length" in msg
    assert not (tmp_path / "a").exists()  # refused before it wrote anything: no directory left
    msg = refusal(sft, tmp_path / "b", "--data",
                  str(jsonl(tmp_path / "b.jsonl", [long] * 5 + [pc(i) for i in range(3)])))
    assert "5 of 8 records have no token" in msg and "--batching.skip-bad" in msg
    sft(tmp_path / "c", "--data", str(jsonl(tmp_path / "c.jsonl", [long] * 2 + [pc(i) for i in range(6)])))
    assert "2 records with no loss token left are left out (the first: " in capsys.readouterr().out
    assert all(np.isfinite(r["loss"]) for r in records(tmp_path / "c"))


@pytest.mark.slow
def test_identical_preference_pairs_are_counted(tmp_path, capsys):
    rows = [{"prompt": f"q{i}", "chosen": "same" if i < 3 else "a", "rejected": "same" if i < 3 else "b"}
            for i in range(8)]
    dpo(tmp_path / "run", "--data", str(jsonl(tmp_path / "p.jsonl", rows)), "--steps", "1")
    assert "3 pairs with chosen == rejected (no preference to learn)" in capsys.readouterr().out


def test_invalid_utf8_names_the_line_and_skip_bad_skips_it(tmp_path, micro):
    path = jsonl(tmp_path / "d.jsonl", [pc(0), b'{"prompt": "\xff\xfe", "completion": "1"}\n', pc(2)])
    src = data.source(str(path))
    with pytest.raises(data.DataError, match=rf"^{path}:2: not valid UTF-8 \(byte 0xff at column 13\)$"):
        src[1]
    t = data.Tokenize(micro.tokenizer, "gemma", 24)
    report = data.validate(src, t, skip_bad=True)
    assert report.bad == 1 and report.good_indices.tolist() == [0, 2]


def test_text_that_cannot_be_encoded_is_a_bad_record_by_line_and_field(tmp_path, micro):
    lone = b'{"prompt": "a \\ud800 b", "completion": "1"}\n'
    path = jsonl(tmp_path / "d.jsonl", [pc(0), lone, pc(2)])
    src = data.source(str(path))
    t = data.Tokenize(micro.tokenizer, "gemma", 24)
    with pytest.raises(data.DataError, match=rf"^{path}:2: field 'prompt' holds text that cannot be "
                                               r"encoded as UTF-8 \(surrogates not allowed: \\ud800"):
        t(src[1])
    report = data.validate(src, t, skip_bad=True)
    assert report.bad == 1 and report.good_indices.tolist() == [0, 2]


def test_records_too_deep_or_too_long_are_refused_by_line_before_they_cost_memory(tmp_path, micro,
                                                                                   monkeypatch):
    from nnx_posttrain.data import sources
    deep = b'{"prompt": "x", "completion": "1", "meta": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"
    nested = {"prompt": "x", "completion": "1", "meta": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}
    path = jsonl(tmp_path / "d.jsonl", [pc(0), deep, nested, pc(3)])
    src = data.source(str(path))
    with pytest.raises(data.DataError, match=rf"^{path}:2: JSON nested too deeply"):
        src[1]
    t = data.Tokenize(micro.tokenizer, "gemma", 24)
    with pytest.raises(data.DataError, match=rf"^{path}:3: field 'meta' is nested deeper than 32"):
        t(src[2])
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 100)
    with pytest.raises(data.DataError, match=rf"^{path}:2: a record of 400,045 bytes, over the 100 "):
        src[1]
    assert data.validate(src, t, skip_bad=True).good_indices.tolist() == [0, 3]


def test_mixture_parts_and_weights_are_checked_by_name(tmp_path):
    a, empty = jsonl(tmp_path / "a.jsonl", [pc(0)]), jsonl(tmp_path / "b.jsonl", [])
    with pytest.raises(data.DataError, match=rf"^{empty}: no records \(a part of a mixture"):
        data.source(f"{a}:0.5,{empty}:0.5")
    with pytest.raises(data.DataError, match=rf"^{a}:x: bad weight 'x'"):
        data.source(f"{a}:x")


# ----------------------------------------------------------------------------- 8. damage


def _damage(ck: Path, kind: str) -> None:
    if kind == "truncated array file":
        f = max((ck / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
        with f.open("r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    elif kind == "no manifest":
        (ck / "state" / "manifest.ocdbt").unlink()
    elif kind == "no _METADATA":
        (ck / "state" / "_METADATA").unlink()
    elif kind == "empty record":
        (ck / "record" / "metadata").write_text("")
    elif kind == "no state":
        shutil.rmtree(ck / "state")


KINDS = ["truncated array file", "no manifest", "no _METADATA", "empty record", "no state"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_restored(tmp_path, kind):
    cfg = config.CheckpointConfig(async_save=False)
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", cfg)
    state = {"params": {"w": np.arange(4096, dtype=np.float32)}, "step": np.int32(0)}
    record = {"model_record": {"variables": checkpoint.shapes(state)}}
    for step in (1, 2, 3):
        ckpt.save(step, {**state, "step": np.int32(step)}, {"i": step}, record)
    ckpt.wait()
    _damage(tmp_path / "ckpt" / "3", kind)
    said = []
    abstract = checkpoint.abstract({"params": {"w": np.zeros(4096, np.float32)},
                                    "step": np.zeros((), np.int32)})
    step, restored, data_state, _ = ckpt.restore_latest(abstract, record["model_record"],
                                                        echo=said.append)
    ckpt.close()
    assert step == 2 and int(restored["step"]) == 2 and data_state == {"i": 2}
    assert len(said) == 1 and f"checkpoint {tmp_path / 'ckpt' / '3'} is damaged (" in said[0]
    (aside,) = (tmp_path / "ckpt").glob("3.damaged-*")
    assert aside.name in said[0]


@pytest.mark.slow
def test_a_damaged_checkpoint_end_to_end_resumes_from_the_one_before(copy, capsys):
    _damage(copy / "checkpoints" / "4", "truncated array file")
    sft(copy, "--steps", "6")
    out = capsys.readouterr().out
    assert "checkpoints/4 is damaged" in out and "resumed from" in out and "(step 2)" in out
    assert steps_of(copy) == [2, 4, 6] and len(list((copy / "checkpoints").glob("4.damaged-*"))) == 1
    assert [r["step"] for r in records(copy)] == list(range(1, 7))


def test_every_checkpoint_damaged_and_resume_asked_is_refused(copy):
    for step in (2, 4):
        _damage(copy / "checkpoints" / str(step), "no state")
    assert "--resume: no complete checkpoint" in refusal(sft, copy, "--resume")


# ----------------------------------------------------------------------------- 10, 11. up front


@pytest.mark.parametrize("args, text", [
    (["--eval.batches", "-1"], "--eval.batches must be >= 0"),
    (["--eval.every", "-1"], "--eval.every must be >= 0"),
    (["--checkpoint.every", "-1"], "--checkpoint.every must be >= 0"),
    (["--checkpoint.keep", "0"], "--checkpoint.keep must be >= 1"),
    (["--logprob-chunk", "-1"], "--logprob-chunk must be >= 0"),
    (["--eval.max-new-tokens", "0"], "--eval.max-new-tokens must be >= 1"),
    (["--optim.min-lr-ratio", "2"], "--optim.min-lr-ratio must be in [0, 1]"),
    (["--checkpoint.keep-best", "exact_match", "--eval.exact-match", "0"], "needs exact-match"),
])
def test_bad_counts_are_refused_up_front(args, text):
    with pytest.raises(errors.ConfigError) as info:
        parse(api.config_type(SFT)(), args=args)
    assert text in str(info.value)


@pytest.mark.slow
def test_keep_best_metric_the_run_never_evaluates_is_refused_before_training(tmp_path):
    msg = refusal(sft, tmp_path / "run", "--checkpoint.keep-best", "exact_mtch")
    assert "--checkpoint.keep-best exact_mtch: the run never evaluates it" in msg
    assert "loss, mean_token_accuracy, perplexity" in msg
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_runs_checkpoints_folder_given_as_run_dir_is_refused_untouched(copy):
    before = sorted(p.name for p in (copy / "checkpoints").iterdir())
    message = refusal(sft, copy / "checkpoints", "--resume")
    assert f"--run-dir {copy / 'checkpoints'} is the checkpoints folder of the run {copy}: give " \
           f"the run itself (--run-dir {copy})" in message
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == before
    # another model into a run: how to go on
    message = refusal(sft, copy, "--model", "gemma_tiny")
    assert "model: checkpoint has 'gemma_micro', this run has 'gemma_tiny'" in message
    assert "start a new run in another --run-dir" in message


def test_run_dir_that_is_a_file_or_read_only_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    assert f"--run-dir {path} is a file" in refusal(sft, path)
    ro = tmp_path / "ro"
    ro.mkdir()
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(ro)],
                                                     capture_output=True).returncode == 0
    if not immutable:
        ro.chmod(0o555)  # enough for a user other than root
    try:
        if os.access(ro, os.W_OK) and not immutable:
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        assert f"--run-dir {ro} is not writable" in refusal(sft, ro)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)])
        ro.chmod(0o755)


def test_a_max_length_that_cannot_fit_is_refused_with_the_estimate(tmp_path):
    msg = refusal(sft, tmp_path / "run", "--batching.max-length", "2000000", "--lora.rank", "4",
                  "--batching.batch-size", "8")
    assert "a training step needs an estimated" in msg and "activations" in msg
    assert ("The cheapest fixes first: --quantize int8 (the frozen base in int8); "
            "--batching.grad-accum 2 (micro-batches of 4); --remat blocks; "
            "--batching.max-length 1000000; or pass --no-memory-check") in msg
    assert not (tmp_path / "run" / "checkpoints" / "2").exists()


def test_ctrl_c_while_a_checkpoint_is_written_waits_for_it():
    said = []
    with hooks.StopSignals(said.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt), stop.saving():
            os.kill(os.getpid(), signal.SIGINT)  # mid-save: says so, does not abort
            assert "a checkpoint is being written" in said[0] and not stop.aborted
            os.kill(os.getpid(), signal.SIGINT)  # a third one aborts
            time.sleep(1)
    said.clear()
    with hooks.StopSignals(said.append) as stop, stop.saving():
        os.kill(os.getpid(), signal.SIGINT)  # a first one during a save: wait, then stop
        assert stop.received == signal.SIGINT and "a checkpoint is being written" in said[0]


def test_a_second_ctrl_c_that_python_swallows_is_raised_again(capsys):
    """Where the abort lands in a finaliser (or a garbage-collector callback: seen in real runs,
    in JAX's), Python only prints it and goes on: nothing is printed, and the loop's next check
    (after the step, after the save) raises it."""

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, inside the finaliser

    before = sys.unraisablehook
    with hooks.StopSignals(lambda line: None) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the first: stop after this step
        Finalised()  # the second, swallowed where it lands
        assert stop.aborted
        with pytest.raises(KeyboardInterrupt):
            stop.check()
        with pytest.raises(KeyboardInterrupt):
            with stop.saving():
                pass
    assert "Exception ignored" not in capsys.readouterr().err
    assert sys.unraisablehook is before  # restored


def test_one_ctrl_c_that_python_swallows_while_the_model_loads_stops_the_run(
        tmp_path, monkeypatch, capsys):
    """A Ctrl-C landing in a garbage-collector callback while the model loads (seen in real runs:
    JAX's) was only printed, and the run trained to its end; it now stops before training."""
    from nnx_posttrain.train import setup

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, inside the finaliser

    original = setup.build_model

    def loading(*args, **kwargs):
        Finalised()  # the interrupt, swallowed where it lands
        return original(*args, **kwargs)

    monkeypatch.setattr(setup, "build_model", loading)
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(["sft", *FAST, "--run-dir", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C): stopped without writing a checkpoint" in err
    assert "Exception ignored" not in err
    assert not (tmp_path / "run").exists()  # a new run stopped before writing anything: no dir
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_commands_ctrl_c_python_swallowed_while_importing_stops_it(monkeypatch, capsys):
    """The command line notes a KeyboardInterrupt Python only printed (a gc callback's, while
    the command imported) and stops at once; importing the library alone installs nothing."""
    import types

    imports = cli._Imports()
    imports._previous = lambda unraisable: None
    for exc_type, noted in ((ValueError, False), (KeyboardInterrupt, True)):
        imports._note(types.SimpleNamespace(exc_type=exc_type, exc_value=exc_type(),
                                            exc_traceback=None, err_msg=None, object=None))
        assert imports.interrupted is noted

    class Interrupted(cli._Imports):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.interrupted = True

    monkeypatch.setattr(cli, "_Imports", Interrupted)
    assert cli.main(["sft", "--help"]) == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_twice_in_a_real_run_exits_cleanly_and_every_checkpoint_restores(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "--steps", "100000", "--checkpoint.every", "3")
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and len(records(run)) >= 4, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    for step in steps_of(run):
        assert runs.load(run, step=step).step == step
    assert not (run / "run.lock").exists()


# ----------------------------------------------------------------------------- storage underneath


def _one_message(capfd, error) -> str:
    """The StorageError's message, after checking nothing printed a traceback."""
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Exception in thread" not in err
    return str(error.value)


@pytest.mark.slow
def test_a_disk_that_fills_up_during_a_checkpoint_ends_in_one_message_and_loses_nothing(
        tmp_path, capfd):
    from support import small_filesystem

    with small_filesystem(tmp_path / "disk", 1200) as disk:
        with pytest.raises(errors.StorageError) as info:
            sft(disk / "run", "--steps", "60", "--checkpoint.every", "2")
        msg = _one_message(capfd, info)
        kept = steps_of(disk / "run")
        logged = [r["step"] for r in records(disk / "run")]
        # what fills the disk first is a checkpoint (a log's write may be the one that fails)
        assert msg.startswith(f"{disk / 'run'}: the storage under the run failed while writing ")
        assert msg.endswith(
            ": No space left on device. Training stopped. Safe: checkpoint "
            f"{kept[-1]} ({disk / 'run' / 'checkpoints' / str(kept[-1])}) is whole; "
            f"metrics.jsonl holds the training records of steps 1-{max(logged)}. "
            "Free space, then run the same command again to resume from it (or copy "
            "the run directory elsewhere and resume there).")
        shutil.copytree(disk / "run", tmp_path / "moved")
    assert runs.load(tmp_path / "moved").step == kept[-1]  # the checkpoint named is whole


@pytest.mark.slow
def test_a_disk_that_fills_up_while_logging_ends_in_one_message(tmp_path, capfd):
    from support import small_filesystem

    with small_filesystem(tmp_path / "disk", 1200) as disk:
        (disk / "filler").write_bytes(b"\0" * (1200 - 24) * 1024)  # 24 KiB left
        with pytest.raises(errors.StorageError) as info:
            sft(disk / "run", "--steps", "400", "--checkpoint.every", "1000")
        msg = _one_message(capfd, info)
        assert msg.startswith(f"{disk / 'run'}: the storage under the run failed while writing the ")
        assert "log" in msg.split(":")[1] and "No space left on device" in msg
        assert f"Safe: no checkpoint is left in {disk / 'run' / 'checkpoints'}; metrics.jsonl " \
               "holds the training records of steps 1-" in msg


@pytest.mark.slow
def test_a_checkpoints_folder_removed_during_the_run_is_said_once_and_saving_goes_on(
        tmp_path, capsys, monkeypatch):
    from nnx_posttrain.train import loop

    save = loop.Steps.save

    def remove_then_save(self, info):
        if info.step in (4, 6):
            self.run.checkpointer.wait()
            shutil.rmtree(self.run.checkpointer.directory)
        save(self, info)

    monkeypatch.setattr(loop.Steps, "save", remove_then_save)
    sft(tmp_path / "run", "--steps", "6")
    out = capsys.readouterr().out
    assert out.count("was removed during the run") == 1
    assert (f"warning: {tmp_path / 'run' / 'checkpoints'} was removed during the run, and the "
            "checkpoints it held with it; saving again from step 4") in out
    assert steps_of(tmp_path / "run") == [6]


# ----------------------------------------------------------------------------- --eval-only memory

MID = dict(num_layers=4, num_query_heads=4, num_key_value_heads=4, hidden_dim=256,
           intermediate_dim=2048, head_dim=64)
def _measure(algorithm, run_dir, *extra) -> dict:
    """A run of ``algorithm`` in this process: the bytes of the device arrays it made that are
    alive at its end (each device buffer once; arrays alive before it are not counted) and of
    its trainable weights."""
    import gc

    import jax

    from nnx_posttrain import api, model, train
    from nnx_posttrain.cli import train_command
    from nnx_posttrain.tasks import tokenizer

    if "gemma_mid" not in model.TINY:
        model.register_builtin("gemma_mid", MID, tokenizer.builtin_proto)
    args = ["--model", "gemma_mid", "--batching.max-length", "32", "--batching.batch-size", "4",
            "--steps", "1", "--eval.every", "0", "--eval.batches", "1", "--eval.exact-match", "0",
            "--checkpoint.every", "0", "--init-from", "", "--run-dir", str(run_dir), *extra]
    gc.collect()
    before = {x.unsafe_buffer_pointer() for x in jax.live_arrays()}
    cfg = train_command.config_from(algorithm, args, algorithm)
    with train.prepare(cfg, api.build(cfg), echo=lambda _: None) as run:
        train.evaluate_only(run) if cfg.eval_only else train.train(run)
        gc.collect()
        live = {x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays()}
        return {"live": sum(n for p, n in live.items() if p not in before),
                "weights": sum(x.nbytes for x in jax.tree.leaves(run.state["params"]))}


@pytest.mark.slow
def test_eval_only_holds_the_weights_without_optimizer_state_or_reference_copy(tmp_path):
    """Issue 19: --eval-only built the AdamW state (and a reference copy) it never used. Live
    bytes are counted once per device buffer (an array placed on the mesh aliases the model's)."""
    train = _measure("sft", tmp_path / "train")
    evaluated = _measure("sft", tmp_path / "train", "--eval-only")  # scores the checkpoint
    dpo_eval = _measure("dpo", tmp_path / "dpo", "--eval-only")  # reference = the weights scored
    w = train["weights"]
    print(f"weights {w / 2**20:.1f} MiB; live arrays: train {train['live'] / 2**20:.1f}, eval-only "
          f"{evaluated['live'] / 2**20:.1f}, DPO eval-only {dpo_eval['live'] / 2**20:.1f} MiB")
    assert train["live"] > evaluated["live"] + 1.9 * w  # AdamW's two moments, at least
    assert evaluated["live"] < 1.2 * w and dpo_eval["live"] < 1.2 * w  # the weights, once


STALLED_EXIT = """
import os, signal, sys, threading, time
from nnx_posttrain import cli
from nnx_posttrain.train import setup
threading.Thread(target=time.sleep, args=(3600,)).start()  # never ends, not a daemon

def loading(*args, **kwargs):  # SIGTERM while the model loads
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3600)

setup.build_model = loading
cli.main(["sft", *sys.argv[1:]], own_process=True)
"""


@pytest.mark.slow
def test_sigterm_before_training_ends_the_process_even_when_its_clean_exit_stalls(tmp_path):
    # A thread that never ends keeps the interpreter from exiting after SystemExit: the
    # command ends its process itself once the run is closed (the lock released).
    run = tmp_path / "run"
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", STALLED_EXIT, *FAST, "--run-dir", str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "stopped by SIGTERM while no training step was running" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run / "run.lock").exists()
    assert time.time() - start < 240


STALLED_TRAINING_EXIT = """
import runpy, sys, threading, time
from nnx_posttrain.cli import train_command
train_command.EXIT_GRACE_S = 2.0
threading.Thread(target=time.sleep, args=(3600,)).start()  # never ends, not a daemon
sys.argv = ["experiments.sft", *sys.argv[1:]]
runpy.run_module("experiments.sft", run_name="__main__")  # python -m experiments.sft ...
"""


@pytest.mark.slow
def test_sigterm_during_training_checkpoints_then_ends_even_when_the_exit_stalls(tmp_path):
    """SIGTERM mid-training: the step finishes, the checkpoint is written, and a stalled exit (a
    thread that never ends) is ended by the timer armed once the checkpoint is complete."""
    run = tmp_path / "run"
    args = [*FAST, "--steps", "100000", "--checkpoint.every", "0", "--run-dir", str(run)]
    proc = subprocess.Popen([sys.executable, "-c", STALLED_TRAINING_EXIT, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists()
                  and '"split": "train"' in (run / "metrics.jsonl").read_text(), proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM: saved checkpoint at step" in out + err
    assert any(p.name.isdigit() for p in (run / "checkpoints").iterdir())
    assert not (run / "run.lock").exists()


SIGTERM_IN_GC_CALLBACK = """
import gc, os, signal, time
from nnx_posttrain import errors
from nnx_posttrain.train import rundir
hit = []

def callback(phase, info):  # as JAX's: Python prints and ignores what escapes a gc callback
    if phase == "start" and not hit:
        hit.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10000):  # bytecodes: the signal's handler runs in here
            pass

try:
    with rundir.sigterm_exits():
        gc.callbacks.append(callback)
        gc.collect()
        time.sleep(10)
        print("still running after SIGTERM")
except errors.Stopped as stop:
    os._exit(stop.exit_code)
"""


@pytest.mark.slow
def test_sigterm_inside_a_gc_callback_still_ends_the_process():
    """A signal whose handler runs inside a garbage-collector callback (seen once: JAX's, while
    the model loaded) cannot end the run there (the exception would be printed and ignored,
    and the run would go on into training): it is sent again a moment later."""
    proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_GC_CALLBACK], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "still running" not in proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "stopped by SIGTERM while no training step was running" in proc.stderr


@pytest.mark.slow
def test_sigterm_while_the_model_loads_releases_the_lock(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "--steps", "100000", "--checkpoint.every", "0")
    try:
        _wait_for(lambda: (run / "run.lock").exists(), proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    assert "stopped by SIGTERM while no training step was running" in err
    assert not (run / "run.lock").exists()
