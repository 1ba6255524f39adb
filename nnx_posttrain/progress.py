"""Progress bars (tqdm) that stay readable where they are written to a file.

On a terminal, tqdm redraws its bar in place, at most every 0.1 s. Where stderr is a file (a log
written with ``2> log``, CI, a batch job's output), every redraw is a carriage return appended to
the same line: the README's default run left 657 redraws, 56 kB, there. So where stderr is
not a terminal the console bar is redrawn at most every ``LOGGED_INTERVAL`` seconds, and each
redraw is a line of its own (``Lines``): tqdm's carriage returns and the blanks it clears the bar
with before a message are dropped, so an evaluation's line never shares a line with the bar in
the file (``grep``, ``less`` and ``tail`` show one record per line). Notebook bars (``tqdm.auto``
in Jupyter: a widget updated in place) keep tqdm's own interval.
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


class Lines:
    """A stream for a bar written to a file: every redraw a whole line. tqdm writes a redraw as
    ``"\r" + bar + blanks``, and clears the bar before another message with ``"\r"``, blanks,
    ``"\r"``; here the text between carriage returns, stripped, is written as one line, and
    blank pieces (the clearing) are dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        lines = [piece.strip() for piece in text.replace("\n", "\r").split("\r")]
        out = "".join(line + "\n" for line in lines if line)
        if out:
            self.stream.write(out)
        return len(text)

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # flush, encoding, ...: the stream's own
        return getattr(self.stream, name)


def bar(iterable=None, **kwargs):
    """``tqdm.auto.tqdm(iterable, **kwargs)`` redrawn at the ``interval`` of its stream, a line
    per redraw where that stream is not a terminal (``Lines``)."""
    from tqdm.notebook import tqdm_notebook

    stream = kwargs.get("file") or sys.stderr
    kwargs.setdefault("mininterval", interval(stream))
    if not issubclass(tqdm, tqdm_notebook) and not _is_terminal(stream):
        kwargs.update(file=Lines(stream), dynamic_ncols=False)  # no terminal to fit
    return tqdm(iterable, **kwargs)


def console(echo):
    """``echo`` for lines printed while a progress bar may be drawn (``tqdm.write``, which keeps
    the bar whole); None stays silent."""
    return lambda line: tqdm.write(line) if echo else None
