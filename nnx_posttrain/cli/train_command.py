"""``nnx-posttrain ALGORITHM [options]`` (and ``python -m experiments.ALGORITHM``): parse the
command line into a run config, train (or with ``--eval-only``, evaluate).

The command line is a thin layer over the Python API: ``api.configure(name, args=argv)`` detects
the data, applies the layers of defaults in their one order (``api.ORDER``: the algorithm's, the
built-in task's recipe when ``--data builtin``, the ``--config`` file, the flags), parses the flags
with tyro over the same dataclasses and validates. The defaults ``--help`` shows are those of the
run the command describes.
"""

from __future__ import annotations

import json
import os
import signal
import threading

from nnx_posttrain import api, config_files, train
from nnx_posttrain.api import flag_value  # noqa: F401  (the command line's helpers, re-exported)


def parse(default, args: list[str], description: str | None = None,
          prog: str = "nnx-posttrain"):
    """Command line -> validated config, starting from ``default`` (a run config whose layers 1-2
    are resolved); ``--config FILE`` applies before the flags (``api.layered``). tyro rejects an
    unknown or ill-typed option by name (``SystemExit`` with its usage, ``prog`` naming the
    command)."""
    path, args = config_files.split_arg(list(args))
    return api.layered(default, path, None, args, description, prog)


def describe(name: str, data: str) -> str:
    """``--help``'s text above the options (``api.help_text``)."""
    return api.help_text(name, data)


def config_from(name: str, args: list[str], prog: str):
    """The run config the command line ``args`` describes: ``api.configure(name, args=args)``."""
    return api.configure(name, args=args, prog=prog)


def main(name: str, args: list[str], prog: str) -> int:
    """Train (or evaluate, ``--eval-only``) the run ``args`` describe; the exit status."""
    cfg = config_from(name, args, prog)
    with train.prepare(cfg, api.build(cfg)) as run:
        if cfg.eval_only:
            print(json.dumps(train.evaluate_only(run), indent=2))
            return 0
        result = train.train(run)
        if result.stopped_by is None:
            return 0
        code = 128 + signal.Signals[result.stopped_by]
        exit_within(code)  # closing may stall (a library thread that never ends)
    return code


EXIT_GRACE_S = 60.0
"""How long the clean exit after a stop signal may take before the process ends regardless."""


def exit_within(code: int, grace_s: float | None = None) -> None:
    """Arm a timer: ``grace_s`` (default ``EXIT_GRACE_S``) seconds from now the process ends
    with ``code``, whatever it is doing. Armed before a clean exit that could stall (a library
    thread that never ends, a C call it waits behind)."""
    timer = threading.Timer(EXIT_GRACE_S if grace_s is None else grace_s, os._exit, (code,))
    timer.daemon = True
    timer.start()
