"""Defaults by data (experiment.DEFAULT / BUILTIN), the --init-from check before loading, and the
online methods' checks of their rewards before the first rollout."""

import json

import pytest

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
from nnx_posttrain import config, experiment
from nnx_posttrain.algorithms import GRPO, SFT, SimPO
from support import MICRO, records

EXPERIMENTS = ("sft", "dpo", "simpo", "cpo", "orpo", "kto", "reward", "grpo", "rloo", "ppo",
               "online_dpo")


def _module(name):
    return __import__(f"experiments.{name}", fromlist=["DEFAULT"])


def _parsed(name, args):
    m = _module(name)
    return experiment.parse_config(experiment.defaults_for(m.DEFAULT, m.BUILTIN, args), args)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_builtin_recipe_only_with_builtin_data(name):
    m = _module(name)
    assert isinstance(m.BUILTIN, dict)  # a plain literal dict of overrides
    builtin, own = _parsed(name, []), _parsed(name, ["--data", "mine.jsonl"])
    assert builtin == experiment.with_overrides(m.DEFAULT, m.BUILTIN)
    assert own == experiment.with_overrides(m.DEFAULT, {"data": "mine.jsonl"})
    # the built-in recipe: short sequences of the arithmetic task, from the SFT run
    assert builtin.batching.max_length == (24 if name == "sft" else 32)
    assert (builtin.init_from == "runs/sft") == (name != "sft")
    # a user's data: TRL-like
    assert own.init_from is None and own.eval_data is None
    assert own.optim.warmup_steps is None and own.optim.warmup_ratio == 0.1
    assert own.batching.grad_accum > 1 and own.remat == "blocks"
    assert own.batching.max_length == (512 if name in ("grpo", "rloo", "ppo", "online_dpo") else 1024)


def test_learning_rates_are_trls_per_trainer():
    lr = {name: _module(name).DEFAULT.optim.learning_rate for name in EXPERIMENTS}
    assert lr == {"sft": 2e-5, "dpo": 1e-6, "simpo": 1e-6, "cpo": 1e-6, "orpo": 1e-6, "kto": 1e-6,
                  "reward": 1e-4, "grpo": 1e-6, "rloo": 1e-6, "ppo": 3e-6, "online_dpo": 5e-7}
    for name in ("grpo", "rloo", "ppo", "online_dpo"):
        own = _module(name).DEFAULT.algo
        assert own.rewards == "" and own.max_completion_length == 512
        assert _parsed(name, []).algo.rewards == "exact_match"


def test_help_lists_the_defaults_of_the_run_it_describes(capsys):
    for args, length, init in ((["--help"], "32", "runs/sft"),
                               (["--data", "x.jsonl", "--help"], "1024", "None")):
        with pytest.raises(SystemExit) as info:
            experiment.main("simpo", SimPO, _module("simpo").DEFAULT, args=args,
                            builtin=_module("simpo").BUILTIN)
        assert info.value.code == 0
        text = capsys.readouterr().out
        block = text[text.index("--batching.max-length"):][:300]
        assert f"(default: {length})" in block, block
        assert f"(default: {init})" in text[text.index("--init-from"):][:400]
        assert ("defaults below are the built-in task's recipe" in " ".join(text.split())) == (
            length == "32")


def test_warmup_ratio_and_explicit_steps():
    assert config.OptimConfig(warmup_ratio=0.1).warmup(25) == 3  # rounded up
    assert config.OptimConfig(warmup_ratio=0.1, warmup_steps=0).warmup(25) == 0  # given: wins
    assert config.OptimConfig(warmup_steps=7, warmup_ratio=0.5).warmup(25) == 7
    from nnx_posttrain import train

    lr = train.schedule(config.OptimConfig(learning_rate=1.0, warmup_ratio=0.1,
                                           schedule="constant"), 20)
    assert float(lr(0)) == 0.0 and float(lr(1)) == pytest.approx(0.5) and float(lr(2)) == 1.0


def test_exact_match_only_where_the_eval_data_has_answers(tmp_path, capsys):
    base = experiment.with_overrides(_module("dpo").DEFAULT, {"data": "train.jsonl"})
    free = _write(tmp_path / "free.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    answered = _write(tmp_path / "ans.jsonl", [{"prompt": "1+1?", "chosen": " 2", "rejected": " 3",
                                                 "answer": 2}])
    off = experiment.for_the_data(experiment.with_overrides(base, {"eval_data": str(free)}),
                                  _module("dpo").ALGORITHM)
    assert off.eval.exact_match == 0 and "no 'answer' column" in capsys.readouterr().out
    on = experiment.for_the_data(experiment.with_overrides(base, {"eval_data": str(answered)}),
                                 _module("dpo").ALGORITHM)
    assert on.eval.exact_match == base.eval.exact_match > 0
    builtin = _parsed("dpo", [])
    assert experiment.for_the_data(builtin, _module("dpo").ALGORITHM) == builtin
    # an answer on a later record counts; an online method keeps its held-out prompts without
    # any (their greedy answers are scored by the run's rewards)
    late = _write(tmp_path / "late.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"},
                                            {"prompt": "1+1?", "chosen": " 2", "rejected": " 3",
                                             "answer": 2}])
    assert experiment.for_the_data(experiment.with_overrides(base, {"eval_data": str(late)}),
                                   _module("dpo").ALGORITHM).eval.exact_match > 0
    grpo = experiment.with_overrides(_module("grpo").DEFAULT, {"data": "q.jsonl",
                                                               "eval_data": str(free)})
    assert experiment.for_the_data(grpo, _module("grpo").ALGORITHM) == grpo


def test_exact_match_compares_with_the_answer_column():
    from nnx_posttrain import data

    src = data.ListSource([{"prompt": "1+1?", "chosen": " It is 2.", "rejected": " 3",
                            "answer": 2}], "eval.jsonl")
    assert data.prompts_and_answers(src, "gemma", 5)[0][1] == "2"


# ----------------------------------------------------------------------------- --init-from


def test_init_from_is_checked_before_the_model_loads(tmp_path, capsys):
    m = _module("simpo")
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}] * 4)
    base = [*MICRO, "--data", str(pairs), "--run-dir", str(tmp_path / "run"), "--steps", "1"]
    with pytest.raises(SystemExit) as info:
        experiment.main("simpo", SimPO, m.DEFAULT, args=[*base, "--init-from", str(tmp_path / "no")])
    assert "not a run directory" in str(info.value) and "--init-from ''" in str(info.value)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model": "gemma_tiny", "lora": {"rank": 0}}))
    with pytest.raises(SystemExit) as info:
        experiment.main("simpo", SimPO, m.DEFAULT, args=[*base, "--init-from", str(other)])
    message = str(info.value)
    assert "trained 'gemma_tiny'" in message and "'gemma_micro'" in message
    assert "--init-from ''" in message
    assert "loading model" not in capsys.readouterr().out  # refused before any loading


def test_loading_line_names_the_model_and_its_time(tmp_path, capsys):
    experiment.main("sft", SFT, _module("sft").DEFAULT, args=[
        *MICRO, "--run-dir", str(tmp_path / "run"), "--steps", "1", "--eval.every", "0",
        "--eval.exact-match", "0", "--batching.batch-size", "4"])
    out = capsys.readouterr().out
    assert "loading model gemma_micro (float32) ..." in out
    assert "loaded gemma_micro in " in out and out.index("loading model") < out.index("loaded ")


# ----------------------------------------------------------------------------- online checks


ONLINE = [*MICRO, "--init-from", "", "--algo.max-completion-length", "4", "--steps", "2",
          "--batching.batch-size", "4", "--algo.num-generations", "2", "--log-every", "1",
          "--eval.every", "0", "--checkpoint.every", "0"]


def solution_reward(prompts, completions, solution, **_):
    return [float(s in c) for c, s in zip(completions, solution)]


def exploding_reward(prompts, completions, **_):
    if any("Question 3" in str(p) for p in prompts):
        raise ZeroDivisionError("no")
    return [0.0] * len(completions)


def test_grpo_on_own_data_needs_rewards_before_loading(tmp_path, capsys):
    prompts = _write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(8)])
    with pytest.raises(SystemExit, match="needs --algo.rewards"):
        experiment.main("grpo", GRPO, _module("grpo").DEFAULT,
                        args=[*ONLINE, "--data", str(prompts), "--run-dir", str(tmp_path / "r")])
    assert "loading model" not in capsys.readouterr().out


@pytest.mark.parametrize("reward,missing", [("exact_match", "'answer'"),
                                            ("test_defaults:solution_reward", "'solution'")])
def test_reward_columns_are_checked_before_the_first_rollout(tmp_path, reward, missing):
    prompts = _write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(8)])
    with pytest.raises(SystemExit) as info:
        experiment.main("grpo", GRPO, _module("grpo").DEFAULT, args=[
            *ONLINE, "--data", str(prompts), "--run-dir", str(tmp_path / "r"),
            "--algo.rewards", reward])
    assert f"needs column(s) {missing}" in str(info.value) and str(prompts) in str(info.value)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_reward_failure_names_the_reward_and_the_row_and_time_is_logged(tmp_path):
    prompts = _write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?", "solution": "1"}
                                            for i in range(8)])
    experiment.main("grpo", GRPO, _module("grpo").DEFAULT, args=[
        *ONLINE, "--data", str(prompts), "--run-dir", str(tmp_path / "ok"),
        "--algo.rewards", "test_defaults:solution_reward", "--batching.no-shuffle"])
    rows = records(tmp_path / "ok")
    assert all(r["time/rollout"] > 0 for r in rows) and rows[-1]["time/update"] > 0
    with pytest.raises(SystemExit) as info:
        experiment.main("grpo", GRPO, _module("grpo").DEFAULT, args=[
            *ONLINE, "--data", str(prompts), "--run-dir", str(tmp_path / "bad"),
            "--algo.rewards", "test_defaults:exploding_reward", "--batching.no-shuffle",
            "--steps", "4"])
    message = str(info.value)
    assert message.startswith("error: reward 'exploding_reward' failed on completion ")
    assert "Question 3" in message and "ZeroDivisionError" in message and str(prompts) in message
