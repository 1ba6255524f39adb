"""The agent loop in the newer families' chat formats (Gemma 4, Qwen 3.5, harmony): their calls
read back as the published templates write them (and the malformed ones named), and the token ids
the loop builds over a tool-calling exchange equal the template's rendering tokenized, turn by
turn (every format the loop reads)."""

import ast
import re
import types

import nnx_posttrain  # noqa: F401
import numpy as np
import pytest

from nnx_posttrain import agents, chat
from nnx_posttrain.agents import Toolset, calls, function_schema
from test_chat import SPECIAL, family_tokenizer, official_ids, render_with_transformers

import agent_tools
from test_agents import calling, prompts_file  # noqa: F401  (fixtures)

NEW = ("gemma4", "qwen3.5", "qwen3.5-nothink", "harmony")
TEMPLATE = {"qwen2.5": "qwen2.5", "qwen3": "qwen3", "llama3.1": "llama3.1", "gemma4": "gemma4",
            "qwen3.5": "qwen3.5", "qwen3.5-nothink": "qwen3.5-nothink", "harmony": "gpt_oss"}
CALL = {"name": "multiply", "arguments": {"a": 37, "b": 12}}
TOOLS = [function_schema(agent_tools.multiply)]


# -- calls in generated text

def test_the_loop_reads_the_calls_of_every_format_that_renders_them():
    assert set(calls.PARSED_FORMATS) == set(chat.TOOL_FORMATS)


@pytest.mark.parametrize("fmt", NEW)
def test_a_call_rendered_by_the_format_parses_back(fmt):
    turn = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]}]
    written = [t for t, flag in chat.render(turn, fmt, tools=TOOLS) if flag][0]
    assert written.endswith(chat.CALL_END.get(fmt, chat.END_OF_TURN[fmt]))
    assert calls.parse(written.removesuffix(chat.END_OF_TURN[fmt]), fmt, TOOLS) == [CALL]
    assert calls.parse("444", fmt) == []


def test_gemma4_reads_every_value_of_its_call_syntax_and_only_a_turn_that_awaits_results():
    text = ('<|tool_call>call:f{l:[1,2.5,-3e-05,true,null,<|"|>x<|"|>],o:{k:{}},s:<|"|>a, b:c'
            '<|"|>}<tool_call|><|tool_call>call:g{}<tool_call|><|tool_response>')
    assert calls.parse(text, "gemma4") == [
        {"name": "f", "arguments": {"l": [1, 2.5, -3e-05, True, None, "x"], "o": {"k": {}},
                                    "s": "a, b:c"}},
        {"name": "g", "arguments": {}}]
    assert calls.parse(G4_CALL.format(' a: 37 , b :[ 1 ] '), "gemma4") == [
        {"name": "multiply", "arguments": {"a": 37, "b": [1]}}]  # whitespace read past
    # a turn that ended at <turn|> answered: what it wrote calls nothing (the template writes
    # every call followed by <|tool_response>)
    assert calls.parse("<|tool_call>call:f{a:1}<tool_call|>", "gemma4") == []


def test_qwen35_reads_arguments_by_their_schemas_types_and_skips_the_reasoning():
    properties = {"n": {"type": "integer"}, "s": {"type": "string"},
                  "m": {"type": ["integer", "null"]}, "o": {"type": "object"},
                  "b": {"type": "boolean"}}
    schema = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties}}}
    params = {"n": "37", "s": "12", "m": "None", "o": '{"x": [1]}', "b": "True",
              "free": "two\nlines"}
    text = ("I should call <tool_call>.\n</think>\n\nLet me.\n\n<tool_call>\n<function=f>\n"
            + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
            + "</function>\n</tool_call>")
    assert calls.parse(text, "qwen3.5", [schema]) == [{"name": "f", "arguments": {
        "n": 37, "s": "12", "m": None, "o": {"x": [1]}, "b": True, "free": "two\nlines"}}]
    assert calls.parse(text, "qwen3.5")[0]["arguments"]["s"] == 12  # no schema: JSON where JSON


def test_harmony_reads_the_recipient_before_or_after_the_channel():
    text = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.multiply <|constrain|>json<|message|>{"a":37,"b":12}<|call|>')
    assert calls.parse(text, "harmony") == [CALL]
    assert calls.parse("<|channel|>final<|message|>444", "harmony") == []


G4_CALL = "<|tool_call>call:multiply{{{}}}<tool_call|><|tool_response>"
Q35_CALL = "<tool_call>\n<function=multiply>\n{}</function>\n</tool_call>"
HARMONY_CALL = " to=functions.multiply<|channel|>commentary json<|message|>{}<|call|>"


@pytest.mark.parametrize("fmt,text,error", [
    ("gemma4", "<|tool_call>call:multiply{a:1}<|tool_response>", "not closed by <tool_call|>"),
    ("gemma4", G4_CALL.format("a:Paris"), "'Paris' is not a value (a string is written between"),
    ("gemma4", G4_CALL.format('a:<|"|>x'), 'a string is not closed by <|"|>'),
    ("gemma4", G4_CALL.format("a:[1,2"), "expected ',' or ']'"),
    ("gemma4", G4_CALL.format("a 1"), "expected 'key:'"),
    ("gemma4", "<|tool_call>multiply(a=1)<tool_call|><|tool_response>", "call:NAME{arguments}"),
    ("gemma4", "444<|tool_response>", "has no <|tool_call> block"),
    ("qwen3.5", "<tool_call>\n<function=multiply>\n<parameter=a>\n1\n</parameter>\n", "not closed"),
    ("qwen3.5", Q35_CALL.format("<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n"),
     "<parameter=a> is not closed by </parameter>"),
    ("qwen3.5", Q35_CALL.format("<parameter=a>\nseven\n</parameter>\n"),
     "parameter 'a': 'seven' is not integer"),
    ("qwen3.5-nothink", '<tool_call>\n{"name": "multiply"}\n</tool_call>', "one <function=NAME>"),
    ("qwen3.5", "<tool_call>\n<function=multiply>\n</tool_call>", "not closed by </function>"),
    ("harmony", "<|channel|>commentary<|message|>{}<|call|>", "names its recipient"),
    ("harmony", HARMONY_CALL.replace("functions.multiply", "browser.search").format("{}"),
     "goes to functions.NAME, not to 'browser.search'"),
    ("harmony", HARMONY_CALL.format("{a: 1}"), "'multiply': its arguments are not JSON"),
    ("harmony", HARMONY_CALL.format("[1]"), "must be a JSON object"),
    ("harmony", " to=functions.multiply<|channel|>commentary json<|call|>",
     "not followed by <|message|>"),
])
def test_a_malformed_call_is_named(fmt, text, error):
    with pytest.raises(agents.Malformed, match=re.escape(error)):
        calls.parse(text, fmt, TOOLS)


# -- the loop's token ids = the template's rendering of the same conversation, tokenized

ASK = {"role": "user", "content": "What is 37 x 12?"}


def called(*arguments, content="", **reasoning):
    """An assistant turn that calls multiply with each of ``arguments`` (ids, as Gemma 4's
    template resolves a result's name by them); ``reasoning``: Qwen 3.5's ``reasoning_content``
    or harmony's ``thinking``."""
    return {"role": "assistant", "content": content, **reasoning, "tool_calls": [
        {"type": "function", "id": f"call{k}", "function": {"name": "multiply", "arguments": a}}
        for k, a in enumerate(arguments)]}


def result(k, value):
    return {"role": "tool", "name": "multiply", "tool_call_id": f"call{k}", "content": value}


ONE = [ASK, called({"a": 37, "b": 12}), result(0, "444"),
       {"role": "assistant", "content": "37 x 12 = 444."}]
TWO = [ASK, called({"a": 37, "b": 12}, {"a": 2, "b": 3}, content="Two products."),
       result(0, "444"), result(1, "6"), {"role": "assistant", "content": "444 and 6."}]
CASES = {fmt: {"one": ONE} for fmt in TEMPLATE}
for fmt in ("qwen2.5", "qwen3.5", "qwen3.5-nothink"):
    CASES[fmt]["two"] = TWO
# Gemma 4 writes a call turn's text after its results (the model calls first): none here
CASES["gemma4"]["two"] = [TWO[0], dict(TWO[1], content=""), *TWO[2:]]
# Qwen 3 writes an empty think block on the last answer only: a call turn's own is dropped once
# its results follow, while the loop keeps what the model wrote (not this format's change); a
# call turn that reasons keeps its block
THINK = "<think>\nA tool multiplies.\n</think>\n\n"
CASES["qwen3"] = {"one": [ASK, dict(ONE[1], content=THINK), *ONE[2:]],
                  "two": [ASK, dict(TWO[1], content=THINK + "Two products."), *TWO[2:]]}
CASES["qwen3.5"]["reasoning"] = [
    ASK, called({"a": 37, "b": 12}, reasoning_content="A tool multiplies."), result(0, "444"),
    {"role": "assistant", "content": "444.", "reasoning_content": "It returned 444."}]
THOUGHT = [ASK, called({"a": 37, "b": 12}, thinking="A tool multiplies."),
           result(0, "444"), {"role": "assistant", "content": "444.", "thinking": "It is 444."}]
CASES["harmony"]["thinking"] = THOUGHT
for fmt, cases in CASES.items():  # a call, its result, another call (its own turn), its result
    first = cases["one"][1]
    cases["chain"] = [ASK, first, result(0, "444"), dict(first, tool_calls=[dict(
        first["tool_calls"][0], function={"name": "multiply", "arguments": {"a": 444, "b": 2}})]),
        result(0, "888"), {"role": "assistant", "content": "888."}]
SCRIPTS = [(fmt, name) for fmt, cases in CASES.items() for name in cases]


def one_row(written, n=400):
    """A sampler's output of one row that wrote ``written`` (ids, its stop last)."""
    out = {"completion_ids": np.zeros((1, n), np.int32), "finished": np.ones(1, bool),
           "completion_mask": np.zeros((1, n), np.int32)}
    out["completion_ids"][0, :len(written)], out["completion_mask"][0, :len(written)] = written, 1
    return out


def run_loop(fmt, conversation):
    """The loop over ``conversation`` with a model that writes the template's tokens of each
    assistant message (rendered after the question, to a stop); each turn's context must be the
    template's rendering of the conversation so far with its generation prompt, tokenized."""
    tok = family_tokenizer(fmt)
    lm = types.SimpleNamespace(tokenizer=tok, chat_format=fmt)

    def official(messages, prompt):
        text = render_with_transformers(TEMPLATE[fmt], fmt, messages, prompt, TOOLS)
        if fmt != "harmony":
            return official_ids(tok, fmt, text)
        # the model's words begin after "<|start|>assistant"; the synthetic vocabulary merges
        # "t " across "assistant to=" where o200k's pre-tokenizer splits: tokenized on each side
        head, *rest = text.split("<|start|>assistant")
        return tok.encode(head) + [t for piece in rest
                                   for t in tok.encode("<|start|>assistant") + tok.encode(piece)]

    loop = agents.ToolLoop(lm, 400, 4)
    turns = [k for k, m in enumerate(conversation) if m["role"] == "assistant"]

    def sample(ids, mask, budget, turn):
        context, k = ids[0][mask[0] == 1].tolist(), turns[turn]
        assert context == official(conversation[:k], True), f"turn {turn}"
        after = official([ASK, conversation[k]], False)[len(official([ASK], True)):]
        written = after[:next(j for j, t in enumerate(after) if t in loop.stops) + 1]
        return one_row(written)

    prompt = official(conversation[:turns[0]], True)
    exchange = loop(sample, [prompt], Toolset("agent_tools:multiply").open([{}]))
    return tok, official, prompt, exchange


@pytest.mark.parametrize("fmt,case", SCRIPTS)
def test_the_loops_tokens_are_the_templates_rendering_tokenized(fmt, case):
    conversation = CASES[fmt][case]
    tok, official, prompt, ex = run_loop(fmt, conversation)
    row = ex.completion_ids[0][ex.completion_mask[0] == 1].tolist()
    made = [m["tool_calls"][:1 if fmt in calls.ONE_CALL else None] for m in conversation
            if m.get("tool_calls")]
    assert ex.finished[0] and (ex.calls, ex.failures) == (sum(map(len, made)), 0)
    whole = official(conversation, False)
    if (fmt, case) == ("harmony", "thinking"):
        # the template drops a call's analysis once a final answer follows; the loop keeps what
        # the model read when it answered (each turn's context is the template's, above)
        dropped = "<|channel|>analysis<|message|>A tool multiplies.<|end|><|start|>assistant"
        assert tok.decode(prompt + row) == (
            render_with_transformers("gpt_oss", fmt, conversation, False, TOOLS)
            .replace("assistant to=", "assistant" + dropped + " to=", 1))
        return
    assert prompt + row == whole[:len(prompt) + len(row)]
    assert tok.decode(whole[len(prompt) + len(row):]) in ("", "\n", SPECIAL[fmt][1])
    # the results and the template's text around them carry no loss
    tool_ids = [t for t, m, k in zip(row, ex.completion_mask[0], ex.tool_mask[0]) if m and not k]
    runs = [[]]  # each calling turn's results
    for m in conversation[1:]:
        if m["role"] == "tool":
            runs[-1].append((m["name"], m["content"]))
        elif runs[-1]:
            runs.append([])
    assert tok.decode(tool_ids) == "".join(calls.continuation(fmt, r) for r in runs if r)


@pytest.mark.parametrize("fmt", ["gemma4", "harmony"])
def test_generation_stops_where_a_calling_turn_ends(fmt):
    """Gemma 4's <|tool_response>, harmony's <|call|>: stop ids beside the end of turn (where
    their templates end a calling turn)."""
    from nnx_posttrain.sampling import sampler

    tok = family_tokenizer(fmt)
    stops = sampler.stop_ids(types.SimpleNamespace(tokenizer=tok, chat_format=fmt))
    assert {tok.token_id(chat.CALL_END[fmt]), tok.token_id(chat.END_OF_TURN[fmt])} <= set(stops)


# -- a short tool rollout on each family's micro preset: the first turn scripted (the template's
# call, which a random model would not write), the answer sampled by the model from the whole
# context (prompt, call, results) through the KV-cache sampler

MICRO = {"gemma4": ("gemma4", dict(num_layers=3, num_kv_shared_layers=1)),
         "qwen3.5": ("qwen3_5", {}), "qwen3.5-nothink": ("qwen3_5", {}), "harmony": ("gpt_oss", {})}


@pytest.fixture(scope="module")
def micro_lm(tmp_path_factory):
    """The micro preset of a family (its tiny variant, a synthetic tokenizer of 1,024 ids), as
    tests/test_newer_families.py makes them, loaded once."""
    import keras

    from nnx_posttrain import families, model
    from tools import make_preset

    loaded = {}

    def load(name):
        if name not in loaded:
            family = families.FAMILIES[name]
            dims = dict(family.tiny[name], **dict(MICRO.values())[name], vocabulary_size=1024)
            out = tmp_path_factory.mktemp(name)
            keras.utils.set_random_seed(0)
            make_preset._task(name, dims, 1024, "float32").save_to_preset(str(out))
            loaded[name] = model.load(str(out))
        return loaded[name]
    return load


@pytest.mark.slow
@pytest.mark.parametrize("fmt", NEW)
def test_a_tool_rollout_on_the_familys_micro_preset(fmt, micro_lm):
    import jax
    from flax import nnx

    from nnx_posttrain.sampling import sampler

    loaded = micro_lm(MICRO[fmt][0])
    lm = types.SimpleNamespace(tokenizer=loaded.tokenizer, chat_format=fmt)
    tok, n = lm.tokenizer, 160
    graphdef, *states = nnx.split(loaded.module)
    policy = sampler.make_sampler(graphdef, n, pad_id=tok.pad_id)
    loop = agents.ToolLoop(lm, n, 1)
    call = [ASK, called({"a": 37, "b": 12})]
    prompt_text = chat.to_text([ASK], fmt, add_generation_prompt=True, tools=TOOLS)
    written = tok.encode(chat.to_text(call, fmt, tools=TOOLS)[len(prompt_text):])
    written = written[:next(j for j, t in enumerate(written) if t in loop.stops) + 1]
    contexts = []

    def sample(ids, mask, budget, turn):
        contexts.append(ids[0][mask[0] == 1].tolist())
        if turn == 0:  # the call, as the template writes it
            return one_row(written, n)
        return jax.device_get(policy(states, ids, mask, jax.random.key(turn), sampler.Draw(
            1.0, 1.0, np.asarray(sorted(loop.stops), np.int32), tok.vocab_size, budget)))

    prompt = sampler.encode_prompt(lm, chat.render([ASK], fmt, add_generation_prompt=True,
                                                   tools=TOOLS))
    ex = loop(sample, [prompt], Toolset("agent_tools:multiply").open([{}]))
    assert (ex.calls, ex.failures) == (1, 0)
    assert ex.messages[0][1] == {"role": "tool", "name": "multiply", "content": "444"}
    suffix = tok.encode(calls.continuation(fmt, [("multiply", "444")]))
    assert contexts[1] == prompt + written + suffix  # the model answers from the whole context
    assert tok.decode(contexts[1]).endswith(chat.to_text(
        [*call, result(0, "444")], fmt, add_generation_prompt=True, tools=TOOLS))
    row = ex.completion_ids[0][ex.completion_mask[0] == 1].tolist()
    answered = len(row) - len(written) - len(suffix)
    assert row[:len(written) + len(suffix)] == written + suffix and answered > 0
    assert ex.tool_mask[0, :len(row)].tolist() == [1] * len(written) + [0] * len(suffix) + [
        1] * answered


@pytest.mark.slow
def test_grpo_with_tools_runs_in_a_format_it_refused_before(tmp_path, prompts_file, calling):
    """Harmony (the formats the loop did not read were refused before the first step); every
    turn one token, each a call (test_agents' ``calling``)."""
    from test_agents import agent_run

    result = agent_run("grpo", tmp_path, prompts_file, "--chat-format", "harmony", "--steps", "1",
                       "--eval.every", "0", "--algo.tools", "agent_tools:multiply",
                       "--algo.rewards", "exact_match", "--algo.max-tool-calling-iterations", "1")
    assert result.train[0]["tools/call_frequency"] == 1.0  # of a tool it does not have: failed
    assert result.train[0]["tools/failure_frequency"] == 1.0


MALFORMED = {"gemma4": G4_CALL.format("a:Paris"),
             "qwen3.5": "\n</think>\n\n" + Q35_CALL.format("<parameter=a>\nseven\n</parameter>\n"),
             "qwen3.5-nothink": Q35_CALL.format("<parameter=a>\nseven\n</parameter>\n"),
             "harmony": HARMONY_CALL.format("{a: 1}")}


@pytest.mark.parametrize("fmt", NEW)
def test_a_malformed_call_is_a_failed_call_whose_error_the_model_reads(fmt):
    tok = family_tokenizer(fmt)
    lm = types.SimpleNamespace(tokenizer=tok, chat_format=fmt)
    loop = agents.ToolLoop(lm, 400, 2)
    end = [] if fmt in chat.CALL_END else tok.encode(chat.END_OF_TURN[fmt])
    turns = [tok.encode(MALFORMED[fmt]) + end, tok.encode("No.") + tok.encode(
        chat.END_OF_TURN[fmt])]
    contexts = []

    def sample(ids, mask, budget, turn):
        contexts.append(ids[0][mask[0] == 1].tolist())
        return one_row(turns[turn])

    ex = loop(sample, [[5]], Toolset("agent_tools:multiply").open([{}]))
    error = ex.messages[0][1]["content"]
    assert (ex.calls, ex.failures) == (1, 1)
    assert ast.literal_eval(error)["error"].startswith("malformed tool call: tool call 'multiply'")
    assert contexts[1] == [5] + turns[0] + tok.encode(calls.continuation(fmt, [("unknown", error)]))
    assert ex.messages[0][-1]["content"].endswith("No.")
