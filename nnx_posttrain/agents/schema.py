"""JSON schemas of Python functions, as ``transformers.utils.get_json_schema`` writes them.

A tool is a typed function with a Google-style docstring: its first paragraph is the description,
its ``Args:`` section describes each parameter, its ``Returns:`` section the result. The schema is
what the chat templates put in the prompt (``{"type": "function", "function": {"name",
"description", "parameters", "return"}}``); tests/test_agents.py compares it with transformers'
own for the same functions.
"""

from __future__ import annotations

import inspect
import re
import types
import typing

from nnx_posttrain import errors, user_code


class SchemaError(errors.ConfigError):
    """A function that cannot be described as a tool (a parameter without a type hint or a
    description); the message names the function and the parameter."""


_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null",
           typing.Any: None}
_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$",
                      re.MULTILINE)


def _type_schema(hint, where: str) -> dict:
    """The JSON schema of one type hint."""
    if hint in _SIMPLE:
        return {} if _SIMPLE[hint] is None else {"type": _SIMPLE[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        out = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SIMPLE:
            out = {"type": _SIMPLE[next(iter(kinds))], **out}
        return out
    if origin in (typing.Union, types.UnionType):
        nullable = type(None) in args
        parts = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = dict(parts[0])
        elif all(set(p) == {"type"} for p in parts):
            out = {"type": [p["type"] for p in parts]}
        else:
            out = {"anyOf": parts}
        return {**out, "nullable": True} if nullable else out
    if hint is list or origin is list:
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if hint is tuple or origin is tuple:
        if not args or args[-1] is Ellipsis:
            return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
        return {"type": "array", "prefixItems": [_type_schema(a, where) for a in args]}
    if hint is dict or origin is dict:
        return {"type": "object",
                **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    raise SchemaError(f"{where}: type {hint!r} has no JSON schema (use int, float, str, bool, "
                      "list, tuple, dict, Literal, a union of them or None)")


def _docstring(fn) -> tuple[str, dict[str, str], str | None]:
    """(description, {parameter: description}, returns description) of a Google-style
    docstring."""
    doc = inspect.getdoc(fn) or ""
    parts = _SECTION.split(doc)
    description = parts[0].strip()
    args, returns = {}, None
    for name, body in zip(parts[1::2], parts[2::2]):
        if name in ("Args", "Arguments"):
            current = None
            for line in body.splitlines():
                match = re.match(r"^\s*(\*{0,2}\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
                if match and (len(line) - len(line.lstrip())) <= _indent(body):
                    current = match.group(1).lstrip("*")
                    args[current] = match.group(2).strip()
                elif current and line.strip():
                    args[current] = (args[current] + " " + line.strip()).strip()
        elif name == "Returns":
            returns = " ".join(line.strip() for line in body.splitlines() if line.strip()) or None
    return description, args, returns


def _indent(body: str) -> int:
    lines = [line for line in body.splitlines() if line.strip()]
    return min((len(line) - len(line.lstrip()) for line in lines), default=0)


def function_schema(fn) -> dict:
    """``{"type": "function", "function": {...}}`` of ``fn`` (see the module docstring);
    ``SchemaError`` for a parameter without a type hint or a description, or a function
    without a description."""
    name = getattr(fn, "__name__", type(fn).__name__)
    description, described, returns = _docstring(fn)
    if not description:
        raise SchemaError(f"tool {name!r} has no docstring: its first line is the description "
                          "the model reads")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - a user's annotations (a name they do not define)
        raise SchemaError(f"tool {name!r}: its type hints cannot be read"
                          f"{user_code.failure(exc, fn)}") from None
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        where = f"tool {name!r}, parameter {param.name!r}"
        if param.name not in hints:
            raise SchemaError(f"{where} has no type hint")
        if param.name not in described:
            raise SchemaError(f"{where} is not described in the docstring's Args: section")
        properties[param.name] = {**_type_schema(hints[param.name], where),
                                  "description": described[param.name]}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    function = {"name": name, "description": description,
                "parameters": {"type": "object", "properties": properties,
                               **({"required": required} if required else {})}}
    if "return" in hints:
        function["return"] = {**_type_schema(hints["return"], f"tool {name!r}, its result"),
                              **({"description": returns} if returns else {})}
    return {"type": "function", "function": function}
