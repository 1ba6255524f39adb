"""Chat templates, rendered as segments so the loss can cover exactly the assistant's tokens.

``render(messages, fmt)`` returns ``[(text, is_assistant), ...]``; concatenating the texts gives
the string the family's official Jinja template (its ``tokenizer_config.json`` ``chat_template``)
renders for system / user / assistant conversations, without the beginning-of-sequence token,
which the tokenizer adds as an id. tests/test_chat.py compares every format with the official
template, string and token ids. Deliberate differences (listed in the README):

- ``gemma``: a system message is folded into the first user turn (``system + "\\n\\n"``), as
  Gemma 3's template does; Gemma 1 and 2's templates refuse a system message.
- ``mistral`` (Mistral 7B Instruct v0.2, Mixtral 8x7B Instruct v0.1: one published template): a
  system message is folded the same way (the official template refuses one). Not this one:
  v0.1's template (a space after each ``</s>``, which changes the token ids) and v0.3's (no
  space before ``[/INST]``, a space before the answer, the system message in the last user turn).
- ``llama3.1`` (Llama 3.1, 3.2, 3.3): the date line is always "26 Jul 2024", the template's own
  default; transformers renders 3.2's template with today's date.
- every format: roles need not alternate (the official templates raise), and a system message
  after the first is rendered as a user turn (Gemma, Llama 3.0, Mistral) or a system turn.

Tool calling (``TOOL_FORMATS``: Qwen 2.5, Qwen 3, Llama 3.1+, Gemma): ``tools`` (JSON schemas),
assistant ``tool_calls`` and ``tool`` results are rendered as the Qwen and Llama templates' tool
branches, and for Gemma (whose templates have none) as this package's convention (``_gemma``);
the other formats refuse them by name. The newer families' formats (Gemma 4 with its tool
branch, Phi-3, Qwen 3.5 with its XML tool calls) are rendered in ``chat_formats``, GPT-OSS's
harmony with its tool branch in ``chat_harmony``.

An assistant segment is the message content (trimmed where the template trims it; with its tool
calls as the template writes them) plus the end-of-turn marker, which the model must learn to
produce to stop; Qwen 3's empty think block (``<think>\\n\\n</think>\\n\\n``, which its template
puts before the last assistant answer) is part of the assistant segment.
"""

from __future__ import annotations

import json

from nnx_posttrain import chat_formats, chat_harmony
from nnx_posttrain.chat_formats import ChatFormatError  # noqa: F401  (chat's error)

FORMATS = ("gemma", "llama3", "llama3.1", "qwen2.5", "qwen3", "chatml", "mistral", "gemma4",
           "phi3", "qwen3.5", "qwen3.5-nothink", "harmony")

# Marker that ends an assistant turn, per format (generation stops there).
END_OF_TURN = {
    "gemma": "<end_of_turn>", "llama3": "<|eot_id|>", "llama3.1": "<|eot_id|>",
    "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "chatml": "<|im_end|>",
    "mistral": "</s>", "gemma4": "<turn|>", "phi3": "<|end|>",
    "qwen3.5": "<|im_end|>", "qwen3.5-nothink": "<|im_end|>",
    "harmony": "<|return|>",  # a training conversation's last answer (earlier ones: <|end|>)
}
# Marker that ends an assistant turn that calls tools, where it is not END_OF_TURN: generation
# stops there too (GPT-OSS's generation config lists <|call|>), and the results follow it
CALL_END = {"gemma4": "<|tool_response>", "harmony": "<|call|>"}

ROLES = ("system", "user", "assistant", "tool")
# Formats that render tool calling (tools, assistant tool calls, tool results): the official
# templates' tool branches, and gemma's convention (``_gemma``); the others refuse them.
TOOL_FORMATS = ("qwen2.5", "qwen3", "llama3.1", "gemma", "gemma4", "qwen3.5", "qwen3.5-nothink",
                "harmony")

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA31_DATE = "26 Jul 2024"


# The official template (nnx_posttrain/chat_templates) that renders each format as ``render``
# does (tests/test_chat.py): what an exported model's tokenizer_config.json carries.
HF_TEMPLATES = {"gemma": "gemma3", "llama3": "llama3", "llama3.1": "llama3.1",
                "qwen2.5": "qwen2.5", "qwen3": "qwen3", "chatml": "chatml", "mistral": "mistral",
                "gemma4": "gemma4", "phi3": "phi3", "qwen3.5": "qwen3.5",
                "qwen3.5-nothink": "qwen3.5-nothink", "harmony": "gpt_oss"}


def hf_template(fmt: str) -> str:
    """The Jinja ``chat_template`` of chat format ``fmt`` (``HF_TEMPLATES``), for ``transformers``'
    ``apply_chat_template``."""
    from pathlib import Path

    return (Path(__file__).parent / "chat_templates" / f"{HF_TEMPLATES[fmt]}.jinja").read_text()


def _check(messages, fmt: str, tools) -> list[dict]:
    """The conversation, checked, with each tool call's arguments as an object (a JSON string
    is parsed) and the content of a tool-calling assistant turn as a string ('' for none)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or (
                "content" not in m and not m.get("tool_calls")):
            raise ChatFormatError(f"message {i} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatFormatError(f"message {i} has role {m['role']!r}; expected one of {ROLES}")
        calls = m.get("tool_calls")
        m = dict(m, content="" if m.get("content") is None and calls else m["content"])
        if not isinstance(m["content"], str):
            raise ChatFormatError(f"message {i} has non-string content ({type(m['content']).__name__})")
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise ChatFormatError(f"message {i}: only an assistant message has 'tool_calls'")
            m["tool_calls"] = [_tool_call(i, call) for call in m["tool_calls"]]
        out.append(m)
    uses_tools = tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in out)
    if uses_tools and fmt not in TOOL_FORMATS:
        raise ChatFormatError(
            f"chat format {fmt!r}: its official template has no tool-calling format (tools, "
            f"tool calls, tool results); formats that render one: {', '.join(TOOL_FORMATS)}")
    if tools is not None:
        problem = tools_problem(tools)
        if problem:
            raise ChatFormatError(f"tools {problem}")
    return out


TOOL_SHAPE = ("{'type': 'function', 'function': {'name': str, 'description': str, "
              "'parameters': {JSON schema object}}}")


def tools_problem(tools) -> str | None:
    """What keeps ``tools`` from being a list of tools' JSON schemas in the shape the templates
    write and the tool-calling loop reads (``TOOL_SHAPE``), as the end of a sentence; None if
    nothing does."""
    if not isinstance(tools, list):
        return f"must be a list of JSON schema objects {TOOL_SHAPE}, got {type(tools).__name__}"
    for i, tool in enumerate(tools):
        problem = _tool_problem(tool)
        if problem:
            return f"item {i} {problem}; each tool is {TOOL_SHAPE}"
    return None


def _tool_problem(tool) -> str | None:
    """What is wrong with one tool's schema (``tools_problem``), or None."""
    if not isinstance(tool, dict):
        return f"is a {type(tool).__name__}, not an object"
    if tool.get("type", "function") != "function":
        return f"has 'type' {tool['type']!r}, not 'function'"
    function = tool.get("function")
    if not isinstance(function, dict):
        return f"has 'function' {_kind(function)}, not an object"
    if not isinstance(function.get("name"), str) or not function.get("name"):
        return f"has 'function.name' {_kind(function.get('name'))}, not a string"
    if not isinstance(function.get("description", ""), str):
        return f"has 'function.description' {_kind(function['description'])}, not a string"
    if not isinstance(function.get("parameters", {}), dict):
        return f"has 'function.parameters' {_kind(function['parameters'])}, not an object"
    return None


def _kind(value) -> str:
    """A value named in a message: its type, and the value where short."""
    return "missing" if value is None else f"{type(value).__name__} {str(value)[:30]!r}"


def _tool_call(i: int, call) -> dict:
    """A tool call as the templates read it: {'name', 'arguments': an object}."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatFormatError(f"message {i}: each tool call must be {{'type': 'function', "
                              "'function': {'name': str, 'arguments': object}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ChatFormatError(f"message {i}: tool call {function['name']!r} has arguments "
                                  f"that are not JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"message {i}: tool call {function['name']!r} needs its "
                              "arguments as an object")
    return {"name": function["name"], "arguments": arguments}


def _tool_run_edges(messages, i: int) -> tuple[bool, bool]:
    """Whether tool result ``i`` opens and whether it closes its run of consecutive results
    (which Qwen's template and the gemma convention write as one user turn)."""
    return (i == 0 or messages[i - 1]["role"] != "tool",
            i == len(messages) - 1 or messages[i + 1]["role"] != "tool")


def _json(value, indent=None) -> str:
    """``tojson`` as transformers' chat templates compute it (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


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


GEMMA_TOOLS = (
    "You can call these functions. To call one, answer with nothing but a JSON object "
    '{"name": function name, "parameters": an object of argument names and values}; each '
    "result comes back as a tool_output block.\n")


def _gemma(messages, add_generation_prompt, tools=None):
    """Gemma's template; with tools, this package's convention (Gemma's templates have no tool
    branch; Google documents tool use in Gemma 3 as a prompt that lists the functions' JSON
    schemas and asks for a JSON call, results returned in a ```tool_output``` block): the
    schemas open the first user turn (``GEMMA_TOOLS``, one schema per line); a call is the
    assistant's text, a new line, then ``{"name": ..., "parameters": {...}}`` (one call per
    turn); consecutive results share one user turn, each in a ```tool_output``` block."""
    messages = _fold_system(messages, trim=True)
    if tools is not None:
        if messages[0]["role"] != "user":
            raise ChatFormatError("with tools, the gemma format needs a user message first (after "
                                  "the system message): the tools open it")
        listed = GEMMA_TOOLS + "".join(_json(t) + "\n" for t in tools) + "\n"
        content = messages[0]["content"]
        messages = [dict(messages[0], content=listed + (content if messages[0].get("folded")
                                                         else content.strip()), folded=True),
                    *messages[1:]]
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            first, last = _tool_run_edges(messages, i)
            out.append((("<start_of_turn>user\n" if first else "\n") + "```tool_output\n"
                        + m["content"] + "\n```" + ("<end_of_turn>\n" if last else ""), False))
            continue
        role = "model" if m["role"] == "assistant" else "user"
        content = m["content"] if m.get("folded") else m["content"].strip()
        out.append((f"<start_of_turn>{role}\n", False))
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or ()
            if len(calls) > 1:
                raise ChatFormatError("the gemma format takes one tool call per assistant "
                                      f"message, got {len(calls)}")
            content += "".join(("\n" if content else "") + _json_call(c) for c in calls)
            out += [(content + "<end_of_turn>", True), ("\n", False)]
        else:
            out.append((content + "<end_of_turn>\n", False))
    if add_generation_prompt:
        out.append(("<start_of_turn>model\n", False))
    return out


def _json_call(call) -> str:
    """A tool call as Llama 3.1's template (and the gemma convention) writes it."""
    return f'{{"name": "{call["name"]}", "parameters": {_json(call["arguments"])}}}'


LLAMA31_TOOLS = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n")


def _llama3(messages, add_generation_prompt, dated: bool, tools=None):
    out = []
    if dated:  # Llama 3.1+: a system header always, with the knowledge and today's dates
        system = ""
        if messages[0]["role"] == "system":
            system, messages = messages[0]["content"].strip(), messages[1:]
        out.append(("<|start_header_id|>system<|end_header_id|>\n\n"
                    + ("Environment: ipython\n" if tools is not None else "")
                    + "Cutting Knowledge Date: December 2023\n"
                    f"Today Date: {LLAMA31_DATE}\n\n{system}<|eot_id|>", False))
    if tools is not None:  # in the first user message, as the template's default
        if not messages or messages[0]["role"] != "user":
            raise ChatFormatError("with tools, Llama 3.1's template needs a user message first "
                                  "(after the system message): the tools go into it")
        out.append(("<|start_header_id|>user<|end_header_id|>\n\n" + LLAMA31_TOOLS
                    + "".join(_json(t, indent=4) + "\n\n" for t in tools)
                    + messages[0]["content"].strip() + "<|eot_id|>", False))
        messages = messages[1:]
    for m in messages:
        if m["role"] == "tool":  # a string result is "iterable" to the template: written as JSON
            out.append(("<|start_header_id|>ipython<|end_header_id|>\n\n"
                        + _json(m["content"]) + "<|eot_id|>", False))
            continue
        out.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
        if m.get("tool_calls"):
            if len(m["tool_calls"]) != 1:
                raise ChatFormatError("Llama 3.1's template takes one tool call per assistant "
                                      f"message, got {len(m['tool_calls'])}")
            call = m["tool_calls"][0]
            out.append((_json_call(call) + "<|eot_id|>", True))
            continue
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


def _qwen_tools(tools) -> str:
    """The tools' part of Qwen 2.5's and Qwen 3's system message."""
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            + "".join("\n" + _json(t) for t in tools)
            + "\n</tools>\n\nFor each function call, return a json object with function name "
            "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


def _chatml(messages, add_generation_prompt, flavour: str, tools=None):
    out = []
    if tools and flavour in ("qwen2.5", "qwen3"):  # the tools go into the system message
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        if flavour == "qwen2.5":
            head = (QWEN25_SYSTEM if system is None else system) + "\n\n"
        else:
            head = "" if system is None else system + "\n\n"
        out.append(("<|im_start|>system\n" + head + _qwen_tools(tools), False))
        messages = messages[1:] if system is not None else messages
    elif flavour == "qwen2.5" and messages[0]["role"] != "system":
        out.append((f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n", False))
    last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if last_query < 0:
        last_query = len(messages) - 1
    for i, m in enumerate(messages):
        if m["role"] == "tool":  # consecutive results share one user turn
            first, last = _tool_run_edges(messages, i)
            out.append((("<|im_start|>user" if first else "") + "\n<tool_response>\n"
                        + m["content"] + "\n</tool_response>" + ("<|im_end|>\n" if last else ""),
                        False))
            continue
        content = m["content"]
        if flavour == "qwen3" and m["role"] == "assistant":
            content = _qwen3_assistant(content, i > last_query, i == len(messages) - 1)
        out.append((f"<|im_start|>{m['role']}\n", False))
        if m["role"] == "assistant":
            calls = [f'<tool_call>\n{{"name": "{c["name"]}", "arguments": '
                     f'{_json(c["arguments"])}}}\n</tool_call>' for c in m.get("tool_calls") or ()]
            # a call follows the answer's text on a new line (Qwen 3: the text after a think block)
            answer = (m["content"].split("</think>")[-1].lstrip("\n") if flavour == "qwen3"
                      else m["content"])
            content += ("\n" if calls and answer else "") + "\n".join(calls)
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


def render(messages, fmt: str, add_generation_prompt: bool = False,
           tools: list | None = None) -> list[tuple[str, bool]]:
    """Segments (text, is_assistant) of a conversation in chat format ``fmt``. ``tools``: the
    JSON schemas of the tools the conversation may call, placed as the format's template places
    them (formats with a tool-calling template: ``TOOL_FORMATS``). An assistant segment of a
    tool-calling turn is its text and calls as the template writes them (the loss learns to
    call); tool results are never assistant segments."""
    if fmt not in FORMATS:
        raise ChatFormatError(f"unknown chat format {fmt!r}; expected one of {FORMATS}")
    messages = _check(messages, fmt, tools)
    if fmt == "gemma":
        out = _gemma(messages, add_generation_prompt, tools)
    elif fmt in ("llama3", "llama3.1"):
        out = _llama3(messages, add_generation_prompt, dated=fmt == "llama3.1", tools=tools)
    elif fmt in ("chatml", "qwen2.5", "qwen3"):
        out = _chatml(messages, add_generation_prompt, fmt, tools)
    elif fmt == "gemma4":
        out = chat_formats.gemma4(messages, add_generation_prompt, tools)
    elif fmt == "phi3":
        out = chat_formats.phi3(messages, add_generation_prompt)
    elif fmt in ("qwen3.5", "qwen3.5-nothink"):
        out = chat_formats.qwen3_5(messages, add_generation_prompt, tools, think=fmt == "qwen3.5")
    elif fmt == "harmony":
        out = chat_harmony.harmony(messages, add_generation_prompt, tools)
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


def turn_end(fmt: str) -> str:
    """What the format's template writes after an assistant message's content: its end-of-turn
    marker and whatever follows the turn (Gemma's ``<end_of_turn>\n``): the end of every
    sequence a reward model is trained on."""
    text = to_text([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], fmt)
    return text[text.rindex("y") + 1:]


def to_text(messages, fmt: str, add_generation_prompt: bool = False,
            tools: list | None = None) -> str:
    return "".join(t for t, _ in render(messages, fmt, add_generation_prompt, tools))
