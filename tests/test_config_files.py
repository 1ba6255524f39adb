"""--config FILE.yaml|json (config_files.py): the file's values become the defaults, flags override
them, a run's config.json repeats the run, bad keys and types are refused with file, key and
type; every shipped experiments/configs/*.yaml is valid for its experiment; the command-line
entry points."""

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from support import cli_error, command_output

import nnx_posttrain  # noqa: F401
from nnx_posttrain import algorithms, api, config, errors
from nnx_posttrain.algorithms import DPO
from nnx_posttrain.cli.train_command import parse
from nnx_posttrain.data import hub
model_load = importlib.import_module("nnx_posttrain.model.load")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def simpo():
    return api.defaults("simpo", data="my.jsonl")  # a user's data: no recipe


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_sets_defaults_and_flags_override(tmp_path, simpo):
    path = _write(tmp_path, "model: gemma_micro\nsteps: 12\noptim:\n  learning-rate: 2e-5\n"
                            "  warmup_steps: 3\nlora: {rank: 8}\nalgo:\n  beta: 2.5\n")
    cfg = parse(simpo, ["--config", path, "--steps", "3", "--optim.warmup-steps", "1"])
    assert cfg.model == "gemma_micro" and cfg.lora.rank == 8 and cfg.algo.beta == 2.5
    assert cfg.optim.learning_rate == 2e-5  # YAML 1.1 reads 2e-5 as a string: accepted as a float
    assert (cfg.steps, cfg.optim.warmup_steps) == (3, 1)  # flags win, before or after --config
    assert cfg.batching == simpo.batching  # untouched keys keep the experiment's defaults
    assert cfg.config == path
    assert parse(simpo, [f"--config={path}"]).steps == 12
    assert parse(simpo, ["--steps", "5", "--config", path]).steps == 5


def test_the_algorithms_options_are_checked_once_file_and_flags_are_applied(tmp_path):
    """A file may name an option whose companion a flag gives (exo_pair and its epsilon); the
    finished settings are checked, every problem listed with the option to change."""
    dpo = api.defaults("dpo", data="my.jsonl")
    path = _write(tmp_path, "algo: {loss_type: exo_pair}\n")
    cfg = parse(dpo, ["--config", path, "--algo.label-smoothing", "1e-3"])
    assert (cfg.algo.loss_type, cfg.algo.label_smoothing) == ("exo_pair", 1e-3)
    assert api.configure("dpo", config=path, data="my.jsonl",
                         algo={"label_smoothing": 1e-3}).algo == cfg.algo
    with pytest.raises(errors.ConfigError) as info:
        parse(dpo, ["--config", path, "--algo.ld-alpha", "2", "--steps", "-1"])
    assert all(text in str(info.value) for text in (
        "--steps must be >= 0", "exo_pair needs 0 < label_smoothing < 1",
        "--algo.ld-alpha must be in [0, 1], got 2.0"))


def test_a_runs_config_json_repeats_the_run(tmp_path, simpo):
    cfg = parse(simpo, ["--steps", "9", "--lora.rank", "4", "--algo.gamma", "0.7",
                               "--batching.max-prompt-length", "12", "--dtype", "bfloat16"])
    config.save(cfg, tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["algo_name"] == "SimPOConfig"  # bookkeeping keys are accepted
    again = parse(simpo, ["--config", str(tmp_path / "config.json"), "--seed", "2"])
    assert dataclasses.replace(again, seed=cfg.seed, config=None) == cfg
    assert again.seed == 2
    # written by another algorithm: refused by name rather than half applied
    with pytest.raises(errors.ConfigError) as info:
        parse(api.config_type(DPO)(), ["--config", str(tmp_path / "config.json")])
    assert "algo_name SimPOConfig" in str(info.value) and "DPOConfig" in str(info.value)
    # a run resumed with --resume saves the run's settings, not that instruction: the file
    # starts the same run elsewhere instead of asking for a checkpoint there
    config.save(parse(simpo, ["--resume"]), tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["resume"] is False


@pytest.mark.parametrize("text, expected", [
    ("stepz: 3\n", ["c.yaml", "line 1: unknown key 'stepz'", "did you mean 'steps'"]),
    ("optim:\n  lr: 0.1\n", ["line 2: unknown key 'optim.lr'",
                             "keys under 'optim' are: learning_rate"]),
    ("seed: 1\nsteps: ten\n", ["c.yaml", "line 2: key 'steps': expected int, got str 'ten'"]),
    ("steps: 2.5\n", ["key 'steps': expected int, got float 2.5"]),
    ("optim:\n  learning_rate: fast\n", ["key 'optim.learning_rate': expected float"]),
    ("dtype: float16\n", ["key 'dtype': expected one of 'auto', 'float32', 'bfloat16', 'bfloat16-params'"]),
    ("batching:\n  shuffle: 1\n", ["key 'batching.shuffle': expected bool, got int 1"]),
    ("lora: 8\n", ["key 'lora': expected a mapping of LoraConfig fields, got int 8"]),
    ("eval_data: 3\n", ["key 'eval_data': expected str or null"]),
    ("algo:\n  betta: 2\n", ["unknown key 'algo.betta'", "did you mean 'algo.beta'"]),
    ("[1, 2]\n", ["expected a mapping of option names to values, got list"]),
    ("steps: [1\n", ["malformed YAML"]),
    # PyYAML keeps the last of two values silently: a key given twice is refused, both lines named
    ("steps: 3\nseed: 1\nsteps: 30\n", ["line 3: key 'steps' is given twice (also on line 1"]),
    ("optim:\n  learning_rate: 1.0e-5\n  learning_rate: 2.0e-5\n",
     ["line 3: key 'learning_rate' is given twice (also on line 2"]),
    ("batching:\n  batch-size: 4\n  batch_size: 8\n",
     ["line 3: key 'batching.batch_size' is given twice ('-' and '_' spellings"]),
])
def test_bad_files_name_the_file_the_key_and_the_type(tmp_path, simpo, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(errors.ConfigError) as info:
        parse(simpo, ["--config", path])
    msg = str(info.value)
    assert msg.startswith(f"{path}: "), msg
    for part in expected:
        assert part in msg, (part, msg)


def test_missing_file_and_bad_json(tmp_path, simpo):
    with pytest.raises(errors.ConfigError, match="no such config file"):
        parse(simpo, ["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(errors.ConfigError, match=r"c.json: line 1: malformed JSON"):
        parse(simpo, ["--config", _write(tmp_path, "{steps: 1}", "c.json")])
    with pytest.raises(errors.ConfigError, match=r"c.json: key 'steps' is given twice"):
        parse(simpo, ["--config", _write(tmp_path, '{"steps": 1, "steps": 2}', "c.json")])
    with pytest.raises(errors.ConfigError, match=r"--config is given twice \(a.yaml and the next\)"):
        parse(simpo, ["--config", "a.yaml", "--config=b.yaml"])
    with pytest.raises(errors.ConfigError, match=r"invalid configuration \(the flags and .*r.yaml\):\n  "
                                         r"--steps must be >= 0"):
        parse(simpo, ["--config", _write(tmp_path, "steps: -3\n", "r.yaml")])
    with pytest.raises(errors.ConfigError, match="--config needs a file"):
        parse(simpo, ["--config"])


def test_report_to_is_checked(simpo):
    assert parse(simpo, ["--report-to", "jsonl,wandb"]).report_to == "jsonl,wandb"
    with pytest.raises(errors.ConfigError, match="--report-to must be"):
        parse(simpo, ["--report-to", "tensorbored"])


def _algorithm_of(stem: str) -> str:
    names = [n for n in algorithms.names() if f"_{n}_" in f"_{stem}_"]
    assert names, f"experiments/configs/{stem}.yaml: name it <model>_<algorithm>[_...].yaml"
    return max(names, key=len)


SHIPPED = sorted((REPO / "experiments" / "configs").glob("*.yaml"))


def test_the_shipped_configs_cover_the_issue():
    stems = {p.stem for p in SHIPPED}
    assert {"gemma_2b_sft_lora", "gemma_2b_simpo", "gemma_2b_grpo", "llama3.2_1b_dpo",
            "qwen2.5_0.5b_grpo"} <= stems


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_is_valid_for_its_experiment(path):
    """Loaded and validated as its experiment would (no model or data is downloaded): a real
    model's short name, Hub datasets that parse, commented."""
    name = _algorithm_of(path.stem)
    cfg = parse(api.defaults(name, data="my.jsonl"), ["--config", str(path)])
    assert cfg.model in model_load.PRESETS, cfg.model
    for spec in filter(None, [cfg.data, cfg.eval_data]):
        if spec.startswith("hf://"):
            hub.parse_handle(spec)
    algo = api.build(cfg)
    algo.check(cfg)  # the algorithm's own checks, as a run makes them before loading anything
    if name in ("grpo", "rloo", "ppo", "online_dpo"):
        assert algo.prompts_per_step(cfg.batching.batch_size) >= 1
    assert cfg.batching.batch_size % cfg.batching.grad_accum == 0
    assert sum(line.lstrip().startswith("#") or " # " in line
               for line in path.read_text().splitlines()) >= 5, "comment the file"


def test_the_shipped_reward_function():
    from experiments.configs.rewards import boxed_answer

    assert boxed_answer(None, ["so \\boxed{42}.", "\\boxed{4} then \\boxed{\\frac{1}{2}}", "42"],
                        solution=["42", "\\frac{1}{2}", "42"]) == [1.0, 1.0, 0.0]
    # a conversational completion, as TRL passes it for chat prompts
    assert boxed_answer(None, [[{"role": "assistant", "content": "so \\boxed{7}"}]],
                        solution=["7"]) == [1.0]


# ----------------------------------------------------------------------------- entry points


def test_experiments_help_exits_0_and_lists_each_algorithm(capsys, monkeypatch):
    code, out, _ = command_output(capsys, monkeypatch, ["--help"], prog="python -m experiments")
    assert code == 0
    for name in algorithms.names():
        line = next(l for l in out.splitlines() if l.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10, line  # a one-line description
    code, _, err = command_output(capsys, monkeypatch, ["nosuch"], prog="python -m experiments")
    assert code != 0 and "unknown command 'nosuch'" in err


def test_usage_line_names_the_module_not_a_file(capsys, monkeypatch):
    code, out, _ = command_output(capsys, monkeypatch, ["simpo", "--help"],
                                  command_prog="python -m experiments.simpo")
    assert code == 0
    assert out.startswith("usage: python -m experiments.simpo [-h]"), out[:200]
    assert "--config" in out and "--report-to" in out
    assert "hf://ORG/NAME" in out  # --data lists the sources it takes
    _, out, _ = command_output(capsys, monkeypatch, ["dpo", "--help"], prog="python -m experiments")
    assert out.startswith("usage: python -m experiments dpo [-h]"), out[:200]


def test_the_experiment_files_are_the_commands():
    for name in algorithms.names():  # python -m experiments.NAME is cli.experiment("NAME")
        text = (REPO / "experiments" / f"{name}.py").read_text()
        assert f'experiment("{name}")' in text, name


def test_console_script_is_declared(capsys):
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["nnx-posttrain"] == "nnx_posttrain.cli:console"
    assert set(project["optional-dependencies"]) >= {"cuda", "tpu", "test"}
    assert "usage: nnx-posttrain COMMAND" in cli_error(capsys, ["nosuch"], prog="nnx-posttrain")
