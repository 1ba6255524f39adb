"""lm-evaluation-harness on our own forward and sampler (nnx_posttrain.harness): the same
log-likelihoods, greedy flags and task scores as lm-eval's own ``hf`` backend on the exported
model, nnx_arithmetic equal to the training evaluation's exact match problem by problem, the
command's result file; and head-to-head win rates under the three kinds of judge."""

import json

import nnx_posttrain  # noqa: F401
import numpy as np
import pytest

from nnx_posttrain import errors, model
from nnx_posttrain.harness import judge as J

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from nnx_posttrain.harness.evaluate import (  # noqa: E402
    Evaluation, arithmetic_task, evaluate, scores, task_manager)
from nnx_posttrain.harness.lm import NNXLM  # noqa: E402


@pytest.fixture(scope="module")
def micro_lm():
    lm = model.load("gemma_micro", seed=0)
    return lm, NNXLM(lm, lm.module, "gemma_micro", batch_size=4)


@pytest.fixture(scope="module")
def hf_lm(micro_lm, tmp_path_factory):
    """lm-eval's own hf backend on the micro model exported to Hugging Face's format."""
    from lm_eval.models.huggingface import HFLM

    from nnx_posttrain.export import hf as hf_export

    out = tmp_path_factory.mktemp("hf")
    hf_export.export_model(micro_lm[0].task, out, "float32")
    return HFLM(pretrained=str(out), device="cpu", batch_size=4, dtype="float32")


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [("What is 12 + 30?", " 42"), ("<start_of_turn>user\nWhat is 9 + 9?", "18"),
         ("", "Hello there"), ("What is 47 + 38? ", "85 or so, surely")]
TEXTS = ["What is 12 + 30? 42. " * 30, "short"]


@pytest.mark.slow
def test_log_likelihoods_and_greedy_flags_equal_lm_evals_hf_backend(micro_lm, hf_lm):
    """Tolerance: 1e-4 absolute per request (float32 on both sides)."""
    ours, theirs = (lm.loglikelihood(requests("loglikelihood", PAIRS)) for lm in (micro_lm[1], hf_lm))
    np.testing.assert_allclose([o[0] for o in ours], [t[0] for t in theirs], atol=1e-4)
    assert [o[1] for o in ours] == [t[1] for t in theirs]
    micro_lm[1].max_length = hf_lm._max_length = 64  # several rolling windows
    try:
        rolling = [lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]))
                   for lm in (micro_lm[1], hf_lm)]
    finally:
        micro_lm[1].max_length, hf_lm._max_length = 4096, None
    np.testing.assert_allclose(rolling[0], rolling[1], atol=1e-3)


def choice_task(tmp_path):
    """A multiple-choice task on local data: each sum's right answer among three."""
    path = tmp_path / "choices.jsonl"
    rows = [{"question": f"What is {a} + {b}?", "choices": [str(a + b), str(a + b - 10),
                                                         str(a + b + 1)], "label": 0}
            for a, b in [(12, 30), (47, 38), (19, 57), (88, 35), (23, 41), (66, 27)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"task": "sums_choice", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(path)}}, "test_split": "test",
            "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc"}], "metadata": {"version": 1.0}}


@pytest.mark.slow
def test_a_local_task_scores_the_same_as_the_hf_backend(micro_lm, hf_lm, tmp_path):
    results = [lm_eval.simple_evaluate(model=lm, tasks=[choice_task(tmp_path)], log_samples=True,
                                       random_seed=0, task_manager=task_manager(tasks=()))
               for lm in (micro_lm[1], hf_lm)]
    assert scores(results[0]) == scores(results[1])
    ours, theirs = ([s["resps"] for s in r["samples"]["sums_choice"]] for r in results)
    np.testing.assert_allclose([x[0][0] for doc in ours for x in doc],
                               [x[0][0] for doc in theirs for x in doc], atol=1e-4)


@pytest.mark.slow
def test_nnx_arithmetic_answers_are_the_training_evaluations(micro_lm, tmp_path):
    """Problem by problem, the greedy answers lm-eval gets equal the ones exact match scores."""
    from nnx_posttrain import data
    from nnx_posttrain.sampling import generate

    lm, ours = micro_lm
    results = lm_eval.simple_evaluate(model=ours, tasks=[arithmetic_task(tmp_path)], limit=24,
                                      apply_chat_template=True, log_samples=True,
                                      task_manager=task_manager(tasks=()))
    src = data.source("builtin", "eval", builtin="sft")
    pairs = data.prompts_and_answers(src, lm.chat_format, 24)
    graphdef, *states = __import__("flax").nnx.split(lm.module)
    accuracy, texts = generate.exact_match(lm, generate.make_greedy(graphdef, 8), states, pairs, 8)
    samples = results["samples"]["nnx_arithmetic"]
    assert [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])] == texts
    assert scores(results)[0][2] == pytest.approx(accuracy)


@pytest.mark.slow
def test_the_command_writes_lm_evals_results_into_the_run(shared_run, tmp_path, capsys):
    import shutil

    from nnx_posttrain import cli, compare

    run = tmp_path / "run"
    shutil.copytree(shared_run("sft"), run)
    assert cli.main(["eval", str(run), "--tasks", "nnx_arithmetic", "--limit", "8"]) == 0
    written = json.loads((run / "lm_eval" / "step_4.json").read_text())
    assert written["nnx_posttrain"]["step"] == 4 and "nnx_arithmetic" in written["results"]
    assert "exact_match" in capsys.readouterr().out
    assert "| run | 4 | nnx_arithmetic | exact_match |" in compare.compare([run])["benchmarks"]
    with pytest.raises(errors.ConfigError, match="unknown to lm-evaluation-harness: no_such_task"):
        evaluate(run, ["no_such_task"])
    import yaml  # a user's task file, its data local: offline

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "sums_choice.yaml").write_text(yaml.safe_dump(choice_task(tmp_path)))
    result = evaluate(run, ["sums_choice"], Evaluation(include_path=str(tasks)))
    assert [row[:2] for row in scores(result)] == [("sums_choice", "acc")]


# -- win rates

def test_win_rate_counts_ties_half_with_a_bootstrap_interval():
    r = J.win_rate(np.array([1] * 60 + [0] * 20 + [-1] * 20), reps=2000)
    assert r["win_rate"] == pytest.approx(0.7) and (r["wins"], r["losses"], r["ties"]) == (60, 20, 20)
    assert r["low"] < 0.7 < r["high"] and r["high"] - r["low"] < 0.2


def test_the_exact_judge_and_a_pairwise_judge_in_both_orders():
    records = [{"prompt": "q", "answer": "42"}] * 3
    assert J.exact_verdicts(records, ["42", "41", "42"], ["41", "42", "42"]).tolist() == [1, -1, 0]
    first = lambda prompts, pairs: [0] * len(pairs)  # noqa: E731 - always the first shown
    assert J.pairwise_verdicts(first, "x", ["q"] * 3, ["a"] * 3, ["b"] * 3).tolist() == [0, 0, 0]
    longer = lambda prompts, pairs: [int(len(b) > len(a)) for a, b in pairs]  # noqa: E731
    assert J.pairwise_verdicts(longer, "x", ["q"] * 2, ["aa", "a"], ["a", "aa"]).tolist() == [1, -1]
    with pytest.raises(errors.ConfigError, match="must return one of 0, 1"):
        J.pairwise_verdicts(lambda p, c: [2] * len(c), "bad", ["q"], ["a"], ["b"])
    with pytest.raises(errors.DataError, match="needs an 'answer' column"):
        J.exact_verdicts([{"prompt": "q", "_where": "p.jsonl:1"}], ["1"], ["2"])


@pytest.mark.slow
def test_judge_writes_the_win_rate_from_both_sides(shared_run, tmp_path, capsys):
    from nnx_posttrain import cli
    from support import train_run, FAST_STEPS, MICRO

    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(shared_run("sft"), a)
    shutil.copytree(shared_run("sft_lora"), b)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {x} + 1?", "answer": str(x + 1)})
                               + "\n" for x in range(10, 26)))
    assert cli.main(["judge", str(a), str(b), "--prompts", str(prompts),
                     "--max-new-tokens", "4"]) == 0
    ab = json.loads((a / "judge" / "b.json").read_text())
    ba = json.loads((b / "judge" / "a.json").read_text())
    assert ab["judge"] == "exact" and ab["n"] == 16 and ab["wins"] == ba["losses"]
    assert ab["win_rate"] == pytest.approx(1 - ba["win_rate"])
    assert "win rate" in capsys.readouterr().out
    reward = tmp_path / "reward"
    train_run("reward", *MICRO, *FAST_STEPS, "--init-from", "", "--run-dir", reward,
              echo=lambda _: None)
    result = J.judge_runs(a, b, prompts, J.Judging(str(reward), max_new_tokens=4, reps=200))
    assert result["judge"] == str(reward) and result["n"] == 16

    # a sampled completion is scored as the reward model's training sequences end: the stop
    # token replaced by the template's end of turn (Gemma's "<end_of_turn>\n")
    from nnx_posttrain import chat, runs
    from nnx_posttrain.algorithms.online.rewards import RewardModelScore
    from nnx_posttrain.sampling import sampler

    loaded = runs.load(reward)
    scorer, lm = RewardModelScore(reward, loaded), loaded.lm
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    trained = sampler.encode_prompt(lm, chat.render(messages, "gemma"))
    prompt = sampler.encode_prompt(lm, chat.render(messages[:1], "gemma", add_generation_prompt=True))
    sampled = prompt + lm.tokenizer.encode("5") + [lm.tokenizer.token_id("<end_of_turn>")]
    expected = float(loaded.module(np.asarray([trained]), np.ones((1, len(trained)), np.int32))[0])
    got = scorer.score_rows([sampled])
    assert got[0] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(errors.ConfigError, match="not a reward-model run"):
        J.judge_runs(a, b, prompts, J.Judging(str(a)))


def test_what_a_user_gets_wrong_is_named_before_a_model_loads(tmp_path, monkeypatch):
    from nnx_posttrain.harness import evaluate as E

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(errors.ConfigError, match="no 'answer' column for the exact judge"):
        J.judge_runs(tmp_path / "a", tmp_path / "b", prompts)
    with pytest.raises(errors.ConfigError, match="expected 'exact', a reward-model run"):
        J.judge_runs(tmp_path / "a", tmp_path / "b", prompts, J.Judging("nonsense"))
    with pytest.raises(errors.ConfigError, match="--judge no_such_module_j:judge: cannot import "
                                                 "'no_such_module_j'"):
        J.judge_runs(tmp_path / "a", tmp_path / "b", prompts, J.Judging("no_such_module_j:judge"))
    with pytest.raises(errors.ConfigError, match="give at least one task"):
        E.evaluate(tmp_path, [])
    with pytest.raises(errors.ConfigError, match="--include-path nowhere: no such directory"):
        E.task_manager("nowhere")
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)
    with pytest.raises(errors.ConfigError, match=r'pip install -e "\.\[eval\]"'):
        E.require()
