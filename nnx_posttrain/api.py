"""The Python API: a config built in Python, a run, its result. For notebooks and drivers; the
command line (``nnx_posttrain.cli``) is one of its users.

    import nnx_posttrain as npt

    cfg = npt.configure("sft", steps=300, optim={"learning_rate": 1e-3}, run_dir="runs/sft")
    sft = npt.run(cfg)                           # -> RunResult: run_dir, final_eval, ...
    dpo = npt.run(npt.configure("dpo", init_from=str(sft.run_dir), run_dir="runs/dpo"))
    try:
        npt.run(npt.configure("dpo", data="missing.jsonl"))
    except npt.UserError as exc:                 # a DataError here: the file is named
        print(exc)

A run's settings resolve in one order, each layer over the ones before it (``ORDER``; the
command line's ``--help`` says it, the run's ``config.json`` records it as ``resolved_from``):

1. the algorithm's defaults for a user's data: the fields of ``config.Config`` and of the
   algorithm's settings, with the algorithm's ``defaults`` over them (TRL's conventions);
2. the built-in task's recipe (``nnx_posttrain/tasks/recipes/<algorithm>.yaml``) when the data is
   ``builtin`` (the default); the image task's (``recipes/shapes/<algorithm>.yaml``) when it is
   ``builtin:shapes``;
3. a config file (``config=`` here, ``--config FILE`` on the command line);
4. the settings given: keywords here, then flags (``args``; the command line passes its own).

The command line (``nnx_posttrain.cli.train_command``) is ``configure(name, args=argv)``: one
function detects the data, applies the layers and validates, for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
from collections.abc import Sequence
from pathlib import Path

from nnx_posttrain import config as config_lib
from nnx_posttrain import config_files, errors

BUILTIN = "builtin"
ORDER = config_lib.ORDER


def algorithm_class(algorithm) -> type:
    """An algorithm class from its name (``"dpo"``) or the class itself; ``ConfigError`` for
    anything else."""
    from nnx_posttrain import algorithms

    if isinstance(algorithm, str):
        if algorithm not in algorithms.names():
            raise errors.ConfigError(f"unknown algorithm {algorithm!r}; one of "
                                     f"{', '.join(algorithms.names())}")
        return algorithms.get(algorithm)
    if algorithm not in algorithms.ALGORITHMS.values():
        raise errors.ConfigError(f"the algorithm is a name ({', '.join(algorithms.names())}) or "
                                 f"its class, got {_shown(algorithm)}")
    return algorithm


def _shown(value) -> str:
    """A value named in a message: its type and (shortened) repr."""
    return f"{type(value).__name__} {repr(value)[:60]}"


def config_type(algorithm) -> type:
    """The run config class of ``algorithm`` (a name or the class): ``Config`` with ``algo``
    typed as the algorithm's settings (``SFTRunConfig``, ...; the algorithm's ``RunConfig``)."""
    return algorithm_class(algorithm).RunConfig


def defaults(algorithm, data: str = BUILTIN) -> config_lib.Config:
    """The settings a run of ``algorithm`` on ``data`` gets before any file or setting of the
    user's: the algorithm's defaults, and the built-in task's recipe when ``data`` is a built-in
    dataset that has one ('builtin', 'builtin:shapes')."""
    from nnx_posttrain import tasks

    cls = algorithm_class(algorithm)
    cfg = config_files.merge(config_type(cls)(), cls.defaults, f"{cls.__name__}.defaults")
    recipe = tasks.recipe(cls.name, data)
    return config_files.apply(cfg, recipe) if recipe else cfg


def _nested(settings: dict) -> dict:
    """Dotted keys (``"optim.learning_rate"``) as nested mappings. A setting given twice (a
    dotted key and the same key inside its group's mapping, or ``-`` and ``_`` spellings) is a
    ``ConfigError`` naming both spellings: neither is silently kept."""
    out: dict = {}
    given: dict[tuple, str] = {}  # each setting's path -> how it was given
    for key, value in settings.items():
        for path, leaf in _leaves(tuple(key.split(".")), value):
            spelled = ".".join(path)
            canonical = tuple(p.replace("-", "_") for p in path)
            clash = next((p for p in given if p[:len(canonical)] == canonical
                          or canonical[:len(p)] == p), None)
            if clash is not None:
                raise errors.ConfigError(
                    f"configure(): {'.'.join(canonical)} is given twice, as {given[clash]} and "
                    f"as {_spelling(key, spelled)}; give each setting once")
            given[canonical] = _spelling(key, spelled)
            node = out
            for group in path[:-1]:
                node = node.setdefault(group, {})
            node[path[-1]] = leaf
    return out


def _leaves(path: tuple, value):
    """(path, value) of each setting in ``value`` (a group's mapping, flattened)."""
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from _leaves(path + tuple(str(key).split(".")), inner)
    else:
        yield path, value


def _spelling(key: str, path: str) -> str:
    """How a setting was given: its dotted keyword, or a key inside ``key``'s mapping."""
    return f"'{key}'" if key == path else f"'{path[len(key) + 1:]}' inside {key}={{...}}"


def configure(algorithm, config: str | Path | None = None, *, args: Sequence[str] | None = None,
              prog: str | None = None, **settings) -> config_lib.Config:
    """A validated run config of ``algorithm`` (a name or a class), its layers in ``ORDER``: its
    ``defaults`` for the run's data (the built-in task's recipe over them when the data is
    'builtin'), then the YAML / JSON file ``config``, then ``settings``, nested by group as dicts
    or dotted (``optim={"learning_rate": 1e-3}`` or ``**{"optim.learning_rate": 1e-3}``; the
    algorithm's own under ``algo``), then the command-line flags ``args`` (``["--steps", "5"]``,
    ``--config FILE`` among them; parsed by tyro over the same dataclasses, ``prog`` naming the
    command in its usage). The data (which decides the recipe) is ``--data``, else ``data=``,
    else the file's, else the built-in task's. An unknown name, a value of the wrong type or a
    setting given twice raises ``ConfigError`` naming it (a bad flag too, with tyro's message;
    under a command, ``prog`` given, a bad flag exits with the usage as any command line does;
    ``--help`` prints and exits). Every setting is checked once all are applied
    (``Config.validate``)."""
    if config is not None and not isinstance(config, (str, Path)):
        raise errors.ConfigError(f"configure(config=...): the path of a YAML or JSON file, got "
                                 f"{_shown(config)}")
    cls = algorithm_class(algorithm)  # a wrong type, before any file is read
    settings = _nested(settings)
    config, args = _config_arg(config, args)
    data = _data_of(settings, args, config)
    return layered(defaults(cls, data), config, settings, args, help_text(cls, data), prog)


def layered(base: config_lib.Config, config=None, settings: dict | None = None,
            args: Sequence[str] | None = None, description: str | None = None,
            prog: str | None = None) -> config_lib.Config:
    """``base`` (layers 1-2 of ``ORDER``) with the file ``config``, the nested ``settings`` and
    the flags ``args`` applied in that order, validated once all are in."""
    from nnx_posttrain.losses.common import unchecked_options

    with unchecked_options():  # each layer's values: checked when all are in
        cfg = base
        if config is not None:
            cfg = dataclasses.replace(config_files.apply(cfg, config), config=str(config))
        if settings:
            cfg = config_files.merge(cfg, settings, "configure()")
        if args is not None:
            cfg = _flags(cfg, list(args), description, prog)
    return cfg.validate()


def _flags(cfg, args: list[str], description: str | None, prog: str | None):
    """``cfg`` with the flags ``args`` (tyro over its dataclasses). A command (``prog``) exits
    as any command line does on a bad flag, with tyro's usage (``cli.main`` turns tyro's exit
    into its status); the Python API (no ``prog``) raises ``ConfigError`` with tyro's message
    instead, and after ``--help`` has printed the options (no config to return)."""
    import tyro

    if prog is not None:
        return tyro.cli(type(cfg), default=cfg, args=args, description=description, prog=prog)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return tyro.cli(type(cfg), default=cfg, args=args, description=description)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help: printed on stdout
            raise errors.ConfigError(f"configure(args={args}): --help printed the options above; "
                                     "nothing was configured") from None
        lines = [line.strip(" │─") for line in said.getvalue().splitlines()
                 if not line.lstrip().startswith(("╭", "╰"))]  # the box's title and bottom
        message = "; ".join(line for line in lines if line and "--help" not in line)
        raise errors.ConfigError(f"configure(args={args}): {message}") from None


def _config_arg(config, args):
    """(the config file: ``config`` or ``--config FILE`` in ``args``, the other flags)."""
    if args is None:
        return config, None
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise errors.ConfigError(f"configure(args=...): the command line's flags as a list of "
                                 f"strings (['--steps', '5']), got {_shown(args)}")
    path, rest = config_files.split_arg(list(args))
    if path is not None and config is not None:
        raise errors.ConfigError(f"a config file is given twice ({config} and --config {path}); "
                                 "one file holds a run's settings")
    return (config if path is None else path), rest


def _data_of(settings: dict, args, config) -> str:
    """The run's data, which decides its defaults: ``--data``, ``data=``, the file's, builtin."""
    data = flag_value(args or [], "--data")
    if data is None:
        data = settings.get("data")
    if data is None and config is not None:
        data = config_files.read(config).get("data")
    return BUILTIN if data is None else data


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` (``--flag VALUE`` or ``--flag=VALUE``; the last one wins, as
    in the parse), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def help_text(algorithm, data: str = BUILTIN) -> str:
    """What ``--help`` says above the options: the algorithm in a line, the order its defaults
    resolve in, and which layers the shown defaults include."""
    cls = algorithm_class(algorithm)
    from nnx_posttrain.algorithms import registry

    order = "\n".join(f"  {i}. {layer}" for i, layer in enumerate(ORDER, 1))
    from nnx_posttrain import tasks

    recipe = tasks.recipe(cls.name, data)
    if recipe is not None:
        shown = (f"The defaults below include the built-in task's recipe (--data {data}, "
                 f"{recipe.relative_to(Path(tasks.__file__).parents[2])}); `--data FILE --help` "
                 "lists those of a run on your own data.")
    else:
        shown = ("The defaults below are those of a run on your own data (TRL's); without "
                 "--data, the built-in task's recipe applies.")
    return (f"{registry.summary(cls)}\n\nSettings resolve in this order, each over the ones "
            f"before it (recorded in the run's config.json as resolved_from):\n{order}\n\n{shown}")


def build(cfg: config_lib.Config):
    """The algorithm of a run config (an instance, its settings checked): the one whose
    settings type ``cfg.algo`` has."""
    from nnx_posttrain import algorithms

    if not isinstance(cfg, config_lib.Config):
        raise errors.ConfigError(
            f"a run takes the config that nnx_posttrain.configure builds, got {_shown(cfg)}: "
            "e.g. run(configure('sft', steps=4))")
    by_settings = {cls.Config: cls for cls in algorithms.ALGORITHMS.values()}
    cls = by_settings.get(type(cfg.algo))
    if cls is None:
        raise errors.ConfigError(f"the config's algo ({type(cfg.algo).__name__}) is no "
                                 "algorithm's settings: build it with nnx_posttrain.configure")
    return cls(cfg.algo, cfg.logprob_chunk)


def run(cfg: config_lib.Config, echo=print):
    """Train per ``cfg`` (built by ``configure``); returns ``train.RunResult``. Resumes from the
    run directory's latest checkpoint when it has one. A problem the user can fix raises a
    ``UserError``; Ctrl-C raises ``KeyboardInterrupt`` after saying what is kept."""
    from nnx_posttrain import train

    algorithm = build(cfg)
    try:
        with train.prepare(cfg, algorithm, echo) as prepared:
            return train.train(prepared)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): stopped without writing a checkpoint; the run resumes from "
              "its latest complete one, if it has one", file=sys.stderr)
        raise


def evaluate(cfg: config_lib.Config, echo=print) -> dict:
    """The eval metrics of ``cfg``'s run directory's latest checkpoint (or of the model's own
    weights), also appended to its ``metrics.jsonl`` with what they scored."""
    from nnx_posttrain import train

    algorithm = build(cfg)  # a config that is not one: refused first
    cfg = dataclasses.replace(cfg, eval_only=True)
    with train.prepare(cfg, algorithm, echo) as prepared:
        return train.evaluate_only(prepared)


def load_run(run_dir: str | Path, step: int | None = None, echo=print):
    """A run's checkpoint as a live model (``runs.LoadedRun``: ``module``, ``lm``, ``config``)."""
    from nnx_posttrain import runs

    if not isinstance(run_dir, (str, Path)):
        raise errors.ConfigError(f"load_run(): a run directory's path, got {_shown(run_dir)}")
    return runs.load(run_dir, step, echo=echo)


def __getattr__(name):  # RunResult lives with the loop; imported when first asked for
    if name == "RunResult":
        from nnx_posttrain.train import RunResult

        return RunResult
    raise AttributeError(f"module 'nnx_posttrain.api' has no attribute {name!r}")
