"""GPT-OSS's chat format, OpenAI's harmony, as ``chat.render`` renders it (``chat_formats`` holds
the other newer families' formats):

- ``harmony`` (openai/gpt-oss-20b, gpt-oss-120b): ``<|start|>role<|message|> ... <|end|>``, a
  system message the template writes (identity, knowledge cutoff, date, ``Reasoning: medium``,
  the channels), the conversation's system message as the developer message's instructions
  (with the tools as a TypeScript namespace ``functions``), answers in the ``final`` channel:
  ``<|start|>assistant`` (the prompt) then ``<|channel|>final<|message|>ANSWER`` and
  ``<|return|>`` for a training conversation's last answer (its ``thinking``, if any, in the
  ``analysis`` channel before it), ``<|end|>`` for an earlier one (its thinking dropped, as the
  template drops it); a call is ``<|start|>assistant to=functions.NAME<|channel|>commentary
  json<|message|>{args}<|call|>`` (one per message; trained from ``assistant`` on: KerasHub's
  byte-level BPE merges across `` to``, never across a special token), its result
  ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"result"<|end|>``.
  Deliberate differences: the
  date is always ``HARMONY_DATE`` (the template writes today's), a system message after the
  first becomes a developer message (the template drops it), ``oneOf`` parameter schemas are
  refused (the port renders the rest of the template's TypeScript types).
"""

from __future__ import annotations

import json

from nnx_posttrain.chat_formats import ChatFormatError


HARMONY_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
HARMONY_DATE = "2025-08-05"  # the template writes today's date; ours is gpt-oss's release date
HARMONY_REASONING = "medium"  # the template's default reasoning_effort
_CHANNEL_TAGS = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")


def _ts_type(spec: dict, required) -> str:
    """The template's ``render_typescript_type``: a JSON schema as a TypeScript type (its
    ``oneOf`` branch is refused by ``_ts_supported``)."""
    kind, nullable = spec.get("type"), " | null" if spec.get("nullable") else ""
    if kind == "array":
        items = spec.get("items")
        if not items:
            return "any[]" + nullable
        simple = {"string": "string[]", "number": "number[]", "integer": "number[]",
                  "boolean": "boolean[]"}
        inner = simple.get(items.get("type"))
        if inner is None:
            inner = _ts_type(items, required)
            inner = "any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]"
        return inner + nullable
    if isinstance(kind, list) and kind:
        return " | ".join(kind)
    if kind == "string":
        return '"' + '" | "'.join(spec["enum"]) + '"' if spec.get("enum") else "string" + nullable
    if kind in ("number", "integer", "boolean"):
        return "boolean" if kind == "boolean" else "number"
    if kind == "object" and spec.get("properties"):  # the template's indentation, as it writes it
        inner = spec.get("required") or []
        return "{\n" + ", ".join(name + ("" if name in inner else "?") + ": \n" + " " * 16
                                 + _ts_type(value, inner)
                                 for name, value in spec["properties"].items()) + "}"
    return "object" if kind == "object" else "any"


def _ts_supported(tool: dict) -> None:
    """Refuse what the port does not render: ``oneOf`` schemas (the template's branch for them
    writes whitespace that depends on its indentation)."""
    def walk(value):
        if isinstance(value, dict):
            if "oneOf" in value:
                raise ChatFormatError(f"tool {tool['function']['name']!r}: the harmony format does "
                                   "not render 'oneOf' parameter schemas")
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(tool["function"].get("parameters"))


def _ts_default(spec: dict) -> str:
    if "default" not in spec:
        return ""
    if spec.get("enum"):
        return ", // default: " + str(spec["default"])
    return ", // default: " + json.dumps(spec["default"], ensure_ascii=False)


def harmony_tools(tools) -> str:
    """The template's ``render_tool_namespace("functions", tools)``."""
    out = "## functions\n\nnamespace functions {\n\n"
    for tool in tools:
        _ts_supported(tool)
        function = tool["function"]
        out += "// " + function.get("description", "") + "\ntype " + function["name"] + " = "
        params = function.get("parameters") or {}
        if not params.get("properties"):
            out += "() => any;\n\n"
            continue
        required = params.get("required") or []
        out += "(_: {\n"
        for name, spec in params["properties"].items():
            out += ("// " + spec["description"] + "\n" if spec.get("description") else "") + name
            out += ("" if name in required else "?") + ": " + _ts_type(spec, required)
            out += _ts_default(spec) + ",\n"
        out += "}) => any;\n\n"
    return out + "} // namespace functions"


def _harmony_head(messages, tools) -> tuple[str, list]:
    """The system message, the developer message (the first system message's content and the
    tools), and the messages after them."""
    head = ("<|start|>system<|message|>" + HARMONY_IDENTITY + "\nKnowledge cutoff: 2024-06\n"
            f"Current date: {HARMONY_DATE}\n\nReasoning: {HARMONY_REASONING}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every "
            "message.")
    if tools:
        head += "\nCalls to these tools must go to the commentary channel: 'functions'."
    head += "<|end|>"
    developer, rest = "", messages
    if messages[0]["role"] == "system":
        developer, rest = messages[0]["content"], messages[1:]
    if developer or tools:
        head += "<|start|>developer<|message|>"
        head += "# Instructions\n\n" + developer + "\n\n" if developer else ""
        head += "# Tools\n\n" + harmony_tools(tools) if tools else ""
        head += "<|end|>"
    return head, rest


def _harmony_call(messages, i: int) -> str:
    """What the model writes after ``<|start|>assistant`` for tool-calling message ``i``: its
    text (or thinking) as an analysis message when no later answer follows, then the call."""
    m = messages[i]
    if len(m["tool_calls"]) != 1:
        raise ChatFormatError("the harmony template takes one tool call per assistant message, "
                           f"got {len(m['tool_calls'])}")
    if m["content"] and m.get("thinking"):
        raise ChatFormatError("the harmony template takes an assistant message with a tool call "
                           "with content or thinking, not both")
    answered = any(n["role"] == "assistant" and not n.get("tool_calls") for n in messages[i + 1:])
    text, out = m["content"] or m.get("thinking"), ""
    if text and not answered:
        out = "<|channel|>analysis<|message|>" + text + "<|end|><|start|>assistant"
    call = m["tool_calls"][0]
    return (out + " to=functions." + call["name"] + "<|channel|>commentary json<|message|>"
            + json.dumps(call["arguments"], ensure_ascii=False) + "<|call|>")


def _harmony_answer(m: dict, last: bool) -> str:
    """A final-channel answer after ``<|start|>assistant``: the last message of a training
    conversation ends with ``<|return|>`` (with its ``thinking`` as an analysis message before
    it), an earlier one with ``<|end|>`` (its thinking dropped)."""
    if not last:
        return "<|channel|>final<|message|>" + m["content"] + "<|end|>"
    thinking = ("<|channel|>analysis<|message|>" + m["thinking"] + "<|end|><|start|>assistant"
                if "thinking" in m else "")
    return thinking + "<|channel|>final<|message|>" + m["content"] + "<|return|>"


def harmony(messages, add_generation_prompt: bool, tools=None) -> list[tuple[str, bool]]:
    """GPT-OSS's harmony format (the published template, ``chat_templates/gpt_oss.jinja``)."""
    for m in messages:
        if any(tag in (m.get(key) or "") for tag in _CHANNEL_TAGS for key in ("content", "thinking")):
            raise ChatFormatError("pass an assistant's reasoning in 'thinking' and its answer in "
                               "'content', without <|channel|> tags")
    head, loop = _harmony_head(messages, tools)
    out, called = [(head, False)], None
    for i, m in enumerate(loop):
        if m["role"] == "assistant":
            if m.get("tool_calls"):  # trained from "assistant" on when it opens with the call:
                call = _harmony_call(loop, i)  # "<|start|>" is a token boundary, " to=" is not
                opens = call.startswith(" to=")
                out += [("<|start|>" if opens else "<|start|>assistant", False),
                        (("assistant" if opens else "") + call, True)]
                called = m["tool_calls"][0]["name"]
                continue
            out.append(("<|start|>assistant", False))
            last = i == len(loop) - 1 and not add_generation_prompt
            out.append((_harmony_answer(m, last), True))
            called = None if not last else called
        elif m["role"] == "tool":
            if called is None:
                raise ChatFormatError("a tool message needs an earlier assistant tool call")
            out.append((f"<|start|>functions.{called} to=assistant<|channel|>commentary"
                        f"<|message|>{json.dumps(m['content'], ensure_ascii=False)}<|end|>", False))
        else:  # user; a later system message: a developer message (the template drops it)
            text = (m["content"] if m["role"] == "user" else
                    "# Instructions\n\n" + m["content"] + "\n\n")
            out.append((f"<|start|>{'user' if m['role'] == 'user' else 'developer'}"
                        f"<|message|>{text}<|end|>", False))
    if add_generation_prompt:
        out.append(("<|start|>assistant", False))
    return out
