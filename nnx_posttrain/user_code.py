"""User code named as ``module:name`` on the command line: reward functions (``--algo.rewards``),
tools and environments (``--algo.tools``, ``--algo.environment``), pairwise judges
(``--judge``). One loader, one set of messages: a file path instead of a module, a module that
cannot be found, one that fails while importing (with the file and line), a missing name.
"""

from __future__ import annotations

import importlib
import os
import sys
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


def failure(exc: BaseException) -> str:
    """`` at FILE:LINE: Type: message`` of an exception raised in user code (where it was
    raised; no place for a syntax error, whose message holds it)."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = (f" at {frames[-1].filename}:{frames[-1].lineno}"
          if frames and not isinstance(exc, SyntaxError) else "")
    return f"{at}: {type(exc).__name__}: {exc}"


def _failed(where: str, module_name: str, exc: BaseException) -> str:
    return f"{where}: importing {module_name} failed{failure(exc)}"
