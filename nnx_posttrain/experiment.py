"""What an experiment file needs: its config type (the common ``Config`` with the algorithm's
settings under ``algo``), its defaults, and ``main``.

An experiment file has two sets of defaults:

- ``DEFAULT``: for a user's data and model (TRL-like: long sequences with a loud truncation
  report, no evaluation without ``--eval-data``, warm-up as a fraction of the steps, batch sizes
  of a real run with gradient accumulation, the trainer's own learning rate, no ``--init-from``);
- ``BUILTIN``: the built-in task's tuned recipe, overrides applied on top of ``DEFAULT`` only
  when the run's data is ``builtin`` (what runs with no arguments).

``main(..., builtin=BUILTIN)`` decides which applies from the parsed command line, so ``--help``
lists the built-in recipe and ``--data my.jsonl --help`` the defaults a run on that file gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import sys

from nnx_posttrain import config as config_lib
from nnx_posttrain import train

# Shared parts of the user-data defaults (TRL's conventions; the learning rate is per trainer).
# Exact match is evaluated only where the eval data has an 'answer' column (see main).
# Micro-batches of 4 examples (a preference pair is two sequences), 16 per optimizer step.
PREFERENCE_DATA = dict(
    steps=1000,
    remat="blocks",  # TRL's gradient_checkpointing=True
    optim=dict(warmup_ratio=0.1, min_lr_ratio=0.0),
    batching=dict(batch_size=16, grad_accum=4, max_length=1024),
    eval=dict(every=200, exact_match=200, max_new_tokens=64),
    checkpoint=dict(every=200),
)
# Online methods: batch_size counts completions; prompts up to 512 tokens (--batching.max-length
# bounds a prompt-only record), completions up to TRL's 512 tokens.
ONLINE_DATA = dict(
    steps=1000,
    remat="blocks",
    optim=dict(warmup_ratio=0.1, min_lr_ratio=0.0),
    batching=dict(batch_size=32, grad_accum=4, max_length=512),
    eval=dict(every=200, exact_match=200, max_new_tokens=256),
    checkpoint=dict(every=200),
)

# The built-in task's recipes of the methods that start from the default SFT run (each experiment
# file's BUILTIN: one of these, with its own changes merged in by ``recipe``).
BUILTIN_PREFERENCE = dict(
    init_from="runs/sft",
    steps=200,
    remat="none",
    optim=dict(learning_rate=1e-4, warmup_steps=10, min_lr_ratio=0.1),
    batching=dict(batch_size=32, grad_accum=1, max_length=32),
    eval=dict(every=50, exact_match=500, max_new_tokens=8),
)
# Online methods: batch_size counts completions; the reward is the task's checker.
BUILTIN_ONLINE = dict(
    BUILTIN_PREFERENCE,
    optim=dict(learning_rate=3e-4, warmup_steps=5, min_lr_ratio=0.1),
    batching=dict(batch_size=128, grad_accum=1, max_length=32),
    algo=dict(rewards="exact_match", max_completion_length=8),
)


def recipe(base: dict, **changes) -> dict:
    """``base`` with ``changes`` merged in, nested groups (dicts) key by key."""
    out = dict(base)
    for name, value in changes.items():
        out[name] = recipe(out.get(name, {}), **value) if isinstance(value, dict) else value
    return out


@functools.cache
def config_type(algorithm) -> type:
    """``Config`` with ``algo`` typed as the algorithm's settings, so the CLI lists them."""
    return dataclasses.make_dataclass(
        f"{algorithm.name.upper()}RunConfig",
        [("algo", algorithm.Config, dataclasses.field(default_factory=algorithm.Config))],
        bases=(config_lib.Config,),
    )


def with_overrides(cfg, overrides: dict):
    """``cfg`` with fields replaced; a nested group (``optim``, ``algo``, ...) may be given as a
    dict of its own field overrides."""
    for name, value in overrides.items():
        if isinstance(value, dict):
            value = with_overrides(getattr(cfg, name), value)
        cfg = dataclasses.replace(cfg, **{name: value})
    return cfg


def config_for(algorithm, *groups: dict, **overrides) -> config_lib.Config:
    """An experiment's defaults: the algorithm's config with ``groups`` (dicts of overrides,
    applied in order) and then ``overrides`` applied; nested groups as dicts of field overrides."""
    cfg = config_type(algorithm)()
    for group in (*groups, overrides):
        cfg = with_overrides(cfg, group)
    return cfg


def parse_config(default: config_lib.Config, args: list[str] | None,
                 description: str | None = None, prog: str | None = None) -> config_lib.Config:
    """The one place an experiment's command line becomes a config (validated)."""
    return config_lib.parse(default, args=args, description=description, prog=prog)


def defaults_for(default: config_lib.Config, builtin: dict | None, args: list[str],
                 description: str | None = None) -> config_lib.Config:
    """The defaults that apply to the run ``args`` describe: ``builtin``'s overrides on top of
    ``default`` when its data is the built-in task, else ``default``. The data is read from the
    command line parsed with the built-in recipe (help flags left out, quietly: a mistake is
    reported by the parse that follows)."""
    if not builtin:
        return default
    recipe = with_overrides(default, builtin)
    probe = [a for a in args if a not in ("-h", "--help")]
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            data = parse_config(recipe, probe, description).data
    except SystemExit:
        return recipe
    return recipe if data == "builtin" else default


def for_the_data(cfg: config_lib.Config, algorithm, echo=print) -> config_lib.Config:
    """Settings that depend on the data: exact-match evaluation only where the eval data has
    reference answers (the built-in task, or an ``answer`` column in any of its first 100
    records): a greedy answer compared with a free-text ``chosen`` or ``completion`` measures
    nothing. Online methods keep their held-out prompts either way: their greedy answers are
    scored by the run's rewards (exact match only where there is an answer)."""
    from nnx_posttrain import data

    if not cfg.eval.exact_match or not cfg.eval_data or "builtin" in (cfg.data, cfg.eval_data) \
            or algorithm.data_kind == "prompt_only":
        return cfg
    src = data.source(cfg.eval_data, "eval", builtin=algorithm.data_kind)
    if any(src[i].get("answer") is not None for i in range(min(len(src), 100))):
        return cfg
    echo(f"eval: no exact match: {cfg.eval_data} has no 'answer' column (exact match compares "
         "a greedy answer with a reference answer); eval loss only")
    return with_overrides(cfg, {"eval": {"exact_match": 0}})


def host_allocator_for(model_name: str) -> str:
    """Restart this command with glibc tuned for XLA:CPU's step buffers (no return): huge pages
    where its model's steps have blocks of 32 MB or more, every block from the heap for a built-in
    tiny model (``host_allocator.tunables_for``); nothing when it runs inside another program.
    Else the log line saying which allocator the run has."""
    from nnx_posttrain import host_allocator, tasks
    from nnx_posttrain.tasks import tokenizer

    dims = tasks.MODELS.get(model_name)
    tunables = (host_allocator.tunables_for(tokenizer.VOCAB_SIZE, dims["hidden_dim"]) if dims
                else host_allocator.TUNABLES)
    if host_allocator.started_as_command("experiments"):
        host_allocator.restart_tuned(tunables)
    return host_allocator.describe()


def main(name: str, algorithm, default: config_lib.Config, doc: str | None = None, args=None,
         builtin: dict | None = None, prog: str | None = None):
    """Parse the command line and run. ``builtin``: the experiment's built-in recipe (applied
    when the data is ``builtin``). Errors in the user's input (data, model, checkpoint) end the
    program with their message, not a traceback. ``prog``: the command shown by ``--help``
    (default ``python -m experiments.<name>``)."""
    from nnx_posttrain import checkpoint, data, model

    args = sys.argv[1:] if args is None else list(args)
    defaults = defaults_for(default, builtin, args, doc)
    if builtin:
        doc = (doc or "") + ("\n\nThe defaults below are the built-in task's recipe (--data builtin); "
                             "`--data FILE --help` lists those of a run on your own data."
                             if defaults is not default else
                             "\n\nThe defaults below are those of a run on your own data "
                             "(TRL-like); without --data, the built-in task's recipe applies.")
    cfg = parse_config(defaults, args, doc, prog or f"python -m experiments.{name}")
    print(host_allocator_for(cfg.model))
    try:
        cfg = for_the_data(cfg, algorithm)
        return train.run(cfg, algorithm(cfg.algo, cfg.logprob_chunk), experiment=name)
    except (data.DataError, model.ModelLoadError, checkpoint.CheckpointMismatchError) as exc:
        raise SystemExit(f"error: {exc}") from None
