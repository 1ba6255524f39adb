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
- ``qwen3.5`` (Qwen3.5-4B and larger, 35B-A3B) and ``qwen3.5-nothink`` (Qwen3.5-0.8B, 2B): ChatML
  turns with every content trimmed, a think block on each answer after the last user query
  (trained, as Qwen 3's), tools declared in the system turn and calls written as XML
  (``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n
  </tool_call>``); the generation prompt opens a think block (``qwen3.5``) or writes an empty
  one (``-nothink``).
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


# ----------------------------------------------------------------------------- Qwen 3.5

QWEN35_TOOLS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>")


def _qwen3_5_system(messages, tools, to_json) -> list[tuple[str, bool]]:
    """The system turn: the tools (their JSON schemas, the XML call format) then the system
    message, or the system message alone."""
    system = messages[0]["content"].strip() if messages[0]["role"] == "system" else None
    if tools:
        text = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
                "<tools>" + "".join("\n" + to_json(t) for t in tools) + QWEN35_TOOLS)
        return [(text + ("\n\n" + system if system else "") + "<|im_end|>\n", False)]
    return [] if system is None else [(f"<|im_start|>system\n{system}<|im_end|>\n", False)]


def _qwen3_5_calls(content: str, calls, to_json) -> str:
    """The template's tool calls: XML blocks, one parameter each, a mapping or list argument as
    JSON and any other as Jinja's ``string`` filter writes it."""
    out = ""
    for i, call in enumerate(calls):
        out += ("\n\n" if content.strip() else "") if i == 0 else "\n"
        out += f"<tool_call>\n<function={call['name']}>\n"
        for name, value in call["arguments"].items():
            text = to_json(value) if isinstance(value, (dict, list, tuple)) else str(value)
            out += f"<parameter={name}>\n{text}\n</parameter>\n"
        out += "</function>\n</tool_call>"
    return out


def _qwen3_5_assistant(m: dict, after_last_query: bool, to_json) -> str:
    """An assistant message's body: its reasoning (``reasoning_content``, else a ``</think>``
    block of its content) in a think block after the last user query (dropped before it)."""
    content = m["content"].strip()
    reasoning = m.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    head = f"<think>\n{reasoning.strip()}\n</think>\n\n" if after_last_query else ""
    return head + content + _qwen3_5_calls(content, m.get("tool_calls") or (), to_json) + \
        "<|im_end|>"


def _tojson(value) -> str:
    """``tojson`` as transformers' chat templates compute it (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def qwen3_5(messages, add_generation_prompt: bool, tools=None,
            think: bool = True) -> list[tuple[str, bool]]:
    """Qwen 3.5's template (``think``: Qwen3.5-4B and larger; else 0.8B / 2B, whose generation
    prompt closes an empty think block). Every content is trimmed; an answer after the last
    user query has a think block; tool results share one user turn. Where the template raises
    (a system message after the first, no user query), the turn is rendered (a system turn) or
    the last message taken as the query, as for the other formats."""
    to_json = _tojson
    out = _qwen3_5_system(messages, tools, to_json)
    last_query = max((i for i, m in enumerate(messages) if m["role"] == "user" and not (
        m["content"].strip().startswith("<tool_response>")
        and m["content"].strip().endswith("</tool_response>"))), default=len(messages) - 1)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"].strip()
        if role == "system" and i == 0:
            continue
        if role == "tool":
            prev = messages[i - 1]["role"] if i else "tool"
            nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
            out.append((("<|im_start|>user" if prev != "tool" else "") + "\n<tool_response>\n"
                        + content + "\n</tool_response>" + ("<|im_end|>\n" if nxt != "tool"
                                                             else ""), False))
        elif role == "assistant":
            out += [("<|im_start|>assistant\n", False),
                    (_qwen3_5_assistant(m, i > last_query, to_json), True), ("\n", False)]
        else:  # user, or a later system message (which the template refuses)
            out.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", False))
    if add_generation_prompt:
        out.append(("<|im_start|>assistant\n" + ("<think>\n" if think else
                                                 "<think>\n\n</think>\n\n"), False))
    return out
