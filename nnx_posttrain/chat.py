"""Chat templates, rendered as segments so the loss can cover exactly the assistant's tokens.

``render(messages, fmt)`` returns ``[(text, is_assistant), ...]``; concatenating the texts gives
the string the family's official Jinja template (its ``tokenizer_config.json`` ``chat_template``)
renders for system / user / assistant conversations, without the beginning-of-sequence token,
which the tokenizer adds as an id. tests/test_chat.py compares every format with the official
template, string and token ids. Deliberate differences (listed in the README):

- ``gemma``: a system message is folded into the first user turn (``system + "\\n\\n"``), as
  Gemma 3's template does; Gemma 1 and 2's templates refuse a system message.
- ``mistral`` (Mistral 7B Instruct v0.1 / v0.2): a system message is folded the same way (the
  official template refuses one); v0.3's template (no space before ``[/INST]``, a space before
  the answer, the system message in the last user turn) is not this one.
- ``llama3.1`` (Llama 3.1, 3.2, 3.3): the date line is always "26 Jul 2024", the template's own
  default; transformers renders 3.2's template with today's date.
- every format: roles need not alternate (the official templates raise), and a system message
  after the first is rendered as a user turn (Gemma, Llama 3.0, Mistral) or a system turn.

An assistant segment is the message content (trimmed where the template trims it) plus the
end-of-turn marker, which the model must learn to produce to stop; Qwen 3's empty think block
(``<think>\\n\\n</think>\\n\\n``, which its template puts before the last assistant answer) is
part of the assistant segment.
"""

from __future__ import annotations

from nnx_posttrain import errors

FORMATS = ("gemma", "llama3", "llama3.1", "qwen2.5", "qwen3", "chatml", "mistral")

# Marker that ends an assistant turn, per format (generation stops there).
END_OF_TURN = {
    "gemma": "<end_of_turn>",
    "llama3": "<|eot_id|>",
    "llama3.1": "<|eot_id|>",
    "qwen2.5": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "chatml": "<|im_end|>",
    "mistral": "</s>",
}

ROLES = ("system", "user", "assistant")

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA31_DATE = "26 Jul 2024"


# The official template (nnx_posttrain/chat_templates) that renders each format as ``render``
# does (tests/test_chat.py): what an exported model's tokenizer_config.json carries.
HF_TEMPLATES = {"gemma": "gemma3", "llama3": "llama3", "llama3.1": "llama3.1",
                "qwen2.5": "qwen2.5", "qwen3": "qwen3", "chatml": "chatml", "mistral": "mistral"}


class ChatFormatError(errors.DataError):
    """A conversation or a chat format that cannot be rendered; the message says why."""


def hf_template(fmt: str) -> str:
    """The Jinja ``chat_template`` of chat format ``fmt`` (``HF_TEMPLATES``), for ``transformers``'
    ``apply_chat_template``."""
    from pathlib import Path

    return (Path(__file__).parent / "chat_templates" / f"{HF_TEMPLATES[fmt]}.jinja").read_text()


def _check(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatFormatError(f"message {i} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatFormatError(f"message {i} has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise ChatFormatError(f"message {i} has non-string content ({type(m['content']).__name__})")


def _fold_system(messages, trim: bool):
    """Templates without a system role: the system message becomes a prefix of the first user
    message (``system + "\\n\\n"``, the user content trimmed where the template trims it)."""
    if messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], list(messages[1:])
    if rest and rest[0]["role"] == "user":
        content = rest[0]["content"].strip() if trim else rest[0]["content"]
        rest[0] = {"role": "user", "content": f"{system}\n\n{content}", "folded": True}
    else:
        rest.insert(0, {"role": "user", "content": system, "folded": True})
    return rest


def _gemma(messages, add_generation_prompt):
    out = []
    for m in _fold_system(messages, trim=True):
        role = "model" if m["role"] == "assistant" else "user"
        content = m["content"] if m.get("folded") else m["content"].strip()
        out.append((f"<start_of_turn>{role}\n", False))
        if m["role"] == "assistant":
            out += [(content + "<end_of_turn>", True), ("\n", False)]
        else:
            out.append((content + "<end_of_turn>\n", False))
    if add_generation_prompt:
        out.append(("<start_of_turn>model\n", False))
    return out


def _llama3(messages, add_generation_prompt, dated: bool):
    out = []
    if dated:  # Llama 3.1+: a system header always, with the knowledge and today's dates
        system = ""
        if messages[0]["role"] == "system":
            system, messages = messages[0]["content"].strip(), messages[1:]
        out.append(("<|start_header_id|>system<|end_header_id|>\n\n"
                    "Cutting Knowledge Date: December 2023\n"
                    f"Today Date: {LLAMA31_DATE}\n\n{system}<|eot_id|>", False))
    for m in messages:
        out.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
        out.append((m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"))
    if add_generation_prompt:
        out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", False))
    return out


def _qwen3_assistant(content: str, after_last_query: bool, last: bool) -> str:
    """An assistant message as Qwen 3's template writes it: the reasoning of a '</think>' block
    taken out of earlier turns; the last answer (after the last user query) with a think block,
    empty when there is no reasoning."""
    reasoning = ""
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        content = content.split("</think>")[-1].lstrip("\n")
    if after_last_query and (last or reasoning):
        return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    return content


def _chatml(messages, add_generation_prompt, flavour: str):
    out = []
    if flavour == "qwen2.5" and messages[0]["role"] != "system":
        out.append((f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n", False))
    last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if last_query < 0:
        last_query = len(messages) - 1
    for i, m in enumerate(messages):
        content = m["content"]
        if flavour == "qwen3" and m["role"] == "assistant":
            content = _qwen3_assistant(content, i > last_query, i == len(messages) - 1)
        out.append((f"<|im_start|>{m['role']}\n", False))
        if m["role"] == "assistant":
            out += [(content + "<|im_end|>", True), ("\n", False)]
        else:
            out.append((content + "<|im_end|>\n", False))
    if add_generation_prompt:
        out.append(("<|im_start|>assistant\n", False))
    return out


def _mistral(messages, add_generation_prompt):
    out = []
    for m in _fold_system(messages, trim=False):
        if m["role"] == "assistant":
            out.append((m["content"] + "</s>", True))
        else:  # user, or a system message after the first (no system role in this template)
            out.append((f"[INST] {m['content']} [/INST]", False))
    return out


def render(messages, fmt: str, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """Segments (text, is_assistant) of a conversation in chat format ``fmt``."""
    if fmt not in FORMATS:
        raise ChatFormatError(f"unknown chat format {fmt!r}; expected one of {FORMATS}")
    _check(messages)
    if fmt == "gemma":
        out = _gemma(messages, add_generation_prompt)
    elif fmt in ("llama3", "llama3.1"):
        out = _llama3(messages, add_generation_prompt, dated=fmt == "llama3.1")
    elif fmt in ("chatml", "qwen2.5", "qwen3"):
        out = _chatml(messages, add_generation_prompt, fmt)
    else:
        out = _mistral(messages, add_generation_prompt)
    return _merge(out)


def _merge(segments):
    merged: list[tuple[str, bool]] = []
    for text, flag in segments:
        if merged and merged[-1][1] == flag:
            merged[-1] = (merged[-1][0] + text, flag)
        else:
            merged.append((text, flag))
    return merged


def to_text(messages, fmt: str, add_generation_prompt: bool = False) -> str:
    return "".join(t for t, _ in render(messages, fmt, add_generation_prompt))
