"""The chat formats of the newer families, rendered as segments as ``chat.render`` does (its
conventions: the text is the official template's, without the beginning-of-sequence token; an
assistant segment is what the model writes, its end-of-turn marker included).

- ``gemma4`` (google/gemma-4-E2B-it and the other Gemma 4 checkpoints, the current revision of
  their template): ``<|turn>role\\n ... <turn|>``, the model's role ``model``, a system turn that
  also declares the tools (``<|tool>declaration:NAME{...}<tool|>``); a call is
  ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (strings between ``<|"|>`` quotes), its
  results follow inside the same model turn (``<|tool_response>response:NAME{value:...}
  <tool_response|>``), then the answer. The model stops after a call at ``<|tool_response>``,
  which is trained as the call's end marker;
- ``phi3`` (microsoft/Phi-3-mini-4k-instruct): ``<|role|>\\n ... <|end|>\\n``, the end-of-text
  token after the last message when no answer is prompted (not trained: the model stops at
  ``<|end|>``);
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

from nnx_posttrain import errors


class ChatFormatError(errors.DataError):
    """A conversation or a chat format that cannot be rendered; the message says why."""


# ----------------------------------------------------------------------------- Gemma 4

_Q = '<|"|>'  # Gemma 4's string quote


def _dictsort(mapping) -> list:
    """Jinja's ``dictsort``: the items by key, case-insensitively."""
    return sorted(mapping.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def gemma4_argument(value, escape_keys: bool = True) -> str:
    """The template's ``format_argument``: a value in Gemma 4's call syntax."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return _Q + value + _Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join((_Q + k + _Q if escape_keys else k) + ":"
                              + gemma4_argument(v, escape_keys) for k, v in _dictsort(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(gemma4_argument(v, escape_keys) for v in value) + "]"
    return str(value)


def _upper(value) -> str:
    return value.upper() if isinstance(value, str) else ""


def _required(names) -> str:
    return "[" + ",".join(_Q + n + _Q for n in names) + "]"


def _items(items: dict) -> str:
    parts = []
    for key, value in _dictsort(items):
        if value is None:
            continue
        if key == "properties":
            inner = _parameters(value, items.get("required") or []) if isinstance(value, dict) else ""
            parts.append("properties:{" + inner + "}")
        elif key == "required":
            parts.append("required:" + _required(value))
        elif key == "type":
            parts.append("type:" + gemma4_argument(
                value.upper() if isinstance(value, str) else [v.upper() for v in value]))
        else:
            parts.append(f"{key}:" + gemma4_argument(value))
    return "items:{" + ",".join(parts) + "}"


_STANDARD = ("description", "type", "properties", "required", "nullable")


def _parameter(value: dict) -> list[str]:
    """One property's fields (the template's ``format_parameters`` body), in its order."""
    kind, parts = _upper(value.get("type")), []
    if value.get("description"):
        parts.append("description:" + _Q + value["description"] + _Q)
    if kind == "STRING" and value.get("enum"):
        parts.append("enum:" + gemma4_argument(value["enum"]))
    elif kind == "ARRAY" and isinstance(value.get("items"), dict) and value["items"]:
        parts.append(_items(value["items"]))
    if value.get("nullable"):
        parts.append("nullable:true")
    if kind == "OBJECT":
        if isinstance(value.get("properties"), dict):
            parts.append("properties:{" + _parameters(value["properties"],
                                                       value.get("required") or []) + "}")
        else:
            parts.append("properties:{" + _parameters(value, value.get("required") or [],
                                                       filter_keys=True) + "}")
        if value.get("required"):
            parts.append("required:" + _required(value["required"]))
    parts.append("type:" + _Q + kind + _Q + "}")
    return parts


def _parameters(properties: dict, required, filter_keys: bool = False) -> str:
    return ",".join(f"{key}:{{" + ",".join(_parameter(value))
                    for key, value in _dictsort(properties)
                    if not filter_keys or key not in _STANDARD)


def gemma4_declaration(tool: dict) -> str:
    """The template's ``format_function_declaration`` of a tool's JSON schema."""
    function = tool["function"]
    out = "declaration:" + function["name"] + "{description:" + _Q + function.get(
        "description", "") + _Q
    params = function.get("parameters")
    if params:
        out += ",parameters:{"
        if params.get("properties"):
            out += "properties:{" + _parameters(params["properties"], params.get("required")) + "},"
        if params.get("required"):
            out += "required:" + _required(params["required"]) + ","
        if params.get("type"):
            out += "type:" + _Q + params["type"].upper() + _Q + "}"
    if "response" in function:
        response = function["response"]
        out += ",response:{"
        if response.get("description"):
            out += "description:" + _Q + response["description"] + _Q + ","
        if _upper(response.get("type")) == "OBJECT":
            out += "type:" + _Q + response["type"].upper() + _Q + "}"
    return (out + "}").strip()


def _gemma4_response(name: str, response) -> str:
    """The template's ``format_tool_response_block``, without its opening marker."""
    if isinstance(response, dict):
        body = ",".join(f"{k}:{gemma4_argument(v, False)}" for k, v in _dictsort(response))
        return f"response:{name}{{{body}}}<tool_response|>"
    return f"response:{name}{{value:{gemma4_argument(response, False)}}}<tool_response|>"


def _strip_thinking(text: str) -> str:
    """The template's ``strip_thinking``: an answer without its ``<|channel>...<channel|>``
    reasoning, trimmed."""
    return "".join(part.split("<|channel>")[0] for part in text.split("<channel|>")).strip()


def _gemma4_results(messages, i: int, calls) -> list[tuple[str, bool]]:
    """The ``tool`` messages after message ``i`` (a turn that called ``calls``), each a response
    block; the first one's opening marker is the call's end (trained)."""
    out = []
    for follow in messages[i + 1:]:
        if follow["role"] != "tool":
            break
        name = follow.get("name") or "unknown"
        for call in calls:  # the template resolves the name by tool_call_id (None == None)
            if call.get("id") == follow.get("tool_call_id"):
                name = call["name"]
        out += [("<|tool_response>", not out), (_gemma4_response(name, follow["content"]), False)]
    return out


def _gemma4_turn(messages, i: int, prev_role) -> list[tuple[str, bool]]:
    """One non-tool message of the loop, with the results of its calls and its turn's end."""
    m = messages[i]
    model = m["role"] == "assistant"
    out = [] if model and prev_role == "assistant" else [
        ("<|turn>" + ("model" if model else m["role"]) + "\n", False)]
    calls = m.get("tool_calls") or []
    for call in calls:
        args = ",".join(f"{k}:{gemma4_argument(v, False)}" for k, v in _dictsort(call["arguments"]))
        out.append(("<|tool_call>call:" + call["name"] + "{" + args + "}<tool_call|>", True))
    results = _gemma4_results(messages, i, calls) if calls else []
    out += results
    content = _strip_thinking(m["content"]) if model else m["content"].strip()
    out.append((content, model))
    later = next((n["role"] for n in messages[i + 1:] if n["role"] != "tool"), None)
    if calls and not results:
        out.append(("<|tool_response>", True))  # the call's end: the results come next
    elif model and later == "assistant":
        pass  # the same model turn goes on
    elif not (results and not content and later is None):
        out += [("<turn|>", model), ("\n", False)]
    return out


def gemma4(messages, add_generation_prompt: bool, tools=None) -> list[tuple[str, bool]]:
    out, loop = [], messages
    if tools or messages[0]["role"] == "system":
        head = "<|turn>system\n"
        if messages[0]["role"] == "system":
            head, loop = head + messages[0]["content"].strip(), messages[1:]
        head += "".join("<|tool>" + gemma4_declaration(t) + "<tool|>" for t in tools or ())
        out.append((head + "<turn|>\n", False))
    prev_role, last = None, None
    for i, m in enumerate(loop):
        if m["role"] == "tool":
            continue
        out += _gemma4_turn(loop, i, prev_role)
        prev_role, last = m["role"], m
    waiting = last is not None and last.get("tool_calls")  # a call, its results, or both
    if add_generation_prompt and not waiting:
        out.append(("<|turn>model\n", False))
    return out


# ----------------------------------------------------------------------------- Phi-3


def phi3(messages, add_generation_prompt: bool, eos: str = "<|endoftext|>"):
    out = []
    for m in messages:
        if m["role"] == "assistant":
            out += [("<|assistant|>\n", False), (m["content"] + "<|end|>", True), ("\n", False)]
        else:  # system, user (the template renders no other role)
            out.append((f"<|{m['role']}|>\n{m['content']}<|end|>\n", False))
    out.append(("<|assistant|>\n" if add_generation_prompt else eos, False))
    return out


# ----------------------------------------------------------------------------- GPT-OSS (harmony)

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
