"""The built-in agentic task (nnx_posttrain.tasks.multiply) and its table's machinery (no
training here): the files, the demonstrations' tokens and loss, the same prompt for SFT and for
the tool runs, every run of the table a valid command, and the table's statistics."""

import json
from pathlib import Path

import pytest

from nnx_posttrain import data, model
from nnx_posttrain.tasks import multiply
from tools import agent_table as A


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return multiply.write_files(tmp_path_factory.mktemp("multiply"))


@pytest.fixture(scope="module")
def tokenizer():
    return model.load_tokenizer("gemma_tiny_tools")


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_the_files_hold_disjoint_problems_with_the_product(files):
    train, held_out = _read(files["prompts"]), _read(files["eval"])
    assert len(held_out) == multiply.EVAL_SIZE and len(train) == 8100 - multiply.EVAL_SIZE
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held_out}
    tools = _read(files["sft_tools"])[0]
    a, b = (int(x) for x in tools["messages"][0]["content"][8:-1].split(" x "))
    assert tools["messages"][2]["content"] == tools["messages"][3]["content"] == str(a * b)
    assert tools["tools"] == [multiply.schema()] and multiply.multiply(a, b) == a * b


@pytest.mark.slow
def test_a_demonstration_learns_the_call_and_the_answer_never_the_result(files, tokenizer):
    record = _read(files["sft_tools"])[0]
    example = data.Tokenize(tokenizer, "gemma", 160)(record)
    ids, mask = example["input_ids"], example["loss_mask"]
    learned = tokenizer.decode([int(t) for t, m in zip(ids, mask) if m])
    product = record["messages"][2]["content"]
    assert learned == ('{"name": "multiply", "parameters": {"a": %d, "b": %d}}<end_of_turn>%s'
                       "<end_of_turn>" % (*record["messages"][1]["tool_calls"][0]["function"]
                                          ["arguments"].values(), product))
    assert int(example["attention_mask"].sum()) < 160  # nothing truncated: ~130 tokens


def test_the_tool_runs_prompt_is_the_demonstrations_prompt(files, tokenizer):
    """GRPO with --algo.tools renders the same prompt the tool demonstrations were trained on."""
    from types import SimpleNamespace

    from nnx_posttrain.algorithms.online import agentic
    from nnx_posttrain.sampling import sampler

    lm = SimpleNamespace(tokenizer=tokenizer, chat_format="gemma")
    tools = agentic.toolset(SimpleNamespace(tools="nnx_posttrain.tasks.multiply:multiply",
                                            environment="", tool_timeout=1.0))
    cfg = SimpleNamespace(max_completion_length=48, max_tool_calling_iterations=2)
    rollouts = agentic.ToolRollouts(tools, lm, cfg, 160)
    prompt = _read(files["prompts"])[0]
    ours = rollouts.encode(prompt, tools.open([prompt])[0])
    demo = dict(_read(files["sft_tools"])[0])
    assert demo["messages"][0] == prompt["prompt"][0]
    from nnx_posttrain import chat

    head = chat.render(demo["messages"][:1], "gemma", add_generation_prompt=True,
                       tools=demo["tools"])
    assert ours == sampler.encode_prompt(lm, head)
    assert len(ours) < 100


def test_every_run_of_the_table_is_a_valid_command_and_the_tool_is_the_only_difference():
    from nnx_posttrain.cli.train_command import config_from

    (sft_plain, sft_tools), (grpo_plain, grpo_tools) = A.jobs(
        Path("out"), {k: Path(f"{k}.jsonl") for k in ("sft_tools", "sft_plain", "prompts", "eval")},
        1, 250, 60)
    cfgs = {run[1].name: config_from(run[0], run[2], run[0])
            for run in (sft_plain, sft_tools, grpo_plain, grpo_tools)}
    assert cfgs["sft_tools"].data == "sft_tools.jsonl" and cfgs["sft_tools"].steps == 250
    assert cfgs["grpo_tools"].init_from == str(Path("out/seed1/sft_tools"))
    assert cfgs["grpo_tools"].algo.tools == A.TOOL and not cfgs["grpo_plain"].algo.tools
    assert cfgs["grpo_tools"].model == cfgs["grpo_plain"].model == "gemma_tiny_tools"
    assert cfgs["grpo_tools"].optim == cfgs["grpo_plain"].optim


def test_the_table_compares_each_row_with_the_direct_answers(tmp_path):
    side = lambda right: {f"k{i}": int(i < right) for i in range(100)}  # noqa: E731
    raw = {"grpo_plain": {s: {"em_before": 0.05, "em_after": 0.06, "before": side(5),
                              "after": side(6), "train_reward": (0.01, 0.02)} for s in range(2)},
           "grpo_tools": {s: {"em_before": 0.8, "em_after": 0.95, "before": side(80),
                              "after": side(95), "train_reward": (0.4, 0.5)} for s in range(2)}}
    for s in range(2):
        run = tmp_path / f"seed{s}" / "grpo_tools"
        run.mkdir(parents=True)
        rows = [{"step": 5, "split": "train", "tools/call_frequency": 0.9,
                 "tools/failure_frequency": 0.2},
                {"step": 10, "split": "train", "tools/call_frequency": 1.0,
                 "tools/failure_frequency": 0.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns, rows, stats = A.summarise(raw, tmp_path, 2, reps=500)
    assert [r[0] for r in rows] == [A.LABELS[name] for name, _, _ in A.ROWS]
    assert rows[3][1] == "95.0 ± 0.0%" and rows[3][4] == "0.40 → 0.50"
    assert rows[3][5] == "0.90 → 1.00" and rows[3][6] == "0.20 → 0.00" and rows[2][4] == ""
    assert stats["grpo_tools"]["vs_baseline"]["diff"] == pytest.approx(0.90)
    assert stats["grpo_tools"]["vs_baseline"]["significant"] and len(columns) == len(rows[0])
    assert stats["grpo_vs_sft_tools"]["diff"] == pytest.approx(0.15)
    assert A.reading(stats).startswith("GRPO with the tool against its SFT start: held-out exact "
                                       "match +15.0 [")
