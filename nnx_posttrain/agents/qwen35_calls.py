"""Qwen 3.5's tool calls (chat formats ``qwen3.5``, ``qwen3.5-nothink``) read back as its
template writes them.

A call is an XML block after the answer's text, one ``<parameter=...>`` block per argument::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

The template writes an object or list argument as JSON and any other with Jinja's ``string``
filter (``37``, ``True``, ``None``, a string as it is), so a value is read by the type its tool's
JSON schema gives the parameter (what Qwen's own parser does): a ``string`` parameter keeps the
text, the other types read it as JSON (or ``True`` / ``False`` / ``None``); a parameter without a
schema is read as JSON where it is JSON, else kept as text. The reasoning (before ``</think>``)
is not read.
"""

from __future__ import annotations

import json
import re

from nnx_posttrain.agents.malformed import Malformed

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(</function>|$)\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(</parameter>|(?=<parameter=)|$)", re.DOTALL)
_WORDS = {"True": True, "False": False, "None": None}  # Jinja's ``string`` of Python's values
_KINDS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}


def parse(text: str, tools: list | None = None) -> list[dict]:
    """The calls ({'name', 'arguments'}) of one turn; ``tools``: the JSON schemas that type the
    arguments; ``Malformed`` for a call that cannot be read."""
    schemas = {t["function"]["name"]: t["function"] for t in tools or ()}
    calls = []
    for body, end in _BLOCK.findall(text.split("</think>")[-1]):
        if not end:
            raise Malformed("a <tool_call> block is not closed")
        match = _FUNCTION.fullmatch(body)
        if not match:
            raise Malformed("a <tool_call> block must hold one <function=NAME> block")
        name, inner, closed = match.groups()
        if not closed:
            raise Malformed(f"<function={name}> is not closed by </function>")
        properties = (schemas.get(name, {}).get("parameters") or {}).get("properties") or {}
        arguments = {}
        for key, value, shut in _PARAMETER.findall(inner):
            if not shut:
                raise Malformed(f"tool call {name!r}: <parameter={key}> is not closed by "
                                "</parameter>")
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(f"tool call {name!r}, parameter {key!r}", value,
                                    properties.get(key))
        calls.append({"name": name, "arguments": arguments})
    return calls


def _literal(text: str) -> tuple:
    """(the value,) of a JSON text or a Python word the template writes; () for other text."""
    if text in _WORDS:
        return (_WORDS[text],)
    try:
        return (json.loads(text),)
    except json.JSONDecodeError:
        return ()


def _typed(where: str, text: str, spec: dict | None):
    """A parameter's value by its schema's type (see the module docstring)."""
    literal = _literal(text)
    kinds = (spec or {}).get("type") or []
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if spec and spec.get("nullable"):
        kinds.append("null")
    if not kinds:  # no schema, or one without a type (enum, anyOf)
        return literal[0] if literal else text
    if literal and any(_KINDS.get(kind, lambda v: False)(literal[0]) for kind in kinds):
        return literal[0]
    if "string" in kinds:
        return text
    raise Malformed(f"{where}: {text!r} is not {' or '.join(kinds)}")
