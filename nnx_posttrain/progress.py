"""Progress bars (tqdm) that stay readable where they are written to a file.

On a terminal, tqdm redraws its bar in place, at most every 0.1 s. Where stderr is a file (a log
written with ``2> log``, CI, a batch job's output), every redraw is a carriage return appended to
the same line: the README's default run left 657 redraws, 56 kB, there. So where stderr is
not a terminal the console bar is redrawn at most every ``LOGGED_INTERVAL`` seconds. Notebook bars
(``tqdm.auto`` in Jupyter: a widget updated in place) keep tqdm's own interval.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

LOGGED_INTERVAL = 30.0  # seconds between redraws of a bar written to a file
TERMINAL_INTERVAL = 0.1  # tqdm's default


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def interval(stream=None, bar_class=tqdm) -> float:
    """Seconds between redraws of a ``bar_class`` bar written to ``stream`` (default stderr)."""
    from tqdm.notebook import tqdm_notebook

    if issubclass(bar_class, tqdm_notebook):
        return TERMINAL_INTERVAL
    terminal = _is_terminal(sys.stderr if stream is None else stream)
    return TERMINAL_INTERVAL if terminal else LOGGED_INTERVAL


def bar(iterable=None, **kwargs):
    """``tqdm.auto.tqdm(iterable, **kwargs)`` redrawn at the ``interval`` of its stream."""
    kwargs.setdefault("mininterval", interval(kwargs.get("file")))
    return tqdm(iterable, **kwargs)
