"""Chat templates, rendered as segments so the loss can cover exactly the assistant's tokens.

``render(messages, fmt)`` returns ``[(text, is_assistant), ...]``; concatenating the texts gives
the same string as the family's official template (Gemma, Llama 3, ChatML for Qwen, Mistral).
The beginning-of-sequence token is not part of the text: the tokenizer adds it as an id.
An assistant segment is the message content plus the end-of-turn marker, which the model must
learn to produce to stop.
"""

from __future__ import annotations

FORMATS = ("gemma", "llama3", "chatml", "mistral")

# Marker that ends an assistant turn, per format (generation stops there).
END_OF_TURN = {
    "gemma": "<end_of_turn>",
    "llama3": "<|eot_id|>",
    "chatml": "<|im_end|>",
    "mistral": "</s>",
}

ROLES = ("system", "user", "assistant")


class ChatFormatError(ValueError):
    pass


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


def _fold_system(messages):
    """Gemma and Mistral templates have no system role: prepend it to the first user message."""
    if messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], list(messages[1:])
    if rest and rest[0]["role"] == "user":
        rest[0] = {"role": "user", "content": f"{system}\n\n{rest[0]['content']}"}
    else:
        rest.insert(0, {"role": "user", "content": system})
    return rest


def render(messages, fmt: str, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """Segments (text, is_assistant) of a conversation in chat format ``fmt``."""
    if fmt not in FORMATS:
        raise ChatFormatError(f"unknown chat format {fmt!r}; expected one of {FORMATS}")
    _check(messages)
    out: list[tuple[str, bool]] = []
    if fmt == "gemma":
        for m in _fold_system(messages):
            role = "model" if m["role"] == "assistant" else "user"
            out.append((f"<start_of_turn>{role}\n", False))
            if m["role"] == "assistant":
                out += [(m["content"] + "<end_of_turn>", True), ("\n", False)]
            else:
                out.append((m["content"] + "<end_of_turn>\n", False))
        if add_generation_prompt:
            out.append(("<start_of_turn>model\n", False))
    elif fmt == "llama3":
        for m in messages:
            out.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
            out.append((m["content"] + "<|eot_id|>", m["role"] == "assistant"))
        if add_generation_prompt:
            out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", False))
    elif fmt == "chatml":
        for m in messages:
            out.append((f"<|im_start|>{m['role']}\n", False))
            if m["role"] == "assistant":
                out += [(m["content"] + "<|im_end|>", True), ("\n", False)]
            else:
                out.append((m["content"] + "<|im_end|>\n", False))
        if add_generation_prompt:
            out.append(("<|im_start|>assistant\n", False))
    else:  # mistral
        for m in _fold_system(messages):
            if m["role"] == "assistant":
                out.append((m["content"] + "</s>", True))
            else:  # user, or a system message after the first (no system role in this template)
                out.append((f"[INST] {m['content']} [/INST]", False))
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
