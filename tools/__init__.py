"""The project's developer tools (tools/README.md). Their helpers raise ``ToolError``; a tool's
``main``, wrapped in ``command``, turns it into the command line's ``error: ...`` exit."""

from __future__ import annotations

import functools


class ToolError(RuntimeError):
    """A tool's failure the user can act on: a run that failed, a missing file, a bad option."""


def command(main):
    """``main`` with a ``ToolError`` ending the command as ``SystemExit("error: ...")``."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ToolError as exc:
            raise SystemExit(f"error: {exc}") from None

    return wrapper
