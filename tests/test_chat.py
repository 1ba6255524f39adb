"""Chat templates: exact rendered strings per family, which segments carry loss, and errors."""

import json

import pytest

import nnx_posttrain  # noqa: F401  (sets the Keras backend before anything imports keras)
from nnx_posttrain import chat, chat_formats, chat_harmony
from nnx_posttrain.chat import ChatFormatError

HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
SYS_HI = [{"role": "system", "content": "Be brief."}, *HI]
TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Sure"},
]


def assistant_text(segments):
    return "".join(text for text, flag in segments if flag)


def answer(fmt, content, last=True):
    """An assistant answer as its format trains it: Qwen 3's and 3.5's last answer opens with an
    empty think block (as their templates write it), harmony's answers are in the final
    channel."""
    if fmt == "harmony":
        return "<|channel|>final<|message|>" + content
    qwen = fmt in ("qwen3", "qwen3.5", "qwen3.5-nothink")
    return ("<think>\n\n</think>\n\n" if qwen and last else "") + content


def end_of_turn(fmt, last=True):
    """The marker after an answer: harmony ends the last one with <|return|>, the others <|end|>."""
    return "<|end|>" if fmt == "harmony" and not last else chat.END_OF_TURN[fmt]


# ----------------------------------------------------------------------------- exact strings


def test_gemma_exact_segments():
    assert chat.render(HI, "gemma") == [
        ("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", False),
        ("Hello<end_of_turn>", True),
        ("\n", False),
    ]
    assert chat.to_text(HI, "gemma") == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    )


def test_gemma_folds_system_into_first_user_turn():
    assert chat.to_text(SYS_HI, "gemma") == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
    )


def test_gemma_system_without_user_becomes_its_own_user_turn():
    msgs = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]
    assert chat.to_text(msgs, "gemma") == (
        "<start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
    )


def test_gemma_does_not_mutate_the_callers_messages():
    msgs = [dict(m) for m in SYS_HI]
    chat.render(msgs, "gemma")
    assert msgs == SYS_HI


def test_chatml_exact_with_system():
    assert chat.to_text(SYS_HI, "chatml") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
    )
    assert chat.render(SYS_HI, "chatml")[-2:] == [("Hello<|im_end|>", True), ("\n", False)]


def test_llama3_exact_with_system():
    assert chat.to_text(SYS_HI, "llama3") == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
    )


def test_llama3_user_turn():
    text = chat.to_text([{"role": "user", "content": "Hi"}], "llama3")
    assert text == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"


def test_mistral_exact_multi_turn_and_system_fold():
    assert chat.to_text(TWO_TURNS, "mistral") == "[INST] Hi [/INST]Hello</s>[INST] Again [/INST]Sure</s>"
    assert chat.to_text(SYS_HI, "mistral") == "[INST] Be brief.\n\nHi [/INST]Hello</s>"


def test_no_bos_in_text():
    for fmt in chat.FORMATS:
        text = chat.to_text(HI, fmt)
        assert "<bos>" not in text and "<|begin_of_text|>" not in text and not text.startswith("<s>")


# ----------------------------------------------------------------------------- loss flags


@pytest.mark.parametrize("fmt", chat.FORMATS)
def test_only_assistant_content_and_end_marker_are_flagged(fmt):
    segs = chat.render(TWO_TURNS, fmt)
    first = answer(fmt, "Hello", last=False) + end_of_turn(fmt, last=False)
    last = answer(fmt, "Sure") + end_of_turn(fmt)
    assert assistant_text(segs) == f"{first}{last}"
    # every flagged segment is exactly one assistant answer plus its end-of-turn marker
    assert [t for t, f in segs if f] == [first, last]
    # concatenation is the template text; adjacent segments never share a flag (merged)
    assert "".join(t for t, _ in segs) == chat.to_text(TWO_TURNS, fmt)
    assert all(a[1] != b[1] for a, b in zip(segs, segs[1:]))


@pytest.mark.parametrize("fmt", chat.FORMATS)
def test_system_and_user_text_never_flagged(fmt):
    msgs = [
        {"role": "system", "content": "SYSTEXT"},
        {"role": "user", "content": "USERTEXT"},
        {"role": "assistant", "content": "ANSWER"},
    ]
    flagged = assistant_text(chat.render(msgs, fmt))
    assert "SYSTEXT" not in flagged and "USERTEXT" not in flagged
    assert flagged == answer(fmt, "ANSWER") + chat.END_OF_TURN[fmt]


@pytest.mark.parametrize("fmt", chat.FORMATS)
def test_later_system_message_is_not_trained(fmt):
    # A system message after the first turn must not be rendered as (trained) assistant text.
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "system", "content": "LATESYS"},
        {"role": "assistant", "content": "A"},
    ]
    segs = chat.render(msgs, fmt)
    assert "LATESYS" in chat.to_text(msgs, fmt)
    assert assistant_text(segs) == answer(fmt, "A") + chat.END_OF_TURN[fmt]


def test_empty_assistant_content_still_trains_the_end_marker():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]
    assert assistant_text(chat.render(msgs, "gemma")) == "<end_of_turn>"


# ----------------------------------------------------------------------------- generation prompt


PROMPT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "fmt, expected",
    [
        ("gemma", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
        ("chatml", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        (
            "llama3",
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("mistral", "[INST] Hi [/INST]"),
    ],
)
def test_add_generation_prompt(fmt, expected):
    segs = chat.render(PROMPT, fmt, add_generation_prompt=True)
    assert segs == [(expected, False)]
    assert chat.to_text(PROMPT, fmt, add_generation_prompt=True) == expected
    # the generation prompt is exactly what precedes the answer in the full conversation
    assert chat.to_text(HI, fmt).startswith(expected)
    assert chat.to_text(HI, fmt)[len(expected):] == "Hello" + chat.END_OF_TURN[fmt] + (
        "\n" if fmt in ("gemma", "chatml") else ""
    )


@pytest.mark.parametrize("fmt", ["gemma", "chatml", "llama3"])
def test_without_generation_prompt_no_assistant_header(fmt):
    text = chat.to_text(PROMPT, fmt)
    assert "model" not in text and "assistant" not in text


# ----------------------------------------------------------------------------- errors


def test_unknown_format():
    with pytest.raises(ChatFormatError, match="unknown chat format 'alpaca'"):
        chat.render(HI, "alpaca")


def test_bad_role():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "critic", "content": "x"}]
    with pytest.raises(ChatFormatError, match="message 1 has role 'critic'"):
        chat.render(msgs, "gemma")


@pytest.mark.parametrize("fmt", ["llama3", "mistral", "chatml"])
def test_a_format_without_a_tool_template_refuses_tools_by_name(fmt):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(ChatFormatError, match=f"chat format '{fmt}': its official template has "
                       "no tool-calling format.*qwen2.5, qwen3, llama3.1, gemma"):
        chat.render(msgs, fmt)
    with pytest.raises(ChatFormatError, match="no tool-calling format"):
        chat.render([{"role": "user", "content": "Hi"}], fmt, tools=[TOOL])


def test_missing_content():
    with pytest.raises(ChatFormatError, match="message 0 must be an object with 'role' and 'content'"):
        chat.render([{"role": "user"}], "chatml")


def test_missing_role():
    with pytest.raises(ChatFormatError, match="message 0"):
        chat.render([{"content": "Hi"}], "chatml")


@pytest.mark.parametrize("content, type_name", [(None, "NoneType"), (3, "int"), (["a"], "list")])
def test_non_string_content(content, type_name):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
    with pytest.raises(ChatFormatError, match=rf"message 1 has non-string content \({type_name}\)"):
        chat.render(msgs, "llama3")


@pytest.mark.parametrize("messages", [[], None, "Hi", {"role": "user", "content": "Hi"}, ["Hi"]])
def test_not_a_list_of_messages(messages):
    with pytest.raises(ChatFormatError):
        chat.render(messages, "gemma")


def test_errors_are_value_errors():
    assert issubclass(ChatFormatError, ValueError)


# ----------------------------------------------------------------------------- official templates
# The official Jinja templates (nnx_posttrain/chat_templates, written from memory: see the
# README there), rendered as transformers renders them, against chat.render: the same string
# (the BOS token aside, which the tokenizer adds as an id) and the same token ids through the
# data pipeline, with a tokenizer of the family's kind.

import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

jinja2 = pytest.importorskip("jinja2")
import jinja2.ext  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

TEMPLATES = Path(chat.__file__).parent / "chat_templates"
# format -> official templates it must equal, and whether they accept a system message
OFFICIAL = {
    "gemma": [("gemma", False), ("gemma3", True)],
    "llama3": [("llama3", True)],
    "llama3.1": [("llama3.1", True), ("llama3.2", True)],
    "qwen2.5": [("qwen2.5", True)],
    "qwen3": [("qwen3", True)],
    "chatml": [("chatml", True)],
    "mistral": [("mistral", False)],
    "gemma4": [("gemma4", True)],
    "phi3": [("phi3", True)],
    "qwen3.5": [("qwen3.5", True)],
    "qwen3.5-nothink": [("qwen3.5-nothink", True)],
    "harmony": [("gpt_oss", True)],
}
SPECIAL = {  # bos, eos of the official rendering
    "gemma": ("<bos>", "<eos>"), "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
    "llama3.1": ("<|begin_of_text|>", "<|end_of_text|>"), "qwen2.5": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"), "chatml": ("", "<|im_end|>"), "mistral": ("<s>", "</s>"),
    "gemma4": ("<bos>", "<eos>"), "phi3": ("", "<|endoftext|>"),
    "qwen3.5": ("", "<|im_end|>"), "qwen3.5-nothink": ("", "<|im_end|>"),
    "harmony": ("", "<|endoftext|>"),
}
SYS = {"role": "system", "content": "You are terse."}
U1, A1 = {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}
U2, A2 = {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "It is 6."}
CASES = {  # name -> (messages, add_generation_prompt, has a system message)
    "user_prompt": ([U1], True, False),
    "user_assistant": ([U1, A1], False, False),
    "system_user_assistant": ([SYS, U1, A1], False, True),
    "multi_turn": ([U1, A1, U2, A2], False, False),
    "system_multi_turn_prompt": ([SYS, U1, A1, U2], True, True),
    "whitespace": ([{"role": "user", "content": "  Hi there \n"},
                    {"role": "assistant", "content": " Hello.\n\n"}], False, False),
}


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.cache
def official_template(name):
    """The fixture compiled as transformers compiles a chat template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise
    return env.from_string((TEMPLATES / f"{name}.jinja").read_text())


def harmony_date(pattern):
    """``strftime_now`` of the day ``chat`` writes in harmony's system message."""
    import datetime

    return datetime.date.fromisoformat(chat_harmony.HARMONY_DATE).strftime(pattern)


def render_official(name, fmt, messages, add_generation_prompt):
    bos, eos = SPECIAL[fmt]
    today = {"strftime_now": harmony_date} if fmt == "harmony" else {}
    return official_template(name).render(messages=messages, bos_token=bos, eos_token=eos,
                                          add_generation_prompt=add_generation_prompt, **today)


# Not yet replaced by a published copy (issue: agents / templates): rendered as remembered.
FROM_MEMORY = {"chatml"}


def test_every_format_has_official_templates_that_name_their_source():
    assert set(OFFICIAL) == set(chat.FORMATS)
    for templates in OFFICIAL.values():
        for name, _ in templates:
            first = (TEMPLATES / f"{name}.jinja").read_text().splitlines()[0]
            assert first.startswith("{#-") and first.endswith("-#}")
            assert ("written from memory" in first) == (name in FROM_MEMORY), first
            assert name in FROM_MEMORY or "the published tokenizer_config.json chat_template, from" in first


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", chat.FORMATS)
def test_render_equals_the_official_template(fmt, case):
    messages, prompt, has_system = CASES[case]
    ours = chat.to_text(messages, fmt, add_generation_prompt=prompt)
    for name, accepts_system in OFFICIAL[fmt]:
        if has_system and not accepts_system:
            with pytest.raises(jinja2.exceptions.TemplateError):  # we fold it instead
                render_official(name, fmt, messages, prompt)
            continue
        assert render_official(name, fmt, messages, prompt) == SPECIAL[fmt][0] + ours, name


def test_qwen25_default_system_prompt_and_qwen3_think_block():
    text = chat.to_text([U1, A1], "qwen2.5")
    assert text.startswith(f"<|im_start|>system\n{chat.QWEN25_SYSTEM}<|im_end|>\n")
    segs = chat.render([U1, A1, U2, A2], "qwen3")
    assert [t for t, f in segs if f] == ["4<|im_end|>", "<think>\n\n</think>\n\nIt is 6.<|im_end|>"]
    # reasoning in an earlier answer is dropped, in the last one kept in its think block
    think = {"role": "assistant", "content": "<think>\nadd</think>\n\n4"}
    assert chat.to_text([U1, think, U2, A2], "qwen3").count("add") == 0
    assert "<think>\nadd\n</think>\n\n4<|im_end|>" in chat.to_text([U1, think], "qwen3")
    assert chat.to_text([U1], "qwen3", add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_qwen35_exact_turns_think_blocks_xml_calls_and_its_two_generation_prompts():
    """Qwen 3.5's template (nnx_posttrain/chat_templates/qwen3.5.jinja) written out by hand:
    contents trimmed, reasoning of an answer before the last query dropped and after it kept in
    a think block, a call as XML after the answer's text, results as one user turn; the prompt
    opens a think block (4B and larger) or closes an empty one (0.8B, 2B: -nothink)."""
    think = {"role": "assistant", "content": "<think>\nadd</think>\n\n4 "}
    assert chat.to_text([SYS, U1, think, U2], "qwen3.5", add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert chat.to_text([U1], "qwen3.5-nothink", add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.render([U1, think], "qwen3.5")[-2:] == [
        ("<think>\nadd\n</think>\n\n4<|im_end|>", True), ("\n", False)]
    call = {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]}
    segs = chat.render([ASK, call, {"role": "tool", "content": "444"}], "qwen3.5", tools=[TOOL],
                       add_generation_prompt=True)
    text = "".join(t for t, _ in segs)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following "
                           "functions:\n\n<tools>\n" + json.dumps(TOOL) + "\n</tools>\n\n")
    assert text.endswith(
        "<|im_start|>user\nWhat is 37 x 12?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\nLet me compute.\n\n<tool_call>\n<function=multiply>\n"
        "<parameter=a>\n37\n</parameter>\n<parameter=b>\n12\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n444\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert [t for t, f in segs if f] == [
        text[text.index("<think>"):text.index("</tool_call><|im_end|>") + 22]]


# -- token ids: the data pipeline's ids of a conversation = the official string tokenized whole


@functools.cache
def family_tokenizer(fmt):
    """A small tokenizer of the family's kind: SentencePiece in Gemma's layout (no dummy
    prefix, as Gemma's), byte-level BPE with Llama 3's or Qwen's special tokens."""
    import keras_hub

    from nnx_posttrain import model
    from tools import make_preset

    if fmt == "gemma4":
        return model.Tokenizer(make_preset.TOKENIZERS["sentencepiece-gemma4"](4096))
    if fmt == "harmony":
        return model.Tokenizer(make_preset.gpt_oss_tokenizer(4096))
    if fmt in ("gemma", "mistral", "chatml", "phi3"):
        return model.Tokenizer(keras_hub.models.GemmaTokenizer(proto=make_preset.gemma_proto(4096)))
    if fmt.startswith("llama3"):
        return model.Tokenizer(make_preset.llama3_tokenizer(4096))
    return model.Tokenizer(make_preset.qwen_tokenizer(4096, qwen3=fmt.startswith("qwen3")))


def official_ids(tok, fmt, text):
    bos = SPECIAL[fmt][0]
    if bos and tok.bos_id is not None:
        assert text.startswith(bos)
        return [tok.bos_id] + tok.encode(text[len(bos):])
    return tok.encode(text)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fmt", ["gemma", "llama3", "llama3.1", "qwen2.5", "qwen3", "gemma4",
                                 "qwen3.5", "harmony"])
def test_pipeline_token_ids_equal_the_official_template_tokenized(fmt, case):
    from nnx_posttrain import data
    from nnx_posttrain.sampling import sampler

    messages, prompt, has_system = CASES[case]
    name = next(n for n, accepts in OFFICIAL[fmt] if accepts or not has_system)
    tok = family_tokenizer(fmt)
    expected = official_ids(tok, fmt, render_official(name, fmt, messages, prompt))
    if prompt:  # a prompt, as rollouts and evaluation encode it
        lm = type("LM", (), {"tokenizer": tok})()
        got = sampler.encode_prompt(lm, chat.render(messages, fmt, add_generation_prompt=True))
    else:  # a training conversation, as the data pipeline tokenizes it
        example = data.Tokenize(tok, fmt, 256)({"messages": messages})
        got = [int(i) for i, m in zip(example["input_ids"], example["attention_mask"]) if m]
        trained = np.asarray(example["loss_mask"])[: len(got)].astype(bool)
        # what carries loss is exactly the assistant segments' tokens
        flagged = "".join(t for t, f in chat.render(messages, fmt) if f)
        assert tok.decode([i for i, t in zip(got, trained) if t]) == flagged
    assert got == expected


def test_llama32_writes_a_tool_call_as_json_ending_its_turn():
    """Llama 3.2's published template writes every tool call as one JSON object and ends the turn
    with <|eot_id|> (3.1's ``<|python_tag|>`` / ``<|eom_id|>`` branch for built-in tools is not
    in it)."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    messages = [{"role": "user", "content": "3 x 4?"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "12"}]
    text = official_template("llama3.2").render(
        messages=messages, bos_token="<|begin_of_text|>", tools=[], builtin_tools=["multiply"],
        date_string="26 Jul 2024")
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "multiply", "parameters": '
            '{"a": 3, "b": 4}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"12"<|eot_id|>'
            ) in text  # a string result is "iterable": the published template writes it as JSON
    assert "<|python_tag|>" not in text and "<|eom_id|>" not in text


# -- tool calling: rendered as the official templates' tool branches (transformers' Jinja setup)

TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 37, "b": 12}}}
ASK = {"role": "user", "content": "What is 37 x 12?"}
TOOL_CASES = {  # name -> (messages, add_generation_prompt)
    "call": ([ASK, {"role": "assistant", "tool_calls": [CALL]}], False),
    "call_result_answer": ([ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                            {"role": "tool", "content": "444"},
                            {"role": "assistant", "content": "37 x 12 = 444."}], False),
    "system_call_result_prompt": ([SYS, ASK, {"role": "assistant", "tool_calls": [CALL]},
                                   {"role": "tool", "content": "444"}], True),
    "text_and_two_calls_then_results": (
        [ASK, {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL, CALL]},
         {"role": "tool", "content": "444"}, {"role": "tool", "content": "444"},
         {"role": "assistant", "content": "444."}], False),
}
TOOL_OFFICIAL = {"qwen2.5": ["qwen2.5"], "qwen3": ["qwen3"], "llama3.1": ["llama3.1", "llama3.2"],
                 "gemma4": ["gemma4"], "qwen3.5": ["qwen3.5"], "harmony": ["gpt_oss"]}


def render_with_transformers(name, fmt, messages, prompt, tools):
    """The official template rendered by transformers' own chat-template code (its ``tojson``;
    harmony's system message with today's date, which ``chat`` writes as ``HARMONY_DATE``)."""
    import datetime

    from transformers.utils.chat_template_utils import render_jinja_template

    bos, eos = SPECIAL[fmt]
    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=official_template_text(name),
        add_generation_prompt=prompt, bos_token=bos, eos_token=eos, date_string=chat.LLAMA31_DATE)
    today = f"Current date: {datetime.date.today().isoformat()}\n"
    return rendered[0].replace(today, f"Current date: {chat_harmony.HARMONY_DATE}\n", 1)


def official_template_text(name):
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
@pytest.mark.parametrize("fmt", sorted(TOOL_OFFICIAL))
def test_tool_conversations_render_as_the_official_templates(fmt, case):
    messages, prompt = TOOL_CASES[case]
    if fmt in ("llama3.1", "harmony") and case.startswith("text_and_two_calls"):
        with pytest.raises(ChatFormatError, match="one tool call per assistant message"):
            chat.render(messages, fmt, tools=[TOOL])
        return
    ours = chat.to_text(messages, fmt, add_generation_prompt=prompt, tools=[TOOL])
    for name in TOOL_OFFICIAL[fmt]:
        assert render_with_transformers(name, fmt, messages, prompt, [TOOL]) == SPECIAL[fmt][0] + ours
    # the loss: the assistant's text and calls with their end-of-turn marker, never a result
    flagged = [t for t, f in chat.render(messages, fmt, tools=[TOOL]) if f]
    assert flagged and not any("444\n</tool_response>" in t or '"444"' in t for t in flagged)
    assert any('"multiply"' in t or "call:multiply{" in t or "<function=multiply>" in t
               or "functions.multiply<" in t
               for t in flagged)


@pytest.mark.parametrize("fmt", sorted(TOOL_OFFICIAL))
def test_tool_conversation_token_ids_equal_the_official_template_tokenized(fmt):
    from nnx_posttrain import data

    messages, _ = TOOL_CASES["call_result_answer"]
    tok = family_tokenizer(fmt)
    expected = official_ids(tok, fmt, render_with_transformers(
        TOOL_OFFICIAL[fmt][0], fmt, messages, False, [TOOL]))
    example = data.Tokenize(tok, fmt, 4096)({"messages": messages, "tools": [TOOL]})
    got = [int(i) for i, m in zip(example["input_ids"], example["attention_mask"]) if m]
    assert got == expected
    trained = np.asarray(example["loss_mask"])[: len(got)].astype(bool)
    flagged = "".join(t for t, f in chat.render(messages, fmt, tools=[TOOL]) if f)
    assert tok.decode([i for i, t in zip(got, trained) if t]) == flagged


def test_tool_calls_are_checked_with_the_message_named():
    with pytest.raises(ChatFormatError, match="message 1: tool call 'multiply' has arguments that are not JSON"):
        chat.render([ASK, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": "{a: 1"}}]}], "qwen3")
    with pytest.raises(ChatFormatError, match="message 0: only an assistant message has 'tool_calls'"):
        chat.render([dict(ASK, tool_calls=[CALL])], "qwen3")
    # arguments as a JSON string are read as the object they encode
    as_string = {"type": "function", "function": {"name": "multiply", "arguments": '{"a": 37, "b": 12}'}}
    assert chat.to_text([ASK, {"role": "assistant", "tool_calls": [as_string]}], "qwen3") == \
        chat.to_text([ASK, {"role": "assistant", "tool_calls": [CALL]}], "qwen3")


@pytest.mark.slow
def test_sft_trains_on_tool_calling_conversations_and_refuses_a_format_without_tools(tmp_path):
    """A tool-calling dataset (TRL's columns: messages with tool_calls and tool results, tools)
    trains in the format of a family with a tool template; a family without one is refused with
    the line and the reason."""
    import json as json_lib

    from support import FAST_STEPS, MICRO, refusal, train_run

    path = tmp_path / "tools.jsonl"
    rows = [{"messages": TOOL_CASES["call_result_answer"][0], "tools": [TOOL]}] * 8
    path.write_text("".join(json_lib.dumps(r) + "\n" for r in rows))
    # two steps (the rows take 859 tokens in qwen3's format, 541 in gemma's)
    common = [*MICRO, *FAST_STEPS, "--steps", "2", "--batching.max-length", "1024",
              "--data", str(path)]
    for fmt in ("qwen3", "gemma"):  # an official template's tool branch, gemma's convention
        result = train_run("sft", *common, "--chat-format", fmt, "--run-dir", tmp_path / fmt,
                           recipe=False)
        assert result.step == 2 and all(np.isfinite(r["loss"]) for r in result.train)
        assert result.train[0]["truncated"] == 0
    message = refusal("sft", *common, "--chat-format", "llama3", "--run-dir", tmp_path / "llama3",
                      recipe=False)
    assert f"{path}:1: field 'messages': chat format 'llama3': its official template has no " \
           "tool-calling format" in message


def test_a_tools_column_that_is_not_json_schemas_is_refused_with_its_field():
    from nnx_posttrain import data
    from nnx_posttrain.data.errors import DataError

    tok = family_tokenizer("qwen3")
    record = {"messages": TOOL_CASES["call"][0], "tools": "[{not json", "_where": "f.jsonl:3"}
    with pytest.raises(DataError, match="f.jsonl:3: field 'tools' is a string that is not JSON"):
        data.Tokenize(tok, "qwen3", 4096)(record)
    with pytest.raises(DataError, match="f.jsonl:3: field 'tools' must be a list of JSON schema"):
        data.Tokenize(tok, "qwen3", 4096)(dict(record, tools='{"a": 1}'))
    # lists of objects, not in the schema's shape: refused by line for SFT and GRPO alike
    prompt = {"prompt": TOOL_CASES["call"][0][:1], "_where": "f.jsonl:3"}
    for tools, problem in [([{"type": "function", "function": "multiply"}],
                            "item 0 has 'function' str 'multiply', not an object"),
                           ([TOOL, {"type": "function", "function": {"name": 3}}],
                            "item 1 has 'function.name' int '3', not a string")]:
        for transform, rec in [(data.Tokenize(tok, "qwen3", 4096), record),
                               (data.TokenizePrompt(tok, "qwen3", 4096), prompt)]:
            with pytest.raises(DataError, match=f"f.jsonl:3: field 'tools' {problem}; each tool "
                                                r"is \{'type': 'function', 'function': "):
                transform(dict(rec, tools=tools))


def test_gemma_tool_convention_renders_schemas_call_and_results():
    """Gemma's templates have no tool branch: the package's documented convention (chat._gemma):
    the schemas open the first user turn, a call is JSON after the text, results come back in
    ```tool_output``` blocks of one user turn; the loss covers the calls, never the results."""
    messages, _ = TOOL_CASES["text_and_two_calls_then_results"]
    with pytest.raises(ChatFormatError, match="one tool call per assistant message, got 2"):
        chat.render(messages, "gemma", tools=[TOOL])
    messages = [SYS, ASK, {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]},
                {"role": "tool", "content": "444"}, {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "444."}]
    segments = chat.render(messages, "gemma", add_generation_prompt=False, tools=[TOOL])
    assert "".join(t for t, _ in segments) == (
        "<start_of_turn>user\n" + chat.GEMMA_TOOLS + json.dumps(TOOL) + "\n\n"
        + SYS["content"] + "\n\nWhat is 37 x 12?<end_of_turn>\n<start_of_turn>model\n"
        'Let me compute.\n{"name": "multiply", "parameters": {"a": 37, "b": 12}}<end_of_turn>\n'
        "<start_of_turn>user\n```tool_output\n444\n```\n```tool_output\nx\n```<end_of_turn>\n"
        "<start_of_turn>model\n444.<end_of_turn>\n")
    assert [t for t, f in segments if f] == [
        'Let me compute.\n{"name": "multiply", "parameters": {"a": 37, "b": 12}}<end_of_turn>',
        "444.<end_of_turn>"]


# -- GPT-OSS's harmony format

HARMONY_SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
                  "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: "
                  "medium\n\n# Valid channels: analysis, commentary, final. Channel must be "
                  "included for every message.")


def test_harmony_exact_segments_with_reasoning_in_the_analysis_channel():
    """The loss covers what the model writes after ``<|start|>assistant``: the final channel's
    answer and its end marker (and, for the last answer, the analysis message before it)."""
    thought = {"role": "assistant", "content": "Hello", "thinking": "Greet back."}
    assert chat.render([SYS, {"role": "user", "content": "Hi"}, thought], "harmony") == [
        (HARMONY_SYSTEM + "<|end|><|start|>developer<|message|># Instructions\n\nYou are terse."
         "\n\n<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant", False),
        ("<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final"
         "<|message|>Hello<|return|>", True)]
    # an earlier answer's reasoning is dropped, as the template drops it
    text = chat.to_text([U1, thought, U2, A2], "harmony")
    assert "Greet back." not in text and "<|message|>Hello<|end|><|start|>user" in text
    assert render_official("gpt_oss", "harmony", [U1, thought], False) == chat.to_text(
        [U1, thought], "harmony")


def test_harmony_tool_schemas_render_as_the_template_writes_typescript():
    """Optional and required parameters, descriptions, defaults, enums, nullable, type lists,
    arrays of objects and nested objects (with the template's own indentation inside them)."""
    tool = {"type": "function", "function": {
        "name": "find", "description": "Find things.", "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what"},
            "limit": {"type": "integer", "default": 10},
            "sort": {"type": "string", "enum": ["new", "old"], "default": "new"},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True},
            "boxes": {"type": "array", "items": {"type": "object", "properties": {"w": {"type": "number"}}}},
            "where": {"type": "object", "properties": {"city": {"type": "string"},
                                                       "zip": {"type": ["string", "null"]}},
                      "required": ["city"]},
            "note": {"type": "string", "nullable": True}, "any": {}}, "required": ["query"]}}}
    messages = [ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "444"}]
    ours = chat.to_text(messages, "harmony", add_generation_prompt=True, tools=[tool, TOOL])
    assert render_with_transformers("gpt_oss", "harmony", messages, True, [tool, TOOL]) == ours
    assert 'sort?: "new" | "old", // default: new,\n' in ours


@pytest.mark.parametrize("messages, tools, match", [
    ([ASK, {"role": "assistant", "content": "<|channel|>final<|message|>4"}], None, "without <|channel|>"),
    ([ASK, {"role": "tool", "content": "444"}], None, "needs an earlier assistant tool call"),
    ([ASK, A1], [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}}}}], "'oneOf'"),
])
def test_harmony_refuses_what_its_template_refuses_or_we_do_not_render(messages, tools, match):
    with pytest.raises(ChatFormatError, match=match):
        chat.render(messages, "harmony", tools=tools)


def test_harmony_later_system_message_becomes_a_developer_message():
    text = chat.to_text([U1, {"role": "system", "content": "LATE"}, A1], "harmony")
    assert "<|start|>developer<|message|># Instructions\n\nLATE\n\n<|end|><|start|>assistant" in text
