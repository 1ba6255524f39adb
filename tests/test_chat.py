"""Chat templates: exact rendered strings per family, which segments carry loss, and errors."""

import pytest

import nnx_posttrain  # noqa: F401  (sets the Keras backend before anything imports keras)
from nnx_posttrain import chat
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
    eot = chat.END_OF_TURN[fmt]
    assert assistant_text(segs) == f"Hello{eot}Sure{eot}"
    # every flagged segment is exactly one assistant answer plus its end-of-turn marker
    assert [t for t, f in segs if f] == [f"Hello{eot}", f"Sure{eot}"]
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
    assert flagged == "ANSWER" + chat.END_OF_TURN[fmt]


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
    assert assistant_text(segs) == "A" + chat.END_OF_TURN[fmt]


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
    msgs = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(ChatFormatError, match="message 1 has role 'tool'"):
        chat.render(msgs, "gemma")


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
