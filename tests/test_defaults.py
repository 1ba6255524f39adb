"""Defaults in one place per algorithm (its ``defaults`` for a user's data, the built-in task's
recipe file for ``--data builtin``), the --init-from check before loading, and the online
methods' checks of their rewards before the first rollout."""

import dataclasses
import json

import pytest

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
from nnx_posttrain import algorithms, api, cli, config, config_files, errors, tasks
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.cli.train_command import config_from
from support import MICRO, records, refusal, train_run

EXPERIMENTS = ("sft", "dpo", "simpo", "cpo", "orpo", "kto", "reward", "grpo", "rloo", "ppo",
               "online_dpo")


def _parsed(name, args):
    return config_from(name, args, name)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_builtin_recipe_only_with_builtin_data(name):
    own_defaults = api.defaults(name, data="mine.jsonl")
    builtin, own = _parsed(name, []), _parsed(name, ["--data", "mine.jsonl"])
    assert builtin == config_files.apply(own_defaults, tasks.recipe(name))
    assert own == config_files.merge(own_defaults, {"data": "mine.jsonl"}, "test")
    # the Python API gets the same defaults as the command line
    assert api.configure(name) == builtin and api.configure(name, data="mine.jsonl") == own
    # the built-in recipe: short sequences of the arithmetic task, from the SFT run
    assert builtin.batching.max_length == (24 if name == "sft" else 32)
    assert (builtin.init_from == "runs/sft") == (name != "sft")
    # a user's data: TRL-like
    assert own.init_from is None and own.eval_data is None
    assert own.optim.warmup_steps is None and own.optim.warmup_ratio == 0.1
    assert own.batching.grad_accum > 1 and own.remat == "blocks"
    assert own.batching.max_length == (512 if name in ("grpo", "rloo", "ppo", "online_dpo") else 1024)


def test_the_recipe_applies_where_the_data_is_builtin_from_the_flag_or_the_file(tmp_path):
    own = _write(tmp_path / "own.yaml", [])
    own.write_text("data: mine.jsonl\nsteps: 7\n")
    builtin_file = tmp_path / "builtin.yaml"
    builtin_file.write_text("steps: 7\n")
    assert _parsed("sft", ["--config", str(own)]).batching.max_length == 1024
    assert _parsed("sft", ["--config", str(builtin_file)]).batching.max_length == 24
    assert _parsed("sft", ["--config", str(own), "--data", "builtin"]).batching.max_length == 24
    assert _parsed("sft", ["--data=mine.jsonl"]).batching.max_length == 1024
    assert api.configure("sft", config=str(own)).batching.max_length == 1024


def test_the_image_task_brings_its_own_recipes_where_it_has_them(capsys):
    """--data builtin:shapes: SFT and GRPO get the image task's recipes (its vision model, the
    GRPO run from the SFT run's directory), the other algorithms a user's-data defaults; --help
    names the file, config.json the layer."""
    sft = _parsed("sft", ["--data", "builtin:shapes"])
    grpo = _parsed("grpo", ["--data", "builtin:shapes"])
    assert (sft.model, sft.run_dir, sft.batching.max_length) == (
        "gemma3_vision_tiny", "runs/shapes_sft", 32)
    assert (grpo.model, grpo.init_from, grpo.algo.num_generations) == (
        "gemma3_vision_tiny", "runs/shapes_sft", 8)
    assert _parsed("sft", ["--data", "builtin:shapes", "--steps", "5"]).steps == 5  # flags over it
    dpo = _parsed("dpo", ["--data", "builtin:shapes"])
    assert tasks.recipe("dpo", "builtin:shapes") is None
    assert dpo == config_files.merge(api.defaults("dpo", data="mine.jsonl"),
                                     {"data": "builtin:shapes"}, "test")
    assert "recipes/shapes/sft.yaml" in api.help_text("sft", "builtin:shapes")
    assert "recipes/shapes/" in " ".join(config.resolved_from(sft))


def test_every_algorithm_has_its_run_defaults_and_a_recipe():
    for name in EXPERIMENTS:
        cls = algorithms.get(name)
        assert "defaults" in vars(cls), f"{name}: its defaults for a user's data"
        assert tasks.recipe(name) is not None, f"{name}: its built-in recipe"
    assert config.BatchingConfig().max_length == 1024  # a user's data: the field's own default


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        yield from (_leaves(value, prefix + (key,)) if isinstance(value, dict)
                    else [(prefix + (key,), value)])


def test_each_default_is_written_once():
    """The common Config's fields are the defaults of a user's data; an algorithm's ``defaults``
    hold only what differs from them (a value equal to the field's would be written twice)."""
    assert vars(AlgorithmBase)["defaults"] == {}
    base = config.Config()
    for name in algorithms.names():
        for path, value in _leaves(algorithms.get(name).defaults):
            field = base
            for key in path:
                field = getattr(field, key)
            assert value != field, f"{name}: {'.'.join(path)} = {value!r} repeats config.py's"


def test_learning_rates_are_trls_per_trainer():
    lr = {name: api.defaults(name, data="x.jsonl").optim.learning_rate for name in EXPERIMENTS}
    assert lr == {"sft": 2e-5, "dpo": 1e-6, "simpo": 1e-6, "cpo": 1e-6, "orpo": 1e-6, "kto": 1e-6,
                  "reward": 1e-4, "grpo": 1e-6, "rloo": 1e-6, "ppo": 3e-6, "online_dpo": 5e-7}
    for name in ("grpo", "rloo", "ppo", "online_dpo"):
        own = api.defaults(name, data="x.jsonl").algo
        assert own.rewards == "" and own.max_completion_length == 512
        assert _parsed(name, []).algo.rewards == "exact_match"


def test_help_lists_the_defaults_of_the_run_it_describes(capsys):
    for args, length, init in ((["--help"], "32", "runs/sft"),
                               (["--data", "x.jsonl", "--help"], "1024", "None")):
        assert cli.main(["simpo", *args]) == 0
        text = capsys.readouterr().out
        block = text[text.index("--batching.max-length"):][:300]
        assert f"(default: {length})" in block, block
        assert f"(default: {init})" in text[text.index("--init-from"):][:400]
        flat = " ".join(text.split())
        assert ("defaults below include the built-in task's recipe" in flat) == (length == "32")
        # the one order of the layers, as api.ORDER says it
        assert all(f"{i}. {' '.join(layer.split())}" in flat
                   for i, layer in enumerate(api.ORDER, 1)), flat[:900]


def test_configure_takes_nested_and_dotted_settings_and_refuses_unknown_ones():
    cfg = api.configure("dpo", data="x.jsonl", optim={"learning_rate": 3e-6},
                        **{"algo.beta": 0.5, "batching.max_length": 64})
    assert (cfg.optim.learning_rate, cfg.algo.beta, cfg.batching.max_length) == (3e-6, 0.5, 64)
    assert cfg.optim.warmup_ratio == 0.1  # the algorithm's default, untouched
    with pytest.raises(errors.ConfigError, match="unknown key 'optim.lr'"):
        api.configure("dpo", optim={"lr": 1.0})
    with pytest.raises(errors.ConfigError, match="key 'steps': expected int"):
        api.configure("sft", steps="many")
    with pytest.raises(errors.ConfigError, match="--steps must be >= 0"):
        api.configure("sft", steps=-1)
    with pytest.raises(errors.ConfigError, match="unknown algorithm 'dpoo'"):
        api.configure("dpoo")


def test_warmup_ratio_and_explicit_steps():
    assert config.OptimConfig(warmup_ratio=0.1).warmup(25) == 3  # rounded up
    assert config.OptimConfig(warmup_ratio=0.1, warmup_steps=0).warmup(25) == 0  # given: wins
    assert config.OptimConfig(warmup_steps=7, warmup_ratio=0.5).warmup(25) == 7
    from nnx_posttrain import train

    lr = train.schedule(config.OptimConfig(learning_rate=1.0, warmup_ratio=0.1,
                                           schedule="constant"), 20)
    assert float(lr(0)) == 0.0 and float(lr(1)) == pytest.approx(0.5) and float(lr(2)) == 1.0


def test_exact_match_only_where_the_eval_data_has_answers(tmp_path, capsys):
    dpo, grpo = api.build(api.configure("dpo")), api.build(api.configure("grpo"))
    base = api.configure("dpo", data="train.jsonl")
    free = _write(tmp_path / "free.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}])
    answered = _write(tmp_path / "ans.jsonl", [{"prompt": "1+1?", "chosen": " 2", "rejected": " 3",
                                                 "answer": 2}])

    def resolved(cfg, algorithm, eval_data):
        cfg = config_files.merge(cfg, {"eval_data": str(eval_data)}, "test")
        return algorithm.settings_for_data(cfg, print)

    off = resolved(base, dpo, free)
    assert off.eval.exact_match == 0 and "no 'answer' column" in capsys.readouterr().out
    on = resolved(base, dpo, answered)
    assert on.eval.exact_match == base.eval.exact_match > 0
    builtin = _parsed("dpo", [])
    assert dpo.settings_for_data(builtin, print) == builtin
    # a named built-in task (the image task) judges its own records: SFT's conversations too
    sft = api.build(api.configure("sft"))
    shapes = resolved(api.configure("sft", data="builtin:shapes"), sft, "builtin:shapes")
    assert shapes.eval.exact_match > 0 and "no 'answer'" not in capsys.readouterr().out
    # an answer on a later record counts; an online method keeps its held-out prompts without
    # any (their greedy answers are scored by the run's rewards)
    late = _write(tmp_path / "late.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"},
                                            {"prompt": "1+1?", "chosen": " 2", "rejected": " 3",
                                             "answer": 2}])
    assert resolved(base, dpo, late).eval.exact_match > 0
    online = config_files.merge(api.configure("grpo", data="q.jsonl",
                                              algo={"rewards": "exact_match"}),
                                {"eval_data": str(free)}, "test")
    assert grpo.settings_for_data(online, print) == online


def test_exact_match_compares_with_the_answer_column():
    from nnx_posttrain import data

    src = data.ListSource([{"prompt": "1+1?", "chosen": " It is 2.", "rejected": " 3",
                            "answer": 2}], "eval.jsonl")
    assert data.prompts_and_answers(src, "gemma", 5)[0][1] == "2"


# ----------------------------------------------------------------------------- --init-from


def test_init_from_is_checked_before_the_model_loads(tmp_path, capsys):
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "Hi", "chosen": " a", "rejected": " b"}] * 4)
    base = [*MICRO, "--data", str(pairs), "--run-dir", str(tmp_path / "run"), "--steps", "1"]
    message = refusal("simpo", *base, "--init-from", tmp_path / "no", error=errors.CheckpointError)
    assert "not a run directory" in message and "--init-from ''" in message
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model": "gemma_tiny", "lora": {"rank": 0}}))
    message = refusal("simpo", *base, "--init-from", other, error=errors.CheckpointError)
    assert "trained 'gemma_tiny'" in message and "'gemma_micro'" in message
    assert "--init-from ''" in message
    assert "loading model" not in capsys.readouterr().out  # refused before any loading


@pytest.mark.slow
def test_loading_line_names_the_model_and_its_time(tmp_path, capsys):
    train_run("sft", *MICRO, "--run-dir", tmp_path / "run", "--steps", "1", "--eval.every", "0",
              "--eval.exact-match", "0", "--batching.batch-size", "4")
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
    message = refusal("grpo", *ONLINE, "--data", prompts, "--run-dir", tmp_path / "r",
                      error=errors.ConfigError)
    assert "needs --algo.rewards" in message
    assert "loading model" not in capsys.readouterr().out


@pytest.mark.parametrize("reward,missing", [("exact_match", "'answer'"),
                                            ("test_defaults:solution_reward", "'solution'")])
def test_reward_columns_are_checked_before_the_first_rollout(tmp_path, reward, missing):
    prompts = _write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(8)])
    message = refusal("grpo", *ONLINE, "--data", prompts, "--run-dir", tmp_path / "r",
                      "--algo.rewards", reward, error=errors.RewardError)
    assert f"needs column(s) {missing}" in message and str(prompts) in message
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_reward_failure_names_the_reward_and_the_row_and_time_is_logged(tmp_path):
    prompts = _write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?", "solution": "1"}
                                            for i in range(8)])
    train_run("grpo", *ONLINE, "--data", prompts, "--run-dir", tmp_path / "ok",
              "--algo.rewards", "test_defaults:solution_reward", "--batching.no-shuffle")
    rows = records(tmp_path / "ok")
    assert all(r["time/rollout"] > 0 for r in rows) and rows[-1]["time/update"] > 0
    message = refusal("grpo", *ONLINE, "--data", prompts, "--run-dir", tmp_path / "bad",
                      "--algo.rewards", "test_defaults:exploding_reward", "--batching.no-shuffle",
                      "--steps", "4", error=errors.RewardError)
    assert message.startswith("reward 'exploding_reward' failed on completion ")
    assert "Question 3" in message and "ZeroDivisionError" in message and str(prompts) in message


def test_the_command_line_is_configure_over_flags_and_the_layers_resolve_in_one_order(tmp_path):
    """One path builds a config: the command line's ``config_from`` is ``api.configure(args=)``;
    each layer of ``api.ORDER`` wins over the ones before it, and config.json records them."""
    path = tmp_path / "run.yaml"
    path.write_text("steps: 9\nseed: 4\noptim: {weight_decay: 0.5}\n")
    flags = ["--config", str(path), "--steps", "7"]
    assert api.configure("sft", args=flags) == config_from("sft", flags, "sft")
    cfg = api.configure("sft", seed=5, steps=8, args=flags)
    recipe = api.defaults("sft")  # layers 1-2: the recipe's learning rate over SFT's
    assert (cfg.steps, cfg.seed, cfg.optim.weight_decay) == (7, 5, 0.5)  # flag > keyword > file
    assert cfg.optim.learning_rate == recipe.optim.learning_rate != api.defaults(
        "sft", data="mine.jsonl").optim.learning_rate
    saved = config.saved(cfg)
    assert saved["resolved_from"] == [
        "SFT's defaults for a user's data",
        "the built-in task's recipe (nnx_posttrain/tasks/recipes/)",
        f"the config file {path}", "the settings given (keywords, flags)"]
    again = tmp_path / "config.json"
    again.write_text(json.dumps(saved))  # a run's config.json is a config file: the record skipped
    assert api.configure("sft", config=again) == dataclasses.replace(cfg, config=str(again))
    with pytest.raises(errors.ConfigError, match="a list of strings"):
        api.configure("sft", args="--steps 5")
    with pytest.raises(errors.ConfigError, match="config file is given twice"):
        api.configure("sft", config=path, args=["--config", str(path)])
    own = api.configure("sft", args=["--data", "mine.jsonl"])  # the flag's data: no recipe
    assert own == dataclasses.replace(api.defaults("sft", data="mine.jsonl"), data="mine.jsonl")


@pytest.mark.parametrize("name", algorithms.names())
def test_a_recipe_repeats_no_default_of_the_layer_below(name):
    """A recipe holds what the built-in task needs over the algorithm's defaults: a value equal
    to the one below it would be a default written twice."""
    below = api.defaults(name, data="mine.jsonl")
    for path, value in _leaves(config_files.read(tasks.recipe(name))):
        field = below
        for key in path:
            field = getattr(field, key)
        assert value != field, f"recipes/{name}.yaml: {'.'.join(path)} = {value!r} is the default"
