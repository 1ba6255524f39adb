"""Tool calls in generated text, and the tokens that hand their results back to the model.

``parse(text, fmt, tools)`` reads the calls of one assistant turn as the chat format writes them
(``nnx_posttrain.chat``): Qwen 2.5's and 3's ``<tool_call>{"name", "arguments"}</tool_call>``
blocks, Llama 3.1's and the gemma convention's ``{"name", "parameters"}`` JSON object (here);
Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` (``gemma4_calls``), Qwen 3.5's XML calls
(``qwen35_calls``), harmony's ``to=functions.NAME`` messages (``harmony_calls``).
``continuation(fmt, results)`` is the text the format puts between the end of that turn and the
model's next words: the ``tool`` messages with the results, then the generation prompt (what
TRL's ``_get_tool_suffix_ids`` cuts out of a rendered conversation; here rendered by
``chat.render``): for Gemma 4 the results alone, inside the same model turn.
"""

from __future__ import annotations

import json
import re

from nnx_posttrain import chat
from nnx_posttrain.agents import gemma4_calls, harmony_calls, qwen35_calls
from nnx_posttrain.agents.malformed import Malformed

_QWEN_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _call(obj, key: str) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise Malformed('a tool call must be a JSON object with a "name" string')
    arguments = obj.get(key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise Malformed(f'tool call {obj["name"]!r}: "{key}" is a string that is not '
                            "JSON") from None
    if not isinstance(arguments, dict):
        raise Malformed(f'tool call {obj["name"]!r}: "{key}" must be an object')
    return {"name": obj["name"], "arguments": arguments}


def _qwen(text: str) -> list[dict]:
    calls = []
    for body, end in _QWEN_CALL.findall(text):
        if not end:
            raise Malformed("a <tool_call> block is not closed")
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            raise Malformed(f"a <tool_call> block is not JSON ({exc.msg})") from None
        calls.append(_call(obj, "arguments"))
    return calls


def _json_object(text: str) -> list[dict]:
    """Llama 3.1 (the whole turn, after an optional <|python_tag|>) and gemma (the first line
    that opens a JSON object): one call."""
    text = text.replace("<|python_tag|>", "")
    start = next((m.start() for m in re.finditer(r"(?m)^\s*\{", text)), None)
    if start is None:
        return []
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:].lstrip())
    except json.JSONDecodeError as exc:
        raise Malformed(f"the tool call is not JSON ({exc.msg})") from None
    return [_call(obj, "parameters")]


# The chat formats whose tool calls ``parse`` reads (``chat.TOOL_FORMATS``: a format that
# renders tool conversations for training but whose calls are not read here is refused by the
# agent runs before their first step)
PARSED_FORMATS = ("qwen2.5", "qwen3", "llama3.1", "gemma", "gemma4", "qwen3.5", "qwen3.5-nothink",
                  "harmony")
# Formats that take one call per assistant turn (the loop runs the first)
ONE_CALL = ("llama3.1", "gemma", "harmony")


def parse(text: str, fmt: str, tools: list | None = None) -> list[dict]:
    """The tool calls ({'name', 'arguments'}) of one assistant turn in chat format ``fmt`` ([]
    for an answer that calls nothing); ``Malformed`` for a call that cannot be read. ``text``:
    the turn as the model wrote it, its end-of-turn marker removed, and for Gemma 4 and harmony,
    whose calling turns stop at a marker of their own (``chat.CALL_END``), that marker kept;
    ``tools``: the JSON schemas of the tools (Qwen 3.5 reads each argument by its type)."""
    if fmt in ("qwen2.5", "qwen3"):
        return _qwen(text)
    if fmt in ("llama3.1", "gemma"):
        return _json_object(text)
    if fmt == "gemma4":
        return gemma4_calls.parse(text)
    if fmt in ("qwen3.5", "qwen3.5-nothink"):
        return qwen35_calls.parse(text, tools)
    if fmt == "harmony":
        return harmony_calls.parse(text)
    raise chat.ChatFormatError(f"chat format {fmt!r}: its tool calls are not read from generated "
                               f"text; formats whose calls are: {', '.join(PARSED_FORMATS)}")


def continuation(fmt: str, results: list[tuple[str, str]]) -> str:
    """The text after an assistant turn that called tools: the ``tool`` messages of
    ``results`` ((tool name, result text), in call order) and the next assistant turn's
    generation prompt, as ``chat.render`` writes them (each result named after its own call)."""
    calls = [{"name": name, "arguments": {}} for name, _ in results]
    if fmt in ONE_CALL:
        calls = calls[:1]
    turn = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": calls}]
    tools = [{"role": "tool", "name": name, "content": content, "tool_call_id": f"call{k}"}
             for k, (name, content) in enumerate(results)]
    segments = chat.render(turn + tools, fmt, add_generation_prompt=True)
    # the call turn's last words (Gemma 4 flags its empty answer after the results: not it)
    last = max(i for i, (text, is_assistant) in enumerate(segments) if is_assistant and text)
    return "".join(text for text, _ in segments[last + 1:])
