"""The command line: the console script ``nnx-posttrain`` (also ``python -m nnx_posttrain.cli``)
and ``python -m experiments[.ALGORITHM]``.

    nnx-posttrain ALGORITHM [options]      train (sft, dpo, simpo, ... ; ALGORITHM --help)
    nnx-posttrain export RUN --to DIR      a checkpoint as a KerasHub preset / HF / PEFT adapters
    nnx-posttrain sample RUN --prompt ...  answer prompts with a checkpoint
    nnx-posttrain compare RUN [RUN ...]    final / best metrics, setting differences, plots
    nnx-posttrain sweep ALGORITHM --grid   a grid of runs, one process per point
    nnx-posttrain inspect RUN              what a checkpoint holds
    nnx-posttrain plan ALGORITHM --topology v5e-16 [options]   a run's step compiled for a TPU
                                           topology on this host: memory per device, FLOPs
    nnx-posttrain eval RUN --tasks T1,T2   lm-evaluation-harness tasks on a checkpoint
    nnx-posttrain judge RUN_A RUN_B --prompts FILE   win rate of A's answers against B's

This package is the library's one user that owns the process. ``main`` alone turns a
``UserError`` into ``error: MESSAGE`` on stderr and exit status 1 (nothing printed after it), a
stop signal into 128 + its number, Ctrl-C into 130, the option parser's exit (``--help``, a bad
option) into its status; it returns that status and raises no ``SystemExit``. Everything it calls
raises exceptions instead. The process ends with the status where the command starts: the
console script's wrapper (``sys.exit(console())``), ``experiments/NAME.py``
(``raise SystemExit(experiment(NAME))``) and ``__main__``; and in ``main`` itself where it is
given the process (``own_process``), at once (``_exit_now``).
"""

from __future__ import annotations

import importlib
import os
import sys

USAGE = """usage: {prog} COMMAND [options]   ({prog} COMMAND --help lists its options)

Training (one command per algorithm; --config FILE.yaml sets options from a file):
{algorithms}

Runs:
{tools}"""

# command -> (module of nnx_posttrain.cli with main(argv, prog) -> exit status, one line)
TOOLS = {
    "export": ("export_command", "a checkpoint as a KerasHub preset, Hugging Face model or PEFT "
                                 "adapters"),
    "sample": ("sample", "answer prompts with a run's checkpoint"),
    "compare": ("compare_command", "final and best metrics, setting differences, plots"),
    "sweep": ("sweep", "a grid of runs, one process per point, resumable"),
    "inspect": ("inspect_command", "what a run's checkpoint holds"),
    "plan": ("plan_command", "a run's step compiled for a TPU topology here: memory per device"),
    "eval": ("eval_command", "a run's checkpoint through lm-evaluation-harness tasks"),
    "judge": ("judge_command", "win rate of one run's answers against another's, under a judge"),
}


class _Imports:
    """Notes a Ctrl-C Python only printed while the command imported (it lands in a garbage
    collector callback of JAX's, and is swallowed there): the command then stops at once."""

    def __init__(self):
        self.interrupted = False

    def __enter__(self):
        self._previous = sys.unraisablehook
        sys.unraisablehook = self._note
        return self

    def _note(self, unraisable) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.interrupted = True
        self._previous(unraisable)

    def __exit__(self, *exc) -> None:
        sys.unraisablehook = self._previous


def usage(prog: str) -> str:
    from nnx_posttrain import algorithms

    width = max(map(len, algorithms.names()))
    width = max(width, *map(len, TOOLS))
    lines = [f"  {name:<{width}}  {algorithms.registry.summary(algorithms.get(name))}"
             for name in algorithms.names()]
    tools = [f"  {name:<{width}}  {line}" for name, (_, line) in TOOLS.items()]
    return USAGE.format(prog=prog, algorithms="\n".join(lines), tools="\n".join(tools))


def main(argv=None, prog: str = "nnx-posttrain", own_process: bool = False,
         command_prog: str | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); returns its exit
    status, and never raises ``SystemExit``: a ``UserError`` prints ``error: MESSAGE`` on stderr
    and returns 1; a stop signal returns 128 + its number, Ctrl-C prints that the run stopped
    and returns 130; the option parser's exit returns its status (``--help`` 0, a bad option 2,
    its usage printed). Where the process is the command's own (``own_process``: the console
    script, ``python -m experiments``), a ``UserError``, a stop signal or Ctrl-C ends the process
    at once instead of returning (``_exit_now`` says why)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before JAX loads: no C++ log lines
    argv = sys.argv[1:] if argv is None else list(argv)
    with _Imports() as imports:
        from nnx_posttrain import algorithms, cpu_host, errors
        from nnx_posttrain.cli import train_command
    cpu_host.prefer_cpu()  # no TPU runtime start-up (and its page of errors) on a CPU host
    if imports.interrupted:
        return _exit_now(130, "interrupted (Ctrl-C) while starting", own_process)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog))
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    try:
        shown = command_prog or f"{prog} {command}"
        if command in algorithms.names():
            return _finish(train_command.main(command, args, shown), own_process)
        if command in TOOLS:
            module = importlib.import_module(f"nnx_posttrain.cli.{TOOLS[command][0]}")
            return _finish(module.main(args, shown), own_process)
        raise errors.ConfigError(f"unknown command {command!r}\n{usage(prog)}")
    except errors.UserError as exc:  # nothing after the message: see _exit_now
        return _exit_now(1, f"error: {exc}", own_process)
    except errors.Stopped as stop:
        return _exit_now(stop.exit_code, None, own_process)
    except KeyboardInterrupt:
        return _exit_now(130, "interrupted (Ctrl-C): stopped without writing a checkpoint; the "
                              "run resumes from its latest complete one, if it has one",
                         own_process)
    except SystemExit as exc:  # the option parser's (tyro, argparse): --help, a bad option
        return _status(exc.code)


def _status(code) -> int:
    """The exit status a ``SystemExit(code)`` ends a process with, as the interpreter gives it:
    ``None`` 0, an int as is, anything else (a message) printed on stderr, and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int, own_process: bool) -> int:
    """A command's exit status; a stop's (128 + signal) ends the command's own process at once,
    as ``_exit_now`` says why, and is returned elsewhere."""
    if code >= 128:
        return _exit_now(code, None, own_process)
    return code


def _exit_now(code: int, message: str | None, own_process: bool) -> int:
    """``message`` (if any) on stderr, then the exit status ``code``. In the command's own
    process (``own_process``) it does not return: it ends the process at once, streams flushed,
    with ``os._exit(code)``: the run's own files are closed by now, and a checkpoint save that a
    stop or a failure (a full disk) cut short leaves threads, futures and coroutines that would
    print a page of tracebacks at interpreter shutdown, after the message (closed event loops, a
    shut-down executor, asyncio's "Task exception was never retrieved"). Elsewhere (a test or a
    program calling ``main``) it returns ``code``, for ``main`` to return."""
    if message:
        print(message, file=sys.stderr)
    if not own_process:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def console() -> int:
    """The ``nnx-posttrain`` console script: its exit status (the script pip writes exits with
    it)."""
    return main(prog=os.path.basename(sys.argv[0]) or "nnx-posttrain", own_process=True)


def experiment(name: str) -> int:
    """``python -m experiments.NAME [options]``: the training command of algorithm ``NAME``; its
    exit status, which the experiment's file exits with."""
    return main([name, *sys.argv[1:]], own_process=True,
                command_prog=f"python -m experiments.{name}")
