"""Agents (nnx_posttrain.agents): tool schemas as transformers writes them, tool calls read per
chat format, the tool-calling loop's tokens and masks on a scripted sampler, calls that fail
(an exception, a timeout, a malformed call, an unknown tool) as text for the model, and GRPO /
RLOO runs with tools and environments through the real sampler."""

import json

import nnx_posttrain  # noqa: F401
import numpy as np
import pytest

from nnx_posttrain import agents, chat, errors
from nnx_posttrain.agents import Toolset, calls, function_schema

import agent_tools

FORMATS = ("qwen2.5", "qwen3", "llama3.1", "gemma")


# -- schemas

def documented(x: list[float], mode: str = "a", y: int | None = None, z: dict[str, int] = None,
               w: tuple[int, str] = None, flag: bool = False, u: int | str = 1) -> float:
    """Do something.

    With more to say.

    Args:
        x: The values,
            over two lines.
        mode: The mode.
        y: Maybe a number.
        z: A mapping.
        w: A pair.
        flag: A flag.
        u: Either.

    Returns:
        A number.
    """


@pytest.mark.parametrize("fn", [agent_tools.multiply, agent_tools.Counter().increment, documented])
def test_a_tool_schema_equals_transformers_get_json_schema(fn):
    from transformers.utils import get_json_schema

    assert function_schema(fn) == get_json_schema(fn)


def test_a_function_that_cannot_be_a_tool_is_named_with_its_parameter():
    with pytest.raises(agents.SchemaError, match="tool 'undocumented' has no docstring"):
        function_schema(agent_tools.undocumented)

    def untyped(a):
        """Doc.

        Args:
            a: A.
        """
    with pytest.raises(agents.SchemaError, match="tool 'untyped', parameter 'a' has no type hint"):
        function_schema(untyped)

    def undescribed(a: int):
        """Doc."""
    with pytest.raises(agents.SchemaError, match="parameter 'a' is not described"):
        function_schema(undescribed)

    def unresolved(a: "Undefined"):  # noqa: F821 - a name the user's module does not define
        """Doc.

        Args:
            a: A.
        """
    with pytest.raises(agents.SchemaError, match=r"tool 'unresolved': its type hints cannot be "
                                                 r"read \(calling .*unresolved at .*test_agents"
                                                 r".py:\d+\): NameError: name 'Undefined'"):
        function_schema(unresolved)


# -- calls in generated text, and the results' tokens

CALL = {"name": "multiply", "arguments": {"a": 37, "b": 12}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_rendered_by_the_format_parses_back(fmt):
    """What the chat template writes for an assistant's call is what the loop reads."""
    turn = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]}]
    written = [t for t, flag in chat.render(turn, fmt) if flag][0]
    written = written.removesuffix(chat.END_OF_TURN[fmt])
    assert calls.parse(written, fmt) == [CALL]
    assert calls.parse("444", fmt) == []


@pytest.mark.parametrize("fmt,text,error", [
    ("qwen3", "<tool_call>\n{\"name\": \"multiply\", \"arguments\": {\"a\": 1}", "not closed"),
    ("qwen3", "<tool_call>\n{name: multiply}\n</tool_call>", "not JSON"),
    ("qwen2.5", '<tool_call>\n{"arguments": {}}\n</tool_call>', '"name" string'),
    ("gemma", '{"name": "multiply", "parameters": [1, 2]}', "must be an object"),
    ("llama3.1", '{"name": "multiply", "parameters": {"a": 1', "not JSON"),
])
def test_a_malformed_call_is_named(fmt, text, error):
    with pytest.raises(agents.Malformed, match=error):
        calls.parse(text, fmt)


@pytest.mark.parametrize("fmt", ["llama3", "chatml", "mistral"])
def test_parse_refuses_a_format_whose_calls_it_does_not_read(fmt):
    with pytest.raises(chat.ChatFormatError, match=f"chat format '{fmt}': its tool calls are not "
                       "read from generated text; formats whose calls are: qwen2.5, qwen3, "
                       "llama3.1, gemma, gemma4, qwen3.5, qwen3.5-nothink, harmony"):
        calls.parse("<tool_call>", fmt)


def test_several_qwen_calls_and_a_call_after_text():
    text = ('Let me see.\n<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    assert calls.parse(text, "qwen3") == [{"name": "a", "arguments": {"x": 1}},
                                          {"name": "b", "arguments": {}}]
    assert calls.parse('I will call.\n{"name": "b", "parameters": {"y": 2}}', "gemma") == [
        {"name": "b", "arguments": {"y": 2}}]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_continuation_joins_a_call_turn_to_the_next_as_the_template_renders_them(fmt):
    """prompt + call turn + continuation(results) + answer == the whole conversation rendered."""
    results = [("multiply", "444")]
    messages = [{"role": "user", "content": "What is 37 x 12?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},
                {"role": "tool", "name": "multiply", "content": "444"},
                {"role": "assistant", "content": "444"}]
    segments = chat.render(messages, fmt)
    flagged = [i for i, (_, flag) in enumerate(segments) if flag]
    text = "".join(t for t, _ in segments)
    first_end = sum(len(t) for t, _ in segments[:flagged[0] + 1])
    second_start = sum(len(t) for t, _ in segments[:flagged[1]])
    assert text[first_end:second_start] == calls.continuation(fmt, results)


# -- the loop on a scripted sampler (no model)

class FakeTokenizer:
    """One token per character (ids = code points + 10); pad 0, eos 1, bos 2."""
    pad_id, eos_id, bos_id, vocab_size = 0, 1, 2, 100_000

    def encode(self, text):
        return [ord(c) + 10 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 10) for i in ids if i >= 10)

    def token_id(self, piece):
        return 1 if piece == "<end_of_turn>" else None


class FakeLM:
    chat_format = "gemma"
    tokenizer = FakeTokenizer()


def scripted(turns, n=256):
    """A sampler of ``n`` new tokens that answers row i's k-th call with ``turns[i][k]`` (text +
    eos), within the row's budget; records each call's contexts and budgets."""
    seen = []

    def sample(ids, mask, budget, turn):
        seen.append((ids.copy(), mask.copy(), budget.copy(), turn))
        out = {k: np.zeros((len(ids), n), np.int32) for k in ("completion_ids", "completion_mask")}
        out["finished"] = np.zeros(len(ids), bool)
        for i, script in enumerate(turns):
            if budget[i] == 0 or turn >= len(script):
                continue
            tokens = FakeTokenizer().encode(script[turn]) + [1]
            kept = tokens[:budget[i]]
            out["completion_ids"][i, :len(kept)] = kept
            out["completion_mask"][i, :len(kept)] = 1
            out["finished"][i] = len(kept) == len(tokens)
        return out
    sample.seen = seen
    return sample


def episodes(n, tools="agent_tools:multiply,agent_tools:slow,agent_tools:broken,"
                      "agent_tools:unprintable,agent_tools:exits", timeout=5.0):
    return Toolset(tools, timeout=timeout).open([{} for _ in range(n)])


def test_the_loop_appends_results_masks_them_and_continues_from_the_whole_context():
    call = '{"name": "multiply", "parameters": {"a": 37, "b": 12}}'
    sample = scripted([[call, "444"], ["12"]])
    prompts = [[2, 50, 51], [2, 60]]
    loop = agents.ToolLoop(FakeLM(), max_new_tokens=256, max_iterations=4)
    ex = loop(sample, prompts, episodes(2))
    tok = FakeTokenizer()
    suffix = tok.encode(calls.continuation("gemma", [("multiply", "444")]))
    first = tok.encode(call) + [1]
    row = first + suffix + tok.encode("444") + [1]
    assert ex.completion_ids[0, :len(row)].tolist() == row
    assert ex.completion_mask[0].sum() == len(row)
    assert ex.tool_mask[0, :len(row)].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * 4
    assert ex.completion_mask[1].sum() == 3 and ex.tool_mask[1, :3].tolist() == [1, 1, 1]
    assert ex.finished.tolist() == [True, True] and (ex.calls, ex.failures) == (1, 0)
    assert ex.messages[0] == [
        {"role": "assistant", "content": call, "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 12}}}]},
        {"role": "tool", "name": "multiply", "content": "444"},
        {"role": "assistant", "content": "444"}]
    # the second call continues row 0 only, from prompt + everything so far, left-padded
    ids, mask, budget, turn = sample.seen[1]
    assert turn == 1 and budget.tolist() == [256 - len(first) - len(suffix), 0]
    assert ids[0][mask[0] == 1].tolist() == prompts[0] + first + suffix


@pytest.mark.parametrize("text,expected", [
    ('{"name": "broken", "parameters": {"x": 3}}', "{'error': 'cannot handle 3'}"),
    ('{"name": "nowhere", "parameters": {}}', "{'error': 'Tool nowhere not found.'}"),
    ('{"name": "multiply", "parameters": {"a": 1', str({"error": "malformed tool call: the tool "
                                                       "call is not JSON (Expecting ',' delimiter)"})),
    ('{"name": "slow", "parameters": {"seconds": 2}}', "{'error': 'Tool slow timed out after "
                                                       "0.2 s.'}"),
    # user code misbehaving inside a call: a result whose str() raises, a sys.exit
    ('{"name": "unprintable", "parameters": {"x": 1}}', "{'error': 'no text'}"),
    ('{"name": "exits", "parameters": {"x": 1}}', "{'error': 'Tool exits called sys.exit(3).'}"),
])
def test_a_failed_call_is_text_for_the_model_and_counted(text, expected):
    sample = scripted([[text, "done"]])
    ex = agents.ToolLoop(FakeLM(), 256, 2)(sample, [[2, 40]], episodes(1, timeout=0.2))
    assert ex.messages[0][1]["content"] == expected
    assert (ex.calls, ex.failures) == (1, 1) and ex.messages[0][-1]["content"] == "done"


def test_the_iteration_limit_and_the_length_limit_end_a_row():
    call = '{"name": "multiply", "parameters": {"a": 1, "b": 2}}'
    ex = agents.ToolLoop(FakeLM(), 256, 1)(scripted([[call, call, "x"]]), [[2]], episodes(1))
    assert ex.calls == 1 and len(ex.messages[0]) == 3  # call, result, a call not run
    # a result that would leave no room ends the row as it is (TRL drops it too)
    room = len(call) + 1 + 5
    ex = agents.ToolLoop(FakeLM(), room, 3)(scripted([[call, "x"]], room), [[2]], episodes(1))
    assert ex.completion_mask[0].sum() == len(call) + 1 and ex.tool_mask[0].sum() == len(call) + 1
    assert len(ex.messages[0]) == 1 and ex.calls == 1


# -- environments

def test_environments_are_reset_per_rollout_and_score_from_their_state():
    tools = Toolset(environment="agent_tools:Counter")
    opened = tools.open([{"prompt": "p", "answer": "1"}, {"prompt": "q"}])
    assert [e.observation for e in opened] == [" (count starts at 0)"] * 2
    assert opened[0].environment is not opened[1].environment  # one instance per rollout
    assert opened[0].environment.record == {"prompt": "p", "answer": "1"}
    assert [s["function"]["name"] for s in opened[0].schemas] == ["increment"]
    assert opened[0].call("increment", {"by": 3}) == ("3", False)
    assert tools.rewarding() == [("Counter", agent_tools.Counter)]
    again = tools.open([{"prompt": "r"}])  # kept and reset: the pool's first instance
    assert again[0].environment is opened[0].environment and again[0].environment.count == 0


def test_a_mapping_of_environments_is_chosen_by_the_environment_column():
    tools = Toolset(environment="count=agent_tools:Counter,quiet=agent_tools:Quiet")
    opened = tools.open([{"environment": "quiet"}, {"environment": "count", "x": 1}])
    assert type(opened[0].environment).__name__ == "Quiet" and opened[0].observation is None
    assert opened[1].environment.record == {"x": 1}  # the choice is not a reset argument
    assert [s["function"]["name"] for s in opened[0].schemas] == ["ping"]
    with pytest.raises(errors.DataError, match="f.jsonl:4: field 'environment' is 'game'"):
        tools.open([{"environment": "game", "_where": "f.jsonl:4"}])


def test_an_environment_that_raises_is_named_with_the_record_and_the_line():
    tools = Toolset(environment="agent_tools:Failing")
    with pytest.raises(agents.EnvironmentFailed, match=r"--algo.environment Failing: reset failed "
                       r"for f.jsonl:3 at .*agent_tools.py:\d+: KeyError: 'level'"):
        tools.open([{"prompt": "p", "_where": "f.jsonl:3"}])


def test_an_environment_whose_reset_misbehaves_is_named_at_the_users_line():
    """reset returning a dict (not text or None), reset taking none of the record's columns
    (the call fails in this package, before a line of the user's runs): the user's file."""
    with pytest.raises(agents.EnvironmentFailed, match=r"--algo.environment DictReset: reset "
                       r"returned a dict for f.jsonl:2 \(reset at .*agent_tools.py:\d+\); it "
                       "returns text, appended to the last user message, or None"):
        Toolset(environment="agent_tools:DictReset").open([{"p": 1, "_where": "f.jsonl:2"}])
    with pytest.raises(agents.EnvironmentFailed, match=r"NoRecord: reset failed for f.jsonl:2 "
                       r"\(calling NoRecord.reset at .*agent_tools.py:\d+\): TypeError: "):
        Toolset(environment="agent_tools:NoRecord").open([{"p": 1, "_where": "f.jsonl:2"}])


@pytest.mark.parametrize("kwargs,message", [
    (dict(tools="agent_tools"), "expected 'module:name'"),
    (dict(tools="no_such_module:f"), "cannot import 'no_such_module'"),
    (dict(tools="agent_tools:nothing"), "has no 'nothing'"),
    (dict(tools="agent_tools:undocumented"), "tool 'undocumented' has no docstring"),
    (dict(environment="agent_tools:multiply"), "needs a reset"),
    (dict(environment="agent_tools:Counter,b=agent_tools:Quiet"), "name each class"),
])
def test_bad_tools_are_refused_by_name(kwargs, message):
    with pytest.raises(errors.ConfigError, match=message):
        Toolset(**kwargs)


# -- GRPO / RLOO with tools through the real sampler (the micro model; every token stops a turn,
# and every turn calls a tool: the loop's mechanics without a model trained to call)

@pytest.fixture
def calling(monkeypatch):
    """Turns of one token (every id is a stop id), each one a call of increment(by=2)."""
    from nnx_posttrain.agents import loop
    from nnx_posttrain.sampling import generate, sampler

    everything = lambda lm: list(range(lm.tokenizer.vocab_size))  # noqa: E731
    monkeypatch.setattr(sampler, "stop_ids", everything)
    monkeypatch.setattr(generate, "stop_ids", everything)
    monkeypatch.setattr(loop.calls_lib, "parse",
                        lambda text, fmt, tools=None: [{"name": "increment",
                                                        "arguments": {"by": 2}}])


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    from nnx_posttrain import data

    src = data.source("builtin", "train", builtin="prompt_only")
    path = tmp_path_factory.mktemp("agent") / "prompts.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in src[i].items() if not k.startswith("_")})
                            + "\n" for i in range(16)))
    return str(path)


def agent_run(algorithm, tmp_path, prompts_file, *extra):
    from support import MICRO, train_run

    return train_run(algorithm, *MICRO, "--init-from", "", "--data", prompts_file,
                     "--eval-data", prompts_file, "--batching.max-length", "256",
                     "--batching.batch-size", "8", "--algo.num-generations", "2",
                     "--algo.max-completion-length", "48", "--log-every", "1",
                     "--checkpoint.every", "0", "--eval.exact-match", "4",
                     "--run-dir", tmp_path / algorithm, *extra, recipe=False)


@pytest.mark.slow
def test_grpo_with_an_environment_masks_tool_results_and_scores_from_its_state(
        tmp_path, prompts_file, calling):
    import jax

    from nnx_posttrain import data

    result = agent_run("grpo", tmp_path, prompts_file, "--steps", "2", "--eval.every", "2",
                       "--algo.environment", "agent_tools:Counter",
                       "--algo.tools", "agent_tools:multiply",
                       "--algo.max-tool-calling-iterations", "1", "--algo.num-iterations", "2")
    for row in result.train:  # TRL's names; the environment's reward under its class name
        assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.0
        assert row["rewards/Counter/mean"] == 2.0 and row["completions/mean_length"] == 2.0
    logged = [json.loads(line) for line in (tmp_path / "grpo" / "completions.jsonl").open()]
    train = [r for r in logged if r["split"] == "train"]
    assert "```tool_output\n2\n```" in train[0]["completion"]  # the whole exchange is logged
    assert '"name": "increment"' in train[0]["prompt"] and "(count starts at 0)" in train[0]["prompt"]
    assert any(r["split"] == "eval" and r["rewards/Counter"] == 2.0 for r in logged)

    # the rollout's layout: tool-result tokens out of the loss; the continuation's sampled
    # log-probs (from the whole context, left-padded) = the training forward's at its position
    rollouts, state = result.source, result.state
    outputs = []
    original = rollouts._sample

    def recording(*args):
        outputs.append(jax.device_get(original(*args)))
        return outputs[-1]
    rollouts._sample = recording
    transform = data.TokenizePrompt(result.lm.tokenizer, result.lm.chat_format, 256)
    batch, _ = rollouts.rollout(7, state, next(data.train_batches(rollouts.train_src, transform,
                                                                  4, seed=0)))
    width = batch["input_ids"].shape[1] - 48
    completion_mask = batch["attention_mask"][:, width:]
    suffix = len(result.lm.tokenizer.encode(agents.continuation("gemma", [("increment", "2")])))
    for i in range(8):
        assert completion_mask[i].sum() == 2 + suffix
        assert batch["loss_mask"][i, width:].tolist() == [1] + [0] * suffix + [1] + [0] * (
            48 - 2 - suffix)
        assert batch["old_logps"][i, width] == pytest.approx(outputs[0]["logprobs"][i, 0], abs=2e-4)
        assert batch["old_logps"][i, width + 1 + suffix] == pytest.approx(
            outputs[1]["logprobs"][i, 0], abs=2e-4)


@pytest.mark.slow
def test_rloo_runs_tools_and_the_other_online_methods_refuse_them(tmp_path, prompts_file,
                                                                  calling, monkeypatch):
    from support import refusal

    result = agent_run("rloo", tmp_path, prompts_file, "--steps", "1", "--eval.every", "0",
                       "--algo.tools", "agent_tools:broken", "--algo.rewards", "exact_match")
    assert result.train[0]["tools/failure_frequency"] == 1.0  # increment is no tool here
    for name in ("ppo", "online_dpo"):
        assert "does not run tools" in refusal(name, "--algo.tools", "agent_tools:multiply",
                                               "--algo.rewards", "exact_match", recipe=False)
    message = refusal("grpo", "--model", "gemma_micro", "--chat-format", "llama3",
                      "--algo.tools", "agent_tools:multiply", "--algo.rewards", "exact_match",
                      "--steps", "1", "--run-dir", tmp_path / "llama3", recipe=False)
    assert "chat format 'llama3' has no tool-calling format" in message
    # a format that renders tool calls but whose calls the loop does not read (none today)
    monkeypatch.setattr(agents, "PARSED_FORMATS", ("qwen2.5", "qwen3", "llama3.1", "gemma"))
    message = refusal("grpo", "--model", "gemma_micro", "--chat-format", "harmony",
                      "--algo.tools", "agent_tools:multiply", "--algo.rewards", "exact_match",
                      "--steps", "1", "--run-dir", tmp_path / "harmony", recipe=False)
    assert "chat format 'harmony' renders tool calls for training, but the agent loop" in message
    assert "needs --algo.rewards" in refusal("grpo", "--algo.environment", "agent_tools:Quiet",
                                              recipe=False)
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt": "What is 2 x 3?"}\n')
    assert f"{text}:1: field 'prompt' must be a conversation" in refusal(
        "grpo", "--data", str(text), "--algo.tools", "agent_tools:multiply", "--algo.rewards",
        "length", recipe=False)


@pytest.mark.slow
def test_on_policy_distillation_samples_tool_calling_exchanges(tmp_path, monkeypatch, calling):
    """The student's samples go through the same loop: results out of the loss."""
    from nnx_posttrain.agents import loop
    from nnx_posttrain.algorithms import distill
    from support import FAST_STEPS, MICRO, train_run

    monkeypatch.setattr(loop.calls_lib, "parse",
                        lambda text, fmt, tools=None: [{"name": "multiply",
                                                        "arguments": {"a": 3, "b": 4}}])
    batches = []
    real = distill.MixedBatches._completed

    def completed(self, batch, generate_from):
        batches.append(real(self, batch, generate_from))
        return batches[-1]
    monkeypatch.setattr(distill.MixedBatches, "_completed", completed)
    path = tmp_path / "tools.jsonl"
    record = {"messages": [{"role": "user", "content": "What is 3 x 4?"},
                           {"role": "assistant", "content": "12"}],
              "tools": [function_schema(agent_tools.multiply)]}
    path.write_text((json.dumps(record) + "\n") * 8)
    result = train_run("distill", *MICRO, *FAST_STEPS, "--steps", "1", "--init-from", "",
                       "--data", str(path), "--batching.max-length", "700",
                       "--algo.teacher", "gemma_micro", "--algo.max-completion-length", "48",
                       "--algo.tools", "agent_tools:multiply",
                       "--algo.max-tool-calling-iterations", "1", "--run-dir", tmp_path / "run",
                       recipe=False)
    suffix = len(result.lm.tokenizer.encode(agents.continuation("gemma", [("multiply", "12")])))
    mask, attention = np.asarray(batches[0]["loss_mask"]), np.asarray(batches[0]["attention_mask"])
    start = int(mask[0].argmax())
    assert attention[0].sum() - start == 2 + suffix  # one token, the result, one token
    assert mask[0, start:start + 2 + suffix].tolist() == [1] + [0] * suffix + [1]
    assert result.train[0]["completions/mean_length"] == 2.0
