"""``nnx-posttrain ALGORITHM [options]`` (and ``python -m experiments.ALGORITHM``): parse the
command line into a run config, train (or with ``--eval-only``, evaluate).

The defaults ``--help`` shows are those of the run the command describes: the algorithm's for
a user's data, with the built-in task's recipe over them when the data is ``builtin`` (the
default). The data is read from the ``--data`` flag, else from the ``--config`` file, else it is
the built-in task's: no option is parsed twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading

import tyro

from nnx_posttrain import algorithms, api, config_files, train
from nnx_posttrain.losses.common import unchecked_options


def flag_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` (``--flag VALUE`` or ``--flag=VALUE``; the last one wins, as
    in the parse), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def parse(default, args: list[str], description: str | None = None, prog: str | None = None):
    """Command line -> validated config, starting from ``default``; ``--config FILE`` replaces
    those defaults by the file's values first, so flags override the file. tyro rejects an
    unknown or ill-typed option by name (``SystemExit`` with its usage: this is the command
    line). The algorithm's settings are checked once the file and the flags are applied
    (``Config.validate``, with every other problem)."""
    path, args = config_files.split_arg(list(args))
    with unchecked_options():  # the file's values, then the flags: checked when all are in
        if path is not None:
            default = dataclasses.replace(config_files.apply(default, path), config=path)
        cfg = tyro.cli(type(default), default=default, args=args, description=description,
                       prog=prog)
    return cfg.validate()


def describe(name: str, data: str) -> str:
    cls = algorithms.get(name)
    summary = algorithms.registry.summary(cls)
    if data == api.BUILTIN:
        return (f"{summary}\n\nThe defaults below are the built-in task's recipe (--data builtin, "
                f"nnx_posttrain/tasks/recipes/{name}.yaml); `--data FILE --help` lists those of "
                "a run on your own data.")
    return (f"{summary}\n\nThe defaults below are those of a run on your own data (TRL's); "
            "without --data, the built-in task's recipe applies.")


def config_from(name: str, args: list[str], prog: str):
    """The run config the command line ``args`` describes."""
    path, _ = config_files.split_arg(list(args))
    data = flag_value(args, "--data")
    if data is None and path is not None:
        data = config_files.read(path).get("data")
    data = api.BUILTIN if data is None else data
    return parse(api.defaults(name, data), args, describe(name, data), prog)


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
