"""``nnx-posttrain plan ALGORITHM [the run's options] --topology NAME [--slices N] [--json FILE]``:
compile the run's training step for a TPU topology (or ``cpu-N``) on this host, abstractly, and
print what it needs per device; exit status 1 when it would not fit, naming the changes estimated
to make it fit (``nnx_posttrain.plan``).

    nnx-posttrain plan sft --model DIR --data chats.jsonl --lora.rank 8 --mesh.data 1 \\
        --mesh.fsdp -1 --batching.batch-size 64 --topology v5e-16

Every option but ``--topology``, ``--slices`` and ``--json`` is the run's own (``nnx-posttrain
ALGORITHM --help``); the model may be a directory holding only a preset's config and tokenizer
(``python -m tools.make_preset --like gemma2_9b --out DIR --config-only``). TPU topologies need
the TPU compiler: ``pip install "jax[tpu]"`` (libtpu runs on a CPU host).
"""

from __future__ import annotations

import json
from pathlib import Path

from nnx_posttrain import algorithms, api, errors
from nnx_posttrain.cli import train_command

OWN = ("--topology", "--slices", "--json")


def split_own(args: list[str]) -> tuple[dict, list[str]]:
    """(the plan's own options by name, the run's options)."""
    own, rest, i = {}, [], 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in OWN:
            if "=" in arg:
                own[name] = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                own[name] = args[i + 1]
                i += 1
            else:
                raise errors.ConfigError(f"{name} needs a value")
        else:
            rest.append(arg)
        i += 1
    return own, rest


def _compile_only_host() -> None:
    """Planning compiles on this host's CPU and runs nothing: JAX must not take this host's
    accelerators (a TPU VM's chips may be training)."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # JAX's backends already started (a test calling main)
        pass


def main(args: list[str], prog: str) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    own, rest = split_own(args)
    name, run_args = rest[0], rest[1:]
    if name not in algorithms.names():
        raise errors.ConfigError(f"plan: unknown algorithm {name!r}; one of "
                                 f"{', '.join(algorithms.names())}")
    if "--help" in run_args or "-h" in run_args:  # the run's options (tyro prints, exits)
        train_command.config_from(name, run_args, f"{prog} {name}")
    if "--topology" not in own:
        raise errors.ConfigError("plan: --topology is required (e.g. --topology v5e-16, v4-8, "
                                 "v5p-128, or cpu-8)")
    try:
        slices = int(own.get("--slices", 1))
    except ValueError:
        raise errors.ConfigError(f"--slices must be a whole number, got "
                                 f"{own['--slices']!r}") from None
    out = Path(own["--json"]) if "--json" in own else None
    if out is not None and not out.parent.is_dir():  # before minutes of compiling
        raise errors.ConfigError(f"--json {out}: the directory {out.parent} does not exist")
    _compile_only_host()
    from nnx_posttrain import plan

    topology = plan.resolve(own.get("--topology"), slices)  # before the config: cpu-N splits JAX
    cfg = train_command.config_from(name, run_args, f"{prog} {name}")
    result = plan.plan(cfg, api.build(cfg), topology)
    print(result.table())
    if out is not None:
        try:
            out.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise errors.ConfigError(f"--json {out}: cannot write the plan there "
                                     f"({exc.strerror or exc})") from None
        print(f"wrote {out}")
    refusal = result.refusal()
    if refusal:
        raise errors.ConfigError(refusal)
    return 0
