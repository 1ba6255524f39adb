"""The distillation table's machinery (no training here): every row is a command its experiment
accepts, the rows of a student differ only in what they distil, and the table's statistics."""

import dataclasses
from pathlib import Path

import pytest

from tools import distill_table as D


def _settings(cfg, prefix=""):
    out = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        out.update(_settings(value, f"{prefix}{field.name}.") if dataclasses.is_dataclass(value)
                   else {prefix + field.name: value})
    return out


@pytest.mark.parametrize("student", sorted(D.STUDENTS))
def test_a_students_rows_differ_only_in_what_they_distil(student):
    from nnx_posttrain.cli.train_command import config_from

    settings = {}
    for row in D.ROWS:
        name, args = D.row_command(row, student, Path("answers.jsonl"), Path("runs/teacher"),
                                   Path("runs/start"), 200)
        cfg = config_from(name, ["--seed", "1", *args], name)
        settings[row] = {k: v for k, v in _settings(cfg).items() if not k.startswith("algo")}
        if name == "distill":
            assert cfg.algo.teacher == "runs/teacher"
            assert cfg.algo.lmbda == float(D.LMBDA[row])
            assert cfg.algo.beta == float(D.BETA.get(row, 1.0))
    assert settings["sft"]["model"] == ("gemma_tiny" if student == "a" else D.SMALL)
    assert settings["sft"]["init_from"] == ("runs/start" if student == "a" else "")
    assert settings["sft"]["steps"] == 200
    for row in D.ROWS[1:]:
        differ = {k for k in settings[row] if settings[row][k] != settings["sft"][k]}
        assert differ == ({"data", "eval_data"} if row == "seq_kd" else set()), row


def _run(before, after, em_before, em_after, seconds=10.0):
    side = lambda bits: {f"k{i}": int(b) for i, b in enumerate(bits)}  # noqa: E731
    return {"em_before": em_before, "em_after": em_after, "before": side(before),
            "after": side(after), "seconds": seconds}


def test_the_table_reports_the_gain_over_the_baseline_and_the_share_of_the_teachers():
    n = 100
    start = [1] * 60 + [0] * 40  # 60% at the start, the teacher at 100%
    raw = {}
    for student in D.STUDENTS:
        for row in D.ROWS:
            right = 60 if row == "sft" else 90 if row == "on_policy" else 70
            raw[f"{student}_{row}"] = {s: _run(start, [1] * right + [0] * (n - right), 0.6,
                                               right / n) for s in range(2)}
    teacher = {s: {"em_after": 1.0, "seconds": 30.0} for s in range(2)}
    columns, rows, stats = D.summarise(raw, teacher, 2, reps=500)
    assert len(rows) == 2 * len(D.ROWS) and len(columns) == len(rows[0])
    on_policy = stats["a_on_policy"]
    assert on_policy["recovered"] == pytest.approx(0.75)  # (0.9 - 0.6) / (1.0 - 0.6)
    assert on_policy["vs_baseline"]["diff"] == pytest.approx(0.3)
    assert on_policy["vs_baseline"]["significant"]
    assert stats["a_sft"]["recovered"] == 0.0 and "vs_baseline" not in stats["a_sft"]
    text = " ".join(D.reading(stats))
    assert "on-policy distillation (lmbda 1) (+30.0 points)" in text
    assert "Teacher (grpo from the SFT start): 100.0 ± 0.0%" in text
