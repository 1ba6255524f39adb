"""The Python API (nnx_posttrain.api, its names at the package root): a config built in Python,
two runs in one process, a result to read, a UserError to catch; and prepare / train /
evaluate_only, the loop's parts, for drivers that need them."""

import json

import numpy as np
import pytest

import nnx_posttrain as npt
from nnx_posttrain import metrics_log, model, train
from support import records

MICRO = dict(model="gemma_micro", steps=2, log_every=1, batching={"max_length": 24,
                                                                   "batch_size": 4},
             eval={"every": 0, "batches": 1, "exact_match": 4}, checkpoint={"every": 1})


@pytest.mark.slow
def test_sft_then_dpo_from_it_in_one_process_and_a_bad_setting_is_caught(tmp_path):
    sft = npt.run(npt.configure("sft", run_dir=str(tmp_path / "sft"), **MICRO))
    assert isinstance(sft, npt.RunResult) and sft.step == 2 and sft.stopped_by is None
    assert sft.run_dir == tmp_path / "sft" and (sft.run_dir / "checkpoints" / "2").is_dir()
    assert sft.final_eval == {k: v for k, v in records(sft.run_dir, "eval")[-1].items()
                              if k not in ("step", "split")}
    assert set(sft.final_eval) >= {"loss", "exact_match", "perplexity"}
    assert sft.best_eval("loss")["step"] in (0, 2)
    assert [r["step"] for r in sft.train] == [1, 2]

    dpo = npt.run(npt.configure("dpo", init_from=str(sft.run_dir), run_dir=str(tmp_path / "dpo"),
                                **MICRO))
    assert dpo.step == 2 and "rewards/accuracies" in dpo.final_eval
    config = json.loads((dpo.run_dir / "config.json").read_text())
    assert config["init_from"] == str(sft.run_dir) and config["algo_name"] == "DPOConfig"
    # the result's model is the trained one: the same logits as the checkpoint read back
    ids = np.array([[2, 17, 30, 41, 52, 63]], np.int32)
    mask = np.ones_like(ids)
    loaded = npt.load_run(dpo.run_dir, echo=lambda _: None)
    np.testing.assert_allclose(model.full_logits(dpo.module, ids, mask),
                               model.full_logits(loaded.module, ids, mask), atol=1e-6)

    with pytest.raises(npt.DataError, match="missing.jsonl: no such data file"):
        npt.run(npt.configure("dpo", data=str(tmp_path / "missing.jsonl"),
                              run_dir=str(tmp_path / "bad"), **MICRO))
    assert not (tmp_path / "bad").exists()  # refused before it wrote anything
    with pytest.raises(npt.ConfigError, match="unknown key 'optim.lr'"):
        npt.configure("dpo", optim={"lr": 1e-3})
    # the process goes on: a third run after the errors
    again = npt.evaluate(npt.configure("sft", run_dir=str(tmp_path / "sft"), **MICRO))
    assert again["loss"] == pytest.approx(sft.final_eval["loss"], rel=1e-6)
    assert metrics_log.read(sft.run_dir)[-1]["eval_only"] == "checkpoint 2"


@pytest.mark.slow
def test_prepare_train_and_evaluate_only_are_the_loop_a_driver_can_take_apart(tmp_path):
    cfg = npt.configure("sft", run_dir=str(tmp_path / "run"), **MICRO)
    with train.prepare(cfg, npt.api.build(cfg), echo=lambda _: None) as run:
        assert run.start_step == 0 and run.restored is None and run.optimizer is not None
        assert (run.run_dir / "run.lock").exists()  # held while prepared
        result = train.train(run)
    assert not (run.run_dir / "run.lock").exists()
    assert result.step == 2
    evaluating = npt.configure("sft", run_dir=str(tmp_path / "run"), eval_only=True, **MICRO)
    with train.prepare(evaluating, npt.api.build(evaluating), echo=lambda _: None) as run:
        assert run.restored.step == 2 and run.optimizer is None and "opt_state" not in run.state
        assert set(train.evaluate_only(run)) >= {"loss", "exact_match"}


def test_a_bad_flag_given_to_configure_is_a_config_error_not_an_exit(capsys):
    """The Python API's ``args``: an unknown or ill-typed flag raises ConfigError with tyro's
    message (the flag, its suggestion), not SystemExit, which would end a notebook's kernel
    cell as a crash; good flags apply; --help prints the options, then ConfigError. A command
    (``prog`` given) still exits with its usage."""
    with pytest.raises(npt.ConfigError, match=r"--stepz.*Perhaps you meant.*--steps INT"):
        npt.configure("sft", args=["--stepz", "5"])
    with pytest.raises(npt.ConfigError, match=r"Error parsing --steps.*'five'"):
        npt.configure("sft", args=["--steps", "five"])
    assert npt.configure("sft", args=["--steps", "7"]).steps == 7
    with pytest.raises(npt.ConfigError, match=r"--help printed the options above"):
        npt.configure("sft", args=["--help"])
    assert "--batching.max-length" in capsys.readouterr().out  # the help, on stdout
    with pytest.raises(SystemExit) as info:
        npt.configure("sft", args=["--stepz", "5"], prog="nnx-posttrain train sft")
    assert info.value.code == 2
