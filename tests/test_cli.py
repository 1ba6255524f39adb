"""Run configuration and its command line (config.py + cli/train_command.py), and the SFT entry
point."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
from nnx_posttrain import api, config, errors  # noqa: E402
from nnx_posttrain.algorithms import SFT, SFTConfig  # noqa: E402
from nnx_posttrain.cli.train_command import parse  # noqa: E402
from support import bare_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def default():
    return bare_config(SFT, steps=7, optim=dict(learning_rate=0.01, warmup_steps=3))


# ----------------------------------------------------------------------------- defaults


def test_config_type_is_cached_and_carries_algo_settings():
    cls = api.config_type(SFT)
    assert cls is api.config_type(SFT) and cls is api.config_type("sft")
    assert cls.__name__ == "SFTRunConfig"
    assert issubclass(cls, config.Config)
    assert isinstance(cls().algo, SFTConfig)


def test_every_algorithm_has_a_run_config_typed_by_its_settings():
    """``Config.algo`` is typed by algorithm: a class written in the algorithm's module (no
    dataclass made at run time), whose ``algo`` field is the algorithm's ``Config``."""
    import typing

    from nnx_posttrain import algorithms

    for cls in algorithms.ALGORITHMS.values():
        run_config = cls.RunConfig
        assert issubclass(run_config, config.Config)
        assert run_config.__module__ == cls.__module__, cls.name
        assert typing.get_type_hints(run_config)["algo"] is cls.Config, cls.name
        assert type(run_config().algo) is cls.Config


def test_config_for_overrides_only_named_fields(default):
    assert default.steps == 7
    assert default.optim.learning_rate == 0.01 and default.optim.warmup_steps == 3
    base = config.OptimConfig()
    assert default.optim.schedule == base.schedule and default.optim.b2 == base.b2
    assert default.batching == config.BatchingConfig()
    # a fresh default is not affected by another experiment's overrides
    assert bare_config(SFT).optim.learning_rate == config.OptimConfig().learning_rate


def test_parse_without_args_returns_the_defaults(default):
    assert parse(default, args=[]) == default


def test_overrides_top_level_and_nested(default):
    cfg = parse(
        default,
        args=["--steps", "5", "--optim.learning-rate", "0.5", "--lora.rank", "4",
              "--batching.max-length", "16", "--seed", "3", "--data", "chats.jsonl"],
    )
    assert cfg.steps == 5 and cfg.seed == 3 and cfg.data == "chats.jsonl"
    assert cfg.optim.learning_rate == 0.5
    assert cfg.optim.warmup_steps == 3  # untouched experiment default survives
    assert cfg.lora.rank == 4
    assert cfg.batching.max_length == 16
    assert cfg.batching.batch_size == default.batching.batch_size
    assert type(cfg) is type(default) and isinstance(cfg.algo, SFTConfig)


def test_flags_and_choices(default):
    cfg = parse(
        default,
        args=["--resume", "--eval-only", "--batching.no-shuffle", "--batching.truncation", "keep_end",
              "--dtype", "bfloat16", "--eval-data", "held.jsonl", "--lora.alpha", "16"],
    )
    assert cfg.resume is True and cfg.eval_only is True
    assert cfg.batching.shuffle is False
    assert cfg.batching.truncation == "keep_end"
    assert cfg.dtype == "bfloat16"
    assert cfg.eval_data == "held.jsonl"
    assert cfg.lora.alpha == 16.0


def test_unknown_option_is_rejected_by_name(default, capsys):
    with pytest.raises(SystemExit) as info:
        parse(default, args=["--no-such-option", "1"])
    assert info.value.code != 0
    assert "--no-such-option" in capsys.readouterr().err


def test_ill_typed_value_is_rejected_by_name(default, capsys):
    with pytest.raises(SystemExit) as info:
        parse(default, args=["--steps", "x"])
    assert info.value.code != 0
    assert "--steps" in capsys.readouterr().err


def test_invalid_choice_is_rejected(default, capsys):
    with pytest.raises(SystemExit):
        parse(default, args=["--dtype", "float16"])
    assert "--dtype" in capsys.readouterr().err


def test_validate_batch_size_multiple_of_grad_accum(default):
    with pytest.raises(errors.ConfigError) as info:
        parse(default, args=["--batching.batch-size", "6", "--batching.grad-accum", "4"])
    msg = str(info.value)
    assert "--batching.batch-size (6)" in msg and "--batching.grad-accum (4)" in msg
    cfg = parse(default, args=["--batching.batch-size", "8", "--batching.grad-accum", "4"])
    assert (cfg.batching.batch_size, cfg.batching.grad_accum) == (8, 4)


def test_validate_reports_every_problem_at_once(default):
    bad = dataclasses.replace(
        default,
        steps=-1,
        log_every=0,
        lora=dataclasses.replace(default.lora, rank=-2),
        batching=dataclasses.replace(default.batching, max_length=1, grad_accum=0),
    )
    with pytest.raises(errors.ConfigError) as info:
        bad.validate()
    msg = str(info.value)
    assert msg.startswith("invalid configuration:")
    for option in ("--steps", "--log-every", "--lora.rank", "--batching.max-length", "--batching.grad-accum"):
        assert option in msg
    assert default.validate() is default


@pytest.mark.parametrize(
    "args, option",
    [
        (["--steps", "-1"], "--steps"),
        (["--batching.max-length", "1"], "--batching.max-length"),
        (["--optim.learning-rate", "-0.1"], "--optim.learning-rate"),
        (["--batching.batch-size", "0"], "--batching.batch-size"),
    ],
)
def test_parse_validates(default, args, option):
    with pytest.raises(errors.ConfigError) as info:
        parse(default, args=args)
    assert option in str(info.value)


def test_save_writes_the_full_config(default, tmp_path):
    cfg = parse(default, args=["--lora.rank", "4"])
    path = tmp_path / "config.json"
    config.save(cfg, path)
    saved = json.loads(path.read_text())
    assert saved["algo_name"] == "SFTConfig"
    assert saved["steps"] == 7 and saved["lora"]["rank"] == 4
    assert saved["optim"]["learning_rate"] == 0.01


# ----------------------------------------------------------------------------- the SFT entry point


def help_options(text: str) -> dict[str, str]:
    """'--option' -> its help text (box borders removed, wrapped lines joined)."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("│"):  # a box's line (a UTF-8 terminal)
            body = line.strip("│").rstrip()
        elif line.startswith(" ") and line.strip(" -─"):  # the same without borders (ASCII)
            body = line[1:].rstrip()
        else:  # box borders and text outside the boxes end an entry
            current = None
            continue
        # an option starts in the first column of the box; its wrapped help lines are indented
        m = re.match(r" (-h, )?(--[a-z0-9.-]+)", body)
        if m:
            current = m.group(2)
            entries[current] = body.strip()
        elif current is not None:
            entries[current] += " " + body.strip()
    return entries


def test_sft_help_lists_common_options_with_defaults(capsys, monkeypatch):
    from support import command_output

    code, out, err = command_output(capsys, monkeypatch, ["sft", "--help"], columns=80,
                                    command_prog="python -m experiments.sft")
    assert code == 0, err[-2000:]
    options = help_options(out)
    expected = {
        "--model": "gemma_tiny",
        "--data": "builtin",
        "--run-dir": "''",
        "--steps": "1500",
        "--seed": "0",
        "--resume": "False",
        "--eval-only": "False",
        "--optim.learning-rate": "0.001",
        "--lora.rank": "0",
    }
    for option, value in expected.items():
        assert option in options, f"{option} missing from --help:\n{out}"
        m = re.search(r"\(default: (.*?)\)", options[option])
        assert m, f"no default shown for {option}: {options[option]!r}"
        assert m.group(1) == value, (option, options[option])


def test_the_old_name_of_the_batching_settings_still_imports_with_a_deprecation():
    with pytest.warns(DeprecationWarning, match="DataConfig is now BatchingConfig"):
        from nnx_posttrain.config import DataConfig
    assert DataConfig is config.BatchingConfig
    assert isinstance(config.Config().batching, config.BatchingConfig)
