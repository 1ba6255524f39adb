"""The errors a user can cause, and the stop a signal asks for.

Every problem a user can fix raises a ``UserError`` whose message names the cause and says what
to change (the option, the file and line, the run directory). The library raises them and never
ends the process; the command line (``nnx_posttrain.cli``) alone turns one into ``error: MESSAGE``
on stderr and exit status 1. A notebook or a sweep driver catches them like any exception::

    try:
        nnx_posttrain.run(cfg)
    except nnx_posttrain.UserError as exc:
        print("skipped:", exc)

The subclasses say which part of a run the problem is in; several also derive from the built-in
type code outside this project expects (``ValueError``, ``FileNotFoundError``).
"""

from __future__ import annotations

import signal


class UserError(Exception):
    """A problem the user can fix; the message says what to change."""


class ConfigError(UserError, ValueError):
    """A setting or a combination of settings that cannot run (options, config files, the
    algorithm's settings, a mesh that does not fit the devices, a step that cannot fit memory)."""


class DataError(UserError, ValueError):
    """Bad input data; the message names the file, the line (or row) and the field."""


class ModelError(UserError):
    """A model that cannot be loaded or built as asked (a preset not found, a gated model
    without credentials, LoRA targets that name no layer)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot serve the run: another model, other settings on resume, none
    where one is needed, an ``--init-from`` run that cannot start this one."""


class RunDirError(UserError):
    """A run directory that cannot be used: not a directory, not writable, held by another
    process (or another run of this one), not a run's."""


class StorageError(RunDirError):
    """The storage under a run directory failed while the run wrote to it (no space, a quota, a
    read-only or removed file system); the message says what is safe and how to go on."""


class RewardError(UserError):
    """A reward function that cannot be found, imported or fed, or that returned something
    other than one number (or None) per completion."""


class TrainingError(UserError):
    """Training stopped on a problem of the settings (a non-finite loss or gradient norm); the
    kept checkpoints are the last good ones."""


class Stopped(BaseException):
    """A stop signal (SIGTERM, the preemption notice of a TPU VM) ended the run before its first
    step, where there is nothing new to checkpoint. A ``BaseException`` as ``KeyboardInterrupt``
    is: a request to stop is not swallowed by ``except Exception``. ``exit_code`` is the shell's
    128 + signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")
