"""The image table (``tools.image_table``): its runs are commands the experiments accept (the
image task's recipes, ``nnx_posttrain/tasks/recipes/shapes``), and its table is built from
finished run directories (written by hand here: no training); ``--init-from`` reads a Gemma 3
vision run, whose state holds a plain array beside its variables."""

import json

import numpy as np
import pytest

from tools import image_table as T
from tools import preference_table as P
from tools import seeds as S


def _finished(run_dir, name, args, evals, reward=None):
    """A finished run directory as ``tools.seeds.run_experiment`` leaves it: ``evals`` maps an
    eval step to its per-problem answers (0/1)."""
    run_dir.mkdir(parents=True)
    keys = [f"{i:08x}" for i in range(len(next(iter(evals.values()))))]
    rows = [{"step": step, "split": "eval", "exact_match": float(np.mean(c))}
            for step, c in evals.items()]
    for i, value in enumerate(reward or ()):  # the logged training steps' sampled reward
        rows.insert(1 + i, {"step": 5 * (i + 1), "split": "train", "reward": value})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "exact_match.jsonl").write_text("".join(
        json.dumps({"step": step, "exact_match": float(np.mean(c)), "keys": keys,
                    "correct": [int(x) for x in c]}) + "\n" for step, c in evals.items()))
    command = ["-m", f"experiments.{name}", "--run-dir", str(run_dir), *args]
    (run_dir / "finished.json").write_text(json.dumps({"command": command, "seconds": 30.0}))


@pytest.mark.slow
def test_the_table_from_finished_runs(tmp_path):
    rng = np.random.default_rng(0)
    for seed in range(2):
        sft, grpo, more = T.jobs(tmp_path.resolve(), seed, None, None)
        learnt = rng.random(200) < 0.8
        better = learnt.copy()
        better[np.flatnonzero(~learnt)[:10]] = True  # GRPO: 10 more of 200 right, +5 points
        _finished(sft[1], "sft", sft[2], {0: np.zeros(200), 300: learnt})
        _finished(grpo[1], "grpo", grpo[2], {0: learnt, 60: better},
                  reward=(0.7, 0.7, 0.7, 0.5, 0.8, 0.8, 0.8))
        _finished(more[1], "sft", more[2], {0: learnt, 30: learnt})  # the control: no change
    stats = T.main(["--seeds", "2", "--out", str(tmp_path), "--record", "none", "--reps", "500"])
    assert stats["untrained"]["em"] == [0.0, 0.0]
    assert stats["sft"]["change"]["significant"] and stats["sft"]["change"]["diff"] > 0.7
    assert stats["grpo"]["change"]["diff"] == pytest.approx(0.05)
    assert stats["grpo"]["change"]["significant"]
    assert stats["sft_more"]["change"]["diff"] == 0.0
    assert stats["grpo_vs_sft_more"]["diff"] == pytest.approx(0.05)
    assert stats["grpo"]["train_reward"] == [pytest.approx((0.7, 0.8))] * 2  # first, last 3
    assert "untrained" not in stats["untrained"]  # the first row compares with nothing
    split = T.teacher_split(P.collect(tmp_path, ["sft", "grpo", "sft_more"], 2), 2)
    share = split["confused_share"]
    assert share == pytest.approx(45 / 200)  # the held-out problems the teacher may slip on
    for name, em in (("sft", "em"), ("grpo", "em")):  # the two parts make up the whole
        whole = [share * c + (1 - share) * o
                 for c, o in zip(split[name]["confused"], split[name]["other"])]
        assert whole == pytest.approx(stats[name]["em"])


def test_the_runs_are_commands_the_experiments_accept(monkeypatch):
    from nnx_posttrain.cli.train_command import config_from

    monkeypatch.chdir(S.ROOT)  # the recipes' paths are the repository's, as the runs read them

    (sft_name, sft_dir, sft_args), (grpo_name, _, grpo_args), (_, _, more_args) = T.jobs(
        S.ROOT / "runs" / "x", 1, 4, 2)
    sft = config_from(sft_name, sft_args, sft_name)
    assert (sft.model, sft.data, sft.eval_data) == ("gemma3_vision_tiny", "builtin:shapes",
                                                   "builtin:shapes")
    assert sft.steps == 4 and sft.seed == 1 and sft.train_vision and sft.eval.exact_match
    grpo = config_from(grpo_name, grpo_args, grpo_name)
    assert grpo.init_from == str(sft_dir) and grpo.steps == 2
    assert grpo.algo.rewards == "exact_match" and grpo.model == sft.model
    more = config_from("sft", more_args, "sft")  # as many pictures as GRPO's 2 steps prompt
    assert more.init_from == str(sft_dir) and more.optim.learning_rate == grpo.optim.learning_rate
    prompts = grpo.batching.batch_size // grpo.algo.num_generations
    assert more.steps == -(-2 * prompts // more.batching.batch_size)


@pytest.mark.slow
def test_the_blind_answer_is_the_most_frequent_count():
    blind = T.blind_answer()
    assert blind["answer"] in (0, 1) and 0.3 < blind["exact_match"] < 0.5


def test_init_from_reads_a_vision_models_state():
    """Gemma 3's vision embedding keeps its position ids as a plain array in the state: the
    weights copied by ``--init-from`` are the variables, every one of them."""
    from flax import nnx

    from nnx_posttrain import model, tasks

    tasks.register()
    lm = model.load("gemma3_vision_micro")
    named = model.named_variables(nnx.state(lm.module))
    assert set(named) == {v.path for v in lm.module.weights}
