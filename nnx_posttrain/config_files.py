"""Config files: ``--config FILE.yaml|json`` gives every option a value from a file; flags still
override it (the file's values become tyro's defaults, as tyro recommends for config files).

A file is a mapping with the same names as the options, nested by group (``-`` or ``_``)::

    model: gemma_2b
    steps: 1000
    optim:
      learning_rate: 2.0e-5
    lora: {rank: 8}

A run's own ``config.json`` is a valid config file (``python -m experiments.simpo --config
runs/x/config.json --seed 2`` repeats a run): its bookkeeping keys (``algo_name``, ``resolved_from``, see
``IGNORED``) are checked or skipped. An unknown key, a key given twice or a value of the wrong type
is an error that names the file, the line (YAML; JSON for a key given twice), the key and the
expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from nnx_posttrain import errors

# Keys a run's config.json carries besides the options: not options, never applied.
# ``algo_name`` is checked against the experiment's algorithm; ``config`` (the file a run was
# configured from) is not followed; ``resolved_from`` (the layers the run's values came from) is
# a record.
IGNORED = ("algo_name", "config", "resolved_from")


class ConfigFileError(errors.ConfigError):
    """A config file that cannot be applied; its message names the file and the key."""

    def __init__(self, path, message: str):
        super().__init__(f"{path}: {message}")


def split_arg(args: list[str]) -> tuple[str | None, list[str]]:
    """(the value of ``--config FILE`` / ``--config=FILE``, the other arguments)."""
    path, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise errors.ConfigError(
                    f"--config is given twice ({path} and the next); one "
                    "file holds a run's settings (flags override it)")
        if arg == "--config":
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise errors.ConfigError("--config needs a file: --config FILE.yaml (or .json)")
            path, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


class Lined(dict):
    """A mapping read from a file, with the line each key is on (``lines``; 1-based)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lines: dict = {}


class _Twice(Exception):
    """A key given twice in one mapping: (key, line of its first, line of its second; None in JSON)."""


def _json_mapping(pairs):
    out = Lined()
    for key, value in pairs:
        if key in out:
            raise _Twice(key, None, None)
        out[key] = value
    return out


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML's safe loader, with a key given twice refused (PyYAML keeps the last) and each
        mapping's key lines kept for the messages."""

    def mapping(loader, node):
        loader.flatten_mapping(node)
        out = Lined()
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in out.lines:
                raise _Twice(key, out.lines[key], line)
            out[key] = loader.construct_object(value_node, deep=True)
            out.lines[key] = line
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def read(path: str | Path) -> dict:
    """The mapping in a YAML or JSON file (``.json`` is read as JSON, anything else as YAML), as
    ``Lined`` mappings; a key given twice in one mapping is an error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(path, "no such config file")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            values = json.loads(text, object_pairs_hook=_json_mapping)
        else:
            import yaml

            values = yaml.load(text, Loader=_yaml_loader())
    except _Twice as exc:
        key, first, second = exc.args
        where = f"line {second}: " if second else ""
        also = f" (also on line {first}; one value per key)" if first else " (one value per key)"
        raise ConfigFileError(path, f"{where}key '{key}' is given twice{also}") from None
    except json.JSONDecodeError as exc:
        raise ConfigFileError(path, f"line {exc.lineno}: malformed JSON ({exc.msg})") from None
    except Exception as exc:  # yaml.YAMLError: the message carries line and column
        raise ConfigFileError(path, f"malformed YAML ({exc})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigFileError(path, f"expected a mapping of option names to values, got "
                                    f"{type(values).__name__}")
    return values


def apply(default, path: str | Path):
    """``default`` (a config dataclass) with the values of the file at ``path``."""
    values = read(path)
    algo_name = values.get("algo_name")
    expected = type(getattr(default, "algo", None)).__name__
    if algo_name is not None and hasattr(default, "algo") and algo_name != expected:
        raise ConfigFileError(path, f"written for another algorithm (algo_name {algo_name}); this "
                                    f"experiment's is {expected}: use that algorithm's experiment")
    for key in IGNORED:
        values.pop(key, None)
    return merge(default, values, path)


def merge(obj, values: dict, path, prefix: str = ""):
    """``obj`` (a config dataclass) with ``values`` (a mapping of its field names, nested by
    group) applied, each checked against the field's type; ``path`` names where they come from
    in the errors."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj) if f.init}
    changes = {}
    lines = getattr(values, "lines", {})
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        where = prefix + key
        line = f"line {lines[raw_key]}: " if raw_key in lines else ""
        if key in changes:
            raise ConfigFileError(path, f"{line}key '{where}' is given twice ('-' and '_' "
                                        f"spellings of one option)")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            group = f"under '{prefix[:-1]}' " if prefix else ""
            raise ConfigFileError(path, f"{line}unknown key '{where}'{hint} (keys {group}are: "
                                        f"{', '.join(fields)})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigFileError(path, f"{line}key '{where}': expected a mapping of "
                                            f"{type(current).__name__} fields, got "
                                            f"{_shown(value)}")
            changes[key] = merge(current, value, path, where + ".")
        else:
            changes[key] = _convert(value, hints.get(key, Any), path, line + f"key '{where}'")
    return dataclasses.replace(obj, **changes)


def _convert(value, tp, path, where: str):
    """``value`` as type ``tp``, or an error naming the line, the key and the expected type."""
    ok, out = _check(value, tp)
    if not ok:
        raise ConfigFileError(path, f"{where}: expected {_type_name(tp)}, got {_shown(value)}")
    return out


def _check(value, tp) -> tuple[bool, Any]:
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _check(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is Literal:
        return value in typing.get_args(tp), value
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if tp is str:
        return isinstance(value, str), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _shown(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"
