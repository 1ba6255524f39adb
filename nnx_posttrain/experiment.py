"""What an experiment file needs: its config type (the common ``Config`` with the algorithm's
settings under ``algo``), its defaults, and ``main``."""

from __future__ import annotations

import dataclasses
import functools

from nnx_posttrain import config as config_lib
from nnx_posttrain import train


# Preference methods start from the default SFT run, on the built-in preference pairs.
PREFERENCE_DEFAULTS = dict(
    init_from="runs/sft",
    steps=200,
    optim=dict(learning_rate=1e-4, warmup_steps=10, min_lr_ratio=0.1),
    batching=dict(batch_size=32, max_length=32),
    eval=dict(every=50, exact_match=500),
)

# Online RL methods also start from the SFT run, on the built-in task's prompts, rewarded by the
# program that checks the answer. batch_size counts completions (num_generations per prompt).
ONLINE_DEFAULTS = dict(
    init_from="runs/sft",
    steps=200,
    optim=dict(learning_rate=3e-4, warmup_steps=5, min_lr_ratio=0.1),
    batching=dict(batch_size=128, max_length=32),
    eval=dict(every=50, exact_match=500),
)


@functools.cache
def config_type(algorithm) -> type:
    """``Config`` with ``algo`` typed as the algorithm's settings, so the CLI lists them."""
    return dataclasses.make_dataclass(
        f"{algorithm.name.upper()}RunConfig",
        [("algo", algorithm.Config, dataclasses.field(default_factory=algorithm.Config))],
        bases=(config_lib.Config,),
    )


def config_for(algorithm, **overrides) -> config_lib.Config:
    """An experiment's defaults: nested groups may be given as dicts of field overrides."""
    base = config_type(algorithm)()
    for name, value in overrides.items():
        if isinstance(value, dict):
            value = dataclasses.replace(getattr(base, name), **value)
        base = dataclasses.replace(base, **{name: value})
    return base


def main(name: str, algorithm, default: config_lib.Config, doc: str | None = None, args=None,
         prog: str | None = None):
    """Parse the command line and run. Errors in the user's input (data, model, checkpoint) end
    the program with their message, not a traceback. ``prog``: the command shown by ``--help``
    (default ``python -m experiments.<name>``)."""
    from nnx_posttrain import checkpoint, data, model

    cfg = config_lib.parse(default, args=args, description=doc,
                           prog=prog or f"python -m experiments.{name}")
    try:
        return train.run(cfg, algorithm(cfg.algo, cfg.logprob_chunk), experiment=name)
    except (data.DataError, model.ModelLoadError, checkpoint.CheckpointMismatchError) as exc:
        raise SystemExit(f"error: {exc}") from None
