"""Faults in the newest features (issue 58): readers of a run that is still training, user code
that misbehaves in agent runs, evaluation and judging, plan, the Python API, restarts over a run
without checkpoints, libtpu noise, and the metrics window across a resume. In-process on the
micro model and the session's shared runs, except where a process must own its exit."""

import json
import shutil
from pathlib import Path

import pytest

from nnx_posttrain import checkpoint, cli, errors, runs


@pytest.fixture
def copy(shared_run, tmp_path):
    """A copy of the session's finished 4-step SFT run (checkpoints 2 and 4)."""
    run = tmp_path / "run"
    shutil.copytree(shared_run("sft"), run)
    return run


# ----------------------------------------------------------------------------- runs read live


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_read_past_and_left_in_place(copy):
    """A reader (sample, export, eval, a teacher, runs.load) of a run whose newest checkpoint
    cannot be read reads the one before it and says so; it moves nothing (resuming does)."""
    (copy / "checkpoints" / "4" / "record" / "metadata").write_bytes(b'{"\xff\xfe')
    said = []
    assert runs.load(copy, echo=said.append).step == 2
    assert [s for s in said if "damaged" in s] == [
        f"checkpoint {copy / 'checkpoints' / '4'} cannot be read (UnicodeDecodeError: 'utf-8' "
        "codec can't decode byte 0xff in position 2: invalid start byte): it is damaged; reading "
        "the one before it (resuming the run sets it aside)"]
    assert (copy / "checkpoints" / "4").is_dir()
    with pytest.raises(errors.CheckpointError, match=r"checkpoints/4 cannot be read \("
                                                     r"UnicodeDecodeError.*\): it is damaged. "
                                                     "Read another --step, or none"):
        runs.load(copy, step=4, echo=lambda _: None)


@pytest.mark.slow
def test_a_reader_whose_every_checkpoint_is_damaged_names_each(copy, capfd):
    for step in (2, 4):
        for f in (copy / "checkpoints" / str(step) / "state").rglob("d/*"):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(runs.NoCheckpointError, match=r"no complete checkpoint that can be read "
                                                     r"\(checkpoint 2: .*; checkpoint 4: "):
        runs.load(copy, echo=lambda _: None)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "never retrieved" not in err  # the failed reads


def test_a_checkpoint_listed_then_removed_is_listed_again(copy, monkeypatch):
    """Orbax lists a run's steps, then reads each one's metadata: a rotation between the two
    (FileNotFoundError of checkpoints/N) is a new listing, not a traceback."""
    reload = checkpoint.ocp.CheckpointManager.reload
    calls = []

    def rotating(self):
        calls.append(1)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(copy / "checkpoints" / "3"))
        return reload(self)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "reload", rotating)
    assert runs.latest_step(copy) == 4 and len(calls) >= 2


# ----------------------------------------------------------------------------- libtpu noise


@pytest.mark.slow
def test_a_cpu_host_with_libtpu_installed_never_starts_the_tpu_runtime():
    """With jax[tpu] installed on a host without TPU chips, JAX would load libtpu first (a page
    of start-up errors, when no other process holds the TPU lock); the command line and the
    library's runs choose the CPU, where nothing else chose."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the test extra installs it)")
    code = ("from nnx_posttrain import cpu_host\nimport jax\nfrom jax._src import xla_bridge\n"
            "chose = cpu_host.prefer_cpu()\njax.devices()\n"
            "print(chose, sorted(xla_bridge.backends()), xla_bridge._backend_errors,"
            " cpu_host.prefer_cpu())")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("a TPU host: JAX's own choice stands")
    assert out.stdout.split() == ["True", "['cpu']", "{}", "False"], out.stderr[-2000:]
    assert "TPU" not in out.stderr


# -------------------------------------------------------------------------- evaluation, judging


def test_a_task_file_lm_eval_skips_or_whose_data_is_missing_is_named_before_the_model_loads(
        shared_run, tmp_path, monkeypatch):
    from nnx_posttrain.harness import evaluate as E

    pytest.importorskip("lm_eval")
    monkeypatch.setattr(runs, "load", lambda *a, **k: pytest.fail("the model loaded"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text("task: broken\ndataset_path: json\n  test_split: [x\n")
    (tasks / "nodata.yaml").write_text(
        "task: nodata\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path / 'gone.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\nmetric_list: [{metric: exact_match}]\n")
    run = shared_run("sft")
    with pytest.raises(errors.ConfigError, match=r"unknown to lm-evaluation-harness: broken .*\n  "
                                                 r".*broken.yaml: not read: mapping values are "
                                                 r"not allowed .*line 3, column 13"):
        E.check_tasks(["broken"], E._manager(str(tasks), False), str(tasks))  # lm-eval's own
        # tasks not indexed (7 s): evaluate() refuses an unknown task with the same check
    with pytest.raises(errors.DataError, match=f"--tasks nodata: task 'nodata' \\(.*nodata.yaml\\) "
                                               f"reads {tmp_path / 'gone.jsonl'}, which does not "
                                               "exist"):
        E.evaluate(run, ["nodata"], E.Evaluation(include_path=str(tasks)))


def test_a_judge_that_raises_is_named_at_the_users_line():
    from nnx_posttrain.harness import judge as J

    def judge(prompts, pairs):
        return [0] * len(pairs[5])  # IndexError, on this line

    with pytest.raises(errors.ConfigError, match=r"--judge mine:judge: the judge failed on 2 "
                                                 r"pairs at .*test_faults_features.py:\d+: "
                                                 "IndexError: list index out of range"):
        J.pairwise_verdicts(judge, "mine:judge", ["q"] * 2, ["a"] * 2, ["b"] * 2)


def test_judge_results_against_runs_of_the_same_name_keep_their_own_files(tmp_path):
    """judge A B1 then judge A B2, with B1 and B2 named alike: two files in A/judge; the same
    pair judged again replaces its own."""
    from nnx_posttrain.harness import judge as J

    a, b1, b2 = tmp_path / "a", tmp_path / "x" / "sft", tmp_path / "y" / "sft"
    for d in (a, b1, b2):
        d.mkdir(parents=True)
    first = J._write(a, b1, {"run_b": str(b1), "win_rate": 0.25})
    second = J._write(a, b2, {"run_b": str(b2), "win_rate": 0.75})
    again = J._write(a, b1, {"run_b": str(b1), "win_rate": 0.5})
    assert first == again == str(a / "judge" / "sft.json") and second != first
    assert Path(second).name.startswith("sft-") and len(list((a / "judge").iterdir())) == 2
    assert [json.loads(Path(p).read_text())["win_rate"] for p in (first, second)] == [0.5, 0.75]


# ------------------------------------------------------------------------ metrics over a resume


@pytest.mark.slow
def test_the_log_window_a_stop_cuts_is_logged_after_the_resume_as_without_the_stop(
        tmp_path, monkeypatch):
    """Logged every 3 steps, stopped (SIGTERM) after step 2: the checkpoint keeps steps 1-2's
    device and host metrics (``truncated``: prompts cut at 24 tokens), and the resumed run's
    record of step 3 is the uninterrupted run's."""
    import signal

    from nnx_posttrain.train import loop
    from support import FAST_STEPS, MICRO, records, train_run

    args = [*MICRO, *FAST_STEPS, "--steps", "6", "--log-every", "3", "--checkpoint.every", "0",
            "--batching.max-length", "20"]  # (FAST_STEPS: one eval batch; 0 would be all 500)
    train_run("sft", *args, "--run-dir", tmp_path / "whole", echo=lambda _: None)
    one_step = loop.Steps.one_step

    def stopped_at_2(self, step, *rest):
        if step == 2:
            self.stop.received = signal.SIGTERM  # as the handler records a SIGTERM
        one_step(self, step, *rest)

    monkeypatch.setattr(loop.Steps, "one_step", stopped_at_2)
    stopped = train_run("sft", *args, "--run-dir", tmp_path / "cut", echo=lambda _: None)
    assert stopped.stopped_by == "SIGTERM" and stopped.train == []  # nothing logged at the stop
    monkeypatch.setattr(loop.Steps, "one_step", one_step)
    train_run("sft", *args, "--run-dir", tmp_path / "cut", echo=lambda _: None)

    def untimed(run):
        return [{k: v for k, v in r.items() if k not in ("tokens_per_second", "compile_seconds")}
                for r in records(run)]
    whole = untimed(tmp_path / "whole")
    assert [r["step"] for r in whole] == [3, 6] and whole[0]["truncated"] > 0
    assert untimed(tmp_path / "cut") == whole


# ----------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize("call, message", [
    (lambda npt: npt.configure(42), r"the algorithm is a name \(sft, dpo, .*\) or its class, got "
                                    "int 42"),
    (lambda npt: npt.configure("sft", config=123), r"configure\(config=...\): the path of a YAML "
                                                   "or JSON file, got int 123"),
    (lambda npt: npt.run({"steps": 4}), "a run takes the config that nnx_posttrain.configure "
                                        "builds, got dict {'steps': 4}"),
    (lambda npt: npt.evaluate({"steps": 4}), "a run takes the config"),
    (lambda npt: npt.load_run(7), r"load_run\(\): a run directory's path, got int 7"),
    (lambda npt: npt.configure("sft", **{"optim.learning_rate": 1e-3,
                                         "optim": {"learning_rate": 2e-3}}),
     r"configure\(\): optim.learning_rate is given twice, as 'optim.learning_rate' and as "
     r"'learning_rate' inside optim=\{...\}; give each setting once"),
    (lambda npt: npt.configure("sft", **{"optim.learning_rate": 1e-3, "optim.learning-rate": 1}),
     "as 'optim.learning_rate' and as 'optim.learning-rate'"),
])
def test_the_python_api_refuses_wrong_types_and_ambiguous_keys_with_a_config_error(call, message):
    import nnx_posttrain as npt

    with pytest.raises(errors.ConfigError, match=message):
        call(npt)


def test_two_threads_of_one_process_on_one_run_directory(tmp_path):
    """The second is told the directory is held by a run of this very process (its thread),
    not by 'a process that left no details'; once the first ends, it is free again."""
    import threading

    from nnx_posttrain.train import rundir

    started, finish, said = threading.Event(), threading.Event(), []

    def first():
        with rundir.RunLock(tmp_path):
            started.set()
            finish.wait(30)

    holder = threading.Thread(target=first, name="first run")
    holder.start()
    started.wait(30)
    try:
        with pytest.raises(errors.RunDirError) as info:
            rundir.RunLock(tmp_path).__enter__()
        said.append(str(info.value))
    finally:
        finish.set()
        holder.join(30)
    assert said == [f"{tmp_path} is in use by another run of this process (thread 'first run', "
                    f"pid {__import__('os').getpid()}): two runs cannot write one run directory; "
                    "wait for it to finish, or give this run another run_dir / --run-dir"]
    with rundir.RunLock(tmp_path):
        pass


# -------------------------------------------------------------------------- a restart over a run


@pytest.mark.slow
def test_starting_over_where_every_checkpoint_is_gone_keeps_the_earlier_files_aside(copy, capsys):
    from support import FAST_STEPS, MICRO, records, train_run

    before = {name: (copy / name).read_text() for name in ("config.json", "metrics.jsonl")}
    shutil.rmtree(copy / "checkpoints")
    train_run("sft", *MICRO, *FAST_STEPS, "--steps", "2", "--optim.learning-rate", "1e-3",
              "--run-dir", copy)
    (earlier,) = copy.glob("earlier-*")
    assert {name: (earlier / name).read_text() for name in before} == before
    assert sorted(p.name for p in earlier.iterdir()) == ["config.json", "metrics.jsonl", "tb"]
    assert f"{copy} has no checkpoint to resume from: this run starts from step 0. The earlier " \
           "run's config.json, metrics.jsonl, tb (metrics.jsonl holds the training records of " \
           f"steps 1-4; other settings) are kept in {earlier}" in capsys.readouterr().out
    assert [r["step"] for r in records(copy)] == [1, 2]
