"""The project's developer tools (tools/README.md). Their helpers and each tool's ``main(argv)``
raise ``ToolError``; only a tool run as a command (its ``__main__`` block, through ``exit_status``)
turns it into the command line's ``error: ...`` line and exit status."""

from __future__ import annotations

import sys


class ToolError(RuntimeError):
    """A tool's failure the user can act on: a run that failed, a missing file, a bad option."""


def exit_status(main, argv=None) -> int:
    """The exit status of ``main(argv)`` run as a command: ``error: MESSAGE`` on stderr and 1 for a
    ``ToolError``, the status ``main`` returns when it returns one, else 0."""
    try:
        result = main(argv)
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return result if type(result) is int else 0
