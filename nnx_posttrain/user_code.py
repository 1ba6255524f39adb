"""User code named as ``module:name`` on the command line: reward functions (``--algo.rewards``),
tools and environments (``--algo.tools``, ``--algo.environment``), pairwise judges
(``--judge``). One loader, one set of messages: a file path instead of a module, a module that
cannot be found, one that fails while importing (with the file and line), a missing name.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from pathlib import Path

from nnx_posttrain import errors


def load(spec: str, option: str, error: type[errors.UserError] = errors.ConfigError):
    """The object ``name`` of module ``module`` in ``spec`` ('module:name'; the current
    directory importable, as under ``python -m``), or ``error`` naming ``option``, ``spec`` and
    the cause."""
    module_name, _, attr = spec.strip().partition(":")
    where = f"{option} {spec}"
    if not module_name or not attr:
        raise error(f"{where}: expected 'module:name' (an importable module and a name in it)")
    if "/" in module_name or "\\" in module_name or module_name.endswith(".py"):
        raise error(f"{where}: a 'module:name' names an importable module, not a file: e.g. "
                    f"{Path(module_name).stem}:{attr}, run from the file's folder or with it on "
                    "PYTHONPATH")
    if "" not in sys.path and os.getcwd() not in sys.path:  # a console script's sys.path
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise error(f"{where}: cannot import {module_name!r} ({exc})") from None
        raise error(_failed(where, module_name, exc)) from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise error(_failed(where, module_name, exc)) from None
    if not hasattr(module, attr):
        raise error(f"{where}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


# where code that is not the user's lives: this package and Python's own library
_NOT_USERS = tuple(str(Path(p).resolve()) + os.sep for p in {
    Path(__file__).resolve().parent, *(sysconfig.get_paths()[k] for k in
                                       ("stdlib", "platstdlib", "purelib", "platlib"))})


def failure(exc: BaseException, fn=None) -> str:
    """`` at FILE:LINE: Type: message`` of an exception raised in user code: the innermost
    line of the user's own code (not this package's, not Python's library: the user's line that
    called ``json.loads``, not json's); where none ran, as when ``fn`` (the user's function)
    was called with arguments it does not take, ``fn``'s definition; no place for a syntax
    error, whose message holds it."""
    frames = traceback.extract_tb(exc.__traceback__)
    users = [f for f in frames if not (f.filename == "<string>"  # eval'd: typing's, say
                                       or f.filename.startswith("<frozen")
                                       or str(Path(f.filename).resolve()).startswith(_NOT_USERS))]
    at = ""
    if isinstance(exc, SyntaxError):
        pass
    elif users:
        at = f" at {users[-1].filename}:{users[-1].lineno}"
    elif fn is not None and defined_at(fn):
        at = f" (calling {getattr(fn, '__qualname__', fn)!s} at {defined_at(fn)})"
    elif frames:
        at = f" at {frames[-1].filename}:{frames[-1].lineno}"
    return f"{at}: {type(exc).__name__}: {text(exc)}"


def defined_at(fn) -> str | None:
    """``FILE:LINE`` where function or method ``fn`` is defined (None where Python cannot
    tell: a builtin, a C extension)."""
    code = getattr(inspect.unwrap(getattr(fn, "__func__", fn)), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None


def text(value) -> str:
    """``str(value)``; for a value of user code whose ``__str__`` raises, a note saying so."""
    try:
        return str(value)
    except Exception as exc:  # noqa: BLE001 - a user's __str__
        return f"<a {type(value).__name__} whose str() raised {type(exc).__name__}>"


def _failed(where: str, module_name: str, exc: BaseException) -> str:
    return f"{where}: importing {module_name} failed{failure(exc)}"
