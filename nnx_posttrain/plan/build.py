"""A run's training step built abstractly: ``train.prepare(cfg, algorithm, abstract=topology)``
builds the run as it would for training (the model, mesh, shardings, training state and frozen
weights) with every array a ``jax.ShapeDtypeStruct`` laid out on the topology's devices (no weight
read, nothing allocated, no run directory or checkpoint); this adds the first batch and the
loop's own jitted step (``train.loop.compile_step``).

The batch is the run's first one, made by the algorithm's own batch source from the run's data
(offline algorithms), or (online ones) a rollout of the same shapes: prompts from the data and
completions of ``--algo.max-completion-length`` tokens, whose sampler, log-prob and reward
computations are replaced by zeros of their abstract shapes (``AbstractRollouts``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_posttrain import errors, model, sharding
from nnx_posttrain.algorithms.base import RunContext
from nnx_posttrain.algorithms.online.rollout import OnlineAlgorithm, Rollouts, rollout_rows
from nnx_posttrain.train import loop, run as run_lib
from nnx_posttrain.train.mesh import check_batch_rows


@dataclasses.dataclass
class AbstractRun:
    """The abstract arguments of a run's step and the jitted step itself."""

    cfg: object
    lm: model.LanguageModel
    mesh: jax.sharding.Mesh
    state: dict  # {params, opt_state, step, rng}: ShapeDtypeStructs with their shardings
    frozen: dict  # {"model": ..., "reference": ... or None}
    batch: dict  # [accum, micro, ...] ShapeDtypeStructs sharded over the batch axes
    step: object  # the jitted step (donating the state, output shardings pinned)
    attention: str  # the attention path the step takes (model.set_attention)


def build(cfg, algorithm, topology, echo=print) -> AbstractRun:
    """The abstract step of the run ``cfg`` of ``algorithm`` on ``topology``
    (``plan.topology.Topology``), refused first where a plan cannot build it."""
    refuse_unplannable(cfg, algorithm)
    run = run_lib.prepare(cfg, algorithm, echo, abstract=topology)
    sample_cfg, scale = _sample_batch(run.cfg, algorithm)
    host = first_batch(algorithm, dataclasses.replace(run.context, cfg=sample_cfg), run.state)
    return AbstractRun(run.cfg, run.lm, run.mesh, run.state, run.frozen,
                       _batch(host, run.mesh, run.cfg.batching.grad_accum, scale),
                       loop.compile_step(run).jitted,
                       model.attention_of(run.lm.module).implementation)


def refuse_unplannable(cfg, algorithm) -> None:
    """``ConfigError`` for what a plan cannot build yet, before anything loads."""
    if not algorithm.plannable:
        raise errors.ConfigError(f"plan: {algorithm.name} cannot be planned yet "
                                 f"({algorithm.plannable_not})")
    if getattr(algorithm.cfg, "reference", None) == "precompute":  # never chosen by auto
        raise errors.ConfigError(
            "plan: --algo.reference precompute computes the reference log-probs with the "
            "weights before training; plan the step with --algo.reference copy or lora_base")
    if cfg.eval_only:
        raise errors.ConfigError("plan: --eval-only runs no training step; plan without it")


def _sample_batch(cfg, algorithm) -> tuple[object, int]:
    """(``cfg`` with the smallest batch of the same make-up, how many times it fits in the
    run's): the plan needs only the batch's shapes, and every array of a batch has one row per
    example (or per completion), so the first batch is built that small and its rows scaled;
    a batch of millions costs no tokenizing. The smallest: a multiple of --batching.grad-accum
    (and of an online method's generations per prompt), which divides the batch size as they
    do."""
    b = cfg.batching
    least = math.lcm(b.grad_accum, getattr(algorithm.cfg, "num_generations", 1)
                     if isinstance(algorithm, OnlineAlgorithm) else 1)
    if b.batch_size % least:  # refused elsewhere with its own message; build as asked
        return cfg, 1
    return dataclasses.replace(cfg, batching=dataclasses.replace(b, batch_size=least)), \
        b.batch_size // least


def first_batch(algorithm, ctx: RunContext, state) -> dict:
    """The device batch (numpy, [batch, ...]) of the run's first step."""
    online = isinstance(algorithm, OnlineAlgorithm)
    source = (AbstractRollouts(algorithm, ctx, state["params"]) if online
              else algorithm.inputs(ctx, state["params"]).train)
    try:
        batch = (source.rollout(1, state, next(source.prompts))[0] if online
                 else source.next(1, state))
    finally:
        source.close()
    return source.to_device(batch)


def _batch(host: dict, mesh, accum: int, scale: int = 1) -> dict:
    """Host arrays [batch, ...] (of a batch ``scale`` times smaller than the run's) ->
    [accum, micro, ...] ShapeDtypeStructs of the run's batch, laid out as the loop lays them
    out (``train.mesh.shard_batch``)."""
    out = {}
    for k, v in host.items():
        v = np.asarray(v)
        rows = v.shape[0] * scale
        check_batch_rows(k, rows // accum, mesh)
        shape = (accum, rows // accum, *v.shape[1:])
        out[k] = jax.ShapeDtypeStruct(shape, v.dtype, sharding=NamedSharding(
            mesh, sharding.batch_spec(len(shape), mesh, leading=1)))
    return out


def _zeros_like_output(fn, *args, **static):
    """Zeros of the shapes ``fn(*args, **static)`` would return, computed abstractly (plain
    Python values among ``args`` stay as they are: they may decide shapes)."""
    plain = (int, float, bool, str, type(None))
    traced = [i for i, a in enumerate(args) if not isinstance(a, plain)]

    def call(*arrays):
        full = list(args)
        for i, x in zip(traced, arrays):
            full[i] = x
        return fn(*full, **static)

    shapes = jax.eval_shape(call, *(args[i] for i in traced))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


class AbstractRollouts(Rollouts):
    """Rollouts whose device computations give zeros of their abstract shapes: every
    completion ``--algo.max-completion-length`` tokens, rewards 0, nothing decoded. What the
    algorithm builds from it (``make_batch``) has the shapes of a real rollout's batch."""

    def __init__(self, algorithm, run, params):
        super().__init__(algorithm, run, params)
        sample = self._sample
        self._sample = lambda states, *rest: _zeros_like_output(sample, states, *rest)

    def compile(self, fn):
        compiled = super().compile(fn)
        return lambda state, *arrays: _zeros_like_output(compiled, state, *arrays)

    def logps(self, batch, state, with_old, with_ref):
        if not (with_old or with_ref):
            return {}
        return _zeros_like_output(self._rollout_logps, state["params"], self.frozen,
                                  rollout_rows(batch), with_old=with_old, with_ref=with_ref)

    def _texts(self, ids, mask):
        return [""] * len(ids)

    def _rewards(self, gen, index):
        n = len(gen.prompt_ids)
        self.rewards_per_func = np.zeros((n, len(self.reward_fns)), np.float32)
        return np.zeros(n, np.float32), {}, {}
