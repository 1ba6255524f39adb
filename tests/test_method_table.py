"""The statistics of the method table: the paired bootstrap over seeds and held-out problems, and
the table built from run directories (no training here: runs are written by hand)."""

import json

import numpy as np
import pytest

from tools import ToolError, exit_status
from tools import preference_table as T
from tools import seeds as S


def _side(correct):
    return {f"k{i}": int(c) for i, c in enumerate(correct)}


def test_identical_sides_show_no_effect():
    rng = np.random.default_rng(0)
    pairs = [(_side(c), _side(c)) for c in rng.random((3, 500)) < 0.5]
    result = S.paired_bootstrap(pairs, reps=2000)
    assert result == {"diff": 0.0, "low": 0.0, "high": 0.0, "significant": False}


def test_a_real_gain_is_significant_and_inside_its_interval():
    rng = np.random.default_rng(1)
    pairs = []
    for _ in range(3):
        base = rng.random(500) < 0.5
        better = base.copy()
        better[np.flatnonzero(~base)[:50]] = True  # 50 more of 500 problems right: +10 points
        pairs.append((_side(better), _side(base)))
    result = S.paired_bootstrap(pairs, reps=2000)
    assert result["diff"] == pytest.approx(0.1)
    assert result["significant"] and result["low"] < 0.1 < result["high"]


def test_false_positive_rate_is_near_the_nominal_five_percent():
    """Two methods equally good (each problem right with probability 0.5, independently): the
    95% interval should exclude 0 in about 5% of tables."""
    rng = np.random.default_rng(2)
    hits = 0
    trials = 200
    for t in range(trials):
        pairs = [(_side(rng.random(300) < 0.5), _side(rng.random(300) < 0.5)) for _ in range(3)]
        hits += S.paired_bootstrap(pairs, reps=500, seed=t)["significant"]
    assert hits / trials < 0.12


def test_pairing_uses_the_shared_problems_only():
    a = {"x": 1, "y": 1, "z": 0}
    b = {"y": 0, "z": 0, "w": 1}
    assert S.paired_bootstrap([(a, b)], reps=100)["diff"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="share no held-out problem"):
        S.paired_bootstrap([({"x": 1}, {"y": 1})], reps=10)


def test_mean_std_is_the_sample_std():
    assert S.mean_std([0.5, 0.7]) == pytest.approx((0.6, np.std([0.5, 0.7], ddof=1)))
    assert S.mean_std([0.4]) == (0.4, 0.0)


def _fake_run(run_dir, before, after, **last_metrics):
    run_dir.mkdir(parents=True)
    keys = [f"{i:08x}" for i in range(len(before))]
    rows = [{"step": 0, "split": "eval", "exact_match": float(np.mean(before))},
            {"step": 10, "split": "train", "loss": 1.0, **({"reward": 0.2} if "reward" in last_metrics else {})},
            {"step": 20, "split": "eval", "exact_match": float(np.mean(after)),
             **{k: v for k, v in last_metrics.items() if k != "reward"}}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "exact_match.jsonl").write_text("".join(
        json.dumps({"step": step, "exact_match": float(np.mean(c)), "keys": keys,
                    "correct": [int(x) for x in c]}) + "\n"
        for step, c in ((0, before), (20, after))))
    (run_dir / "finished.json").write_text(json.dumps({"command": [], "seconds": 12.0}))


def test_table_from_runs_baseline_control_and_a_better_method(tmp_path):
    rng = np.random.default_rng(3)
    for s in range(2):
        start = rng.random(400) < 0.5
        more = start.copy()
        more[np.flatnonzero(~start)[:80]] = True
        _fake_run(tmp_path / f"seed{s}" / "sft", start, start)
        _fake_run(tmp_path / f"seed{s}" / "dpo_lr0", start, start, **{"rewards/accuracies": 0.5})
        _fake_run(tmp_path / f"seed{s}" / "grpo", start, more, reward=0.5)
    raw = T.collect(tmp_path, ["sft", "dpo_lr0", "grpo"], 2)
    columns, rows, stats = T.summarise(raw, 2, reps=1000)
    table = {row[0]: dict(zip(columns, row)) for row in rows}
    assert table["sft continued (baseline)"]["vs continued SFT [95% CI]"] == "(baseline)"
    control = table["dpo, learning rate 0 (control)"]
    assert control["change from the SFT start [95% CI]"] == "+0.0 [+0.0, +0.0]"
    assert control["significant vs continued SFT"] == "no"
    assert control["preference accuracy (held-out pairs)"] == "50.0 ± 0.0%"
    grpo = table[T.LABELS["grpo"]]
    assert grpo["significant vs continued SFT"] == "yes"
    assert grpo["vs continued SFT [95% CI]"].startswith("+20.0 [")
    assert grpo["train reward first -> last"] == "0.20 -> 0.20"
    assert grpo["wall time / run"] == "12 s"
    assert stats["grpo"]["vs_baseline"]["significant"]
    assert T._check_control(stats)[0].startswith("Control:")
    stats["dpo_lr0"]["change"]["diff"] = 0.01
    assert T._check_control(stats)[0].startswith("CONTROL FAILED")


def test_unknown_method_is_refused():
    with pytest.raises(ToolError, match="unknown.*nope"):
        T.main(["--methods", "dpo,nope", "--record", "none"])


def _fake_sft(run_dir, seed, args, correct_of):
    """A finished default-run directory (what tools.seeds.run_experiment would leave)."""
    from nnx_posttrain import chat
    from nnx_posttrain.tasks import arithmetic

    run_dir.mkdir(parents=True)
    problems = arithmetic.problems("eval")
    keys = [S.prompt_key(chat.render([{"role": "user", "content": arithmetic.question(a, b)}],
                                     "gemma", add_generation_prompt=True)) for a, b in problems]
    final = [correct_of(a, b) for a, b in problems]
    rows = [{"step": 0, "split": "eval", "loss": 6.0, "exact_match": 0.0},
            {"step": 10, "split": "eval", "loss": 0.5, "exact_match": float(np.mean(final))}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "exact_match.jsonl").write_text(json.dumps(
        {"step": 10, "exact_match": rows[1]["exact_match"], "keys": keys, "correct": final}) + "\n")
    command = ["-m", "experiments.sft", "--run-dir", str(run_dir), "--seed", str(seed), *args]
    (run_dir / "finished.json").write_text(json.dumps({"command": command, "seconds": 60.0 + seed}))


def test_default_run_table_range_and_plateau_from_finished_runs(tmp_path):
    from nnx_posttrain.tasks import arithmetic
    from tools import default_run

    for s in range(2):
        _fake_sft(tmp_path / f"seed{s}", s, [], lambda a, b: int(not arithmetic.carries(a, b)))
        # the perturbed runs also get one carry problem in ten right
        _fake_sft(tmp_path / f"seed{s}_perturbed", s, ["--logprob-chunk", "2"],
                  lambda a, b: int(not arithmetic.carries(a, b) or (a + b) % 10 == 0))
    data = default_run.main(["--seeds", "2", "--out", str(tmp_path), "--record", "none"])
    share = np.mean([not arithmetic.carries(a, b) for a, b in arithmetic.problems("eval")])
    assert data["final"] == {0: pytest.approx(share), 1: pytest.approx(share)}
    assert data["std"] == 0.0 and all(d > 0 for d in data["deltas"].values())
    low, high = data["range"]
    assert low == pytest.approx(share - 0.03)
    assert high == pytest.approx(max(data["final_perturbed"].values()) + 0.03)
    split = data["carry_split"][0]
    assert split == {"carry_free": 1.0, "carry": 0.0, "carry_free_share": pytest.approx(share)}


@pytest.mark.parametrize("method", T.METHODS)
def test_every_row_is_a_command_its_experiment_accepts(method):
    from nnx_posttrain.cli.train_command import config_from

    name, args = T.method_command(method, 20)
    args = ["--seed", "1", "--init-from", "runs/x", *args]
    cfg = config_from(name, args, name)
    assert cfg.steps == 20 and cfg.seed == 1
    if method in T.VARIANTS:  # the variant's own setting reached its algorithm's config
        option, value = T.VARIANTS[method][1]
        field = option.removeprefix("--algo.").replace("-", "_")
        assert getattr(cfg.algo, field) == value
    if method == T.CONTROL:
        assert cfg.optim.learning_rate == 0


def test_the_baseline_continues_sft_for_the_preference_recipes_steps():
    name, args = T.method_command(T.BASELINE, None)  # the README's table passes no --steps
    assert name == "sft" and args[args.index("--steps") + 1] == "200"  # dpo.yaml's steps


def test_the_helpers_raise_a_typed_error_that_the_command_turns_into_its_exit(tmp_path, capsys):
    with pytest.raises(ToolError, match="exact_match.jsonl does not exist"):
        S.per_problem(tmp_path)
    with pytest.raises(ToolError, match="^--seeds must be >= 1$"):
        T.main(["--seeds", "0", "--record", "none"])
    assert exit_status(T.main, ["--seeds", "0", "--record", "none"]) == 1
    assert capsys.readouterr().err == "error: --seeds must be >= 1\n"
