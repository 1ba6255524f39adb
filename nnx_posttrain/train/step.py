"""The jitted training step and its optimizer.

    state = {params (trainable variables), opt_state, step, rng}   frozen variables stay outside
    step(state, frozen, batch) -> (state, metrics)                 jax.jit over nnx.split / nnx.merge

The step compiles once (fixed batch shape), donates the state, accumulates gradients over
micro-batches with a scan (token-weighted, so the update equals the one large batch), clips,
and applies AdamW with warm-up and decay. Metrics are fetched from the device only when logged.
A step whose loss or gradient norm is not finite leaves the weights and the optimizer state as
they were (its ``nonfinite`` metric is 1; the loop decides whether to stop or go on).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from nnx_posttrain import config as config_lib
from nnx_posttrain import model
from nnx_posttrain.model import merge


def schedule(cfg: config_lib.OptimConfig, total_steps: int) -> optax.Schedule:
    peak, warm = cfg.learning_rate, cfg.warmup(total_steps)
    decay_steps = max(total_steps - warm, 1)
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if not warm:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), decay], [warm])


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` (the same state, the same arithmetic) taking the gradients'
    global norm from the step (``update(..., grad_norm=)``: the norm it logs and checks for a
    finite step) instead of reducing every gradient once more; computed as optax does where not
    given."""

    def update(updates, state, params=None, *, grad_norm=None, **extra):
        del params, extra
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        trigger = jnp.squeeze(norm < max_norm)
        return jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
            updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def optimizer(cfg: config_lib.OptimConfig, total_steps: int):
    lr = schedule(cfg, total_steps)
    parts = [clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    parts.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts), lr


def init_state(params, tx, seed: int) -> dict:
    """The training state: one tree, checkpointed as a whole."""
    return {
        "params": params,
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }


def _sum_tree(a, b):
    return jax.tree.map(jnp.add, a, b)


def metric_means(metrics: dict) -> dict:
    """name -> sum / count; NaN where nothing was counted (e.g. no rejected example in a batch)."""
    return {
        name: jnp.where(c > 0, s / jnp.where(c > 0, c, 1.0), jnp.nan) for name, (s, c) in metrics.items()
    }


def drop_uncounted(metrics: dict) -> dict:
    """A step's host metrics without those nothing was counted for (KTO's ``rewards/rejected``
    in a batch of desirable examples only): left out, as TRL leaves out a split it saw no
    example of, instead of logged as NaN. Told by the finite loss: every counted metric comes
    from the same log-probabilities, so with a finite loss a NaN mean is an empty count; a
    non-finite loss or gradient norm keeps every value (the step guard reports it)."""
    if not all(math.isfinite(metrics.get(k, math.nan)) for k in ("loss", "grad_norm")):
        return metrics
    return {k: v for k, v in metrics.items() if not math.isnan(v)}


LAST_STEP = ("grad_norm", "learning_rate", "nonfinite")  # logged as of the logged step


def interval_means(steps: list[dict]) -> dict:
    """The train record of a log from the host metrics of the steps since the previous log, as
    TRL (transformers' ``Trainer``) logs: each metric the mean of the steps' values,
    ``grad_norm``, ``learning_rate`` (and ``nonfinite``) the last step's. A step counts for a
    metric it measured (``drop_uncounted``); a non-finite step (its update not applied, or the
    run stops) counts for none, as the Trainer's ``logging_nan_inf_filter``, unless every step
    of the interval is one: then the record is the last step's own values, non-finite ones
    shown."""
    kept = [drop_uncounted(m) for m in steps]
    finite = [m for m, raw in zip(kept, steps) if not raw.get("nonfinite")]
    if not finite:
        return dict(kept[-1])
    names = dict.fromkeys(k for m in finite for k in m)
    out = {k: math.fsum(m[k] for m in finite if k in m) / sum(k in m for m in finite)
           for k in names if k not in LAST_STEP}
    out.update({k: steps[-1][k] for k in LAST_STEP if k in steps[-1]})
    return out


def _with_batch(modules, batch):
    module, reference = modules
    return module, batch, reference


def _loss(loss_fn, modules, batch):
    """``loss_fn(module, batch, reference)``, vision backbones reading the batch's
    ``pixel_values`` (``model.images``: the policy's and the reference's forward alike)."""
    with model.images(batch.get("pixel_values")):
        return loss_fn(*_with_batch(modules, batch))


def _laid_out(tree, shardings):
    """``tree`` constrained to ``shardings`` (None: as XLA chooses)."""
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def _mean(grads, denom):
    """The mean gradient ``grads / denom``, float32: an expression XLA fuses into what reads it
    (the norm's reduction, the update's pass over the weights), not a pass of its own."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads)


def _updated(tx, grads, opt_state, params, denom, norm):
    """(params, optimizer state) after one update of ``tx`` with the mean gradient ``grads /
    denom`` (divided here, inside the update's pass over the weights) whose global norm is
    ``norm`` (``clip_by_global_norm`` reads it: not reduced again). The moments keep the dtype
    they were made in (bfloat16 beside bfloat16 weights, ``--dtype bfloat16-params``): the
    float32 gradients would otherwise promote them."""
    updates, new_opt_state = tx.update(_mean(grads, denom), opt_state, params, grad_norm=norm)
    updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
    new_opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_opt_state, opt_state)
    return optax.apply_updates(params, updates), new_opt_state


def _kept(grads, opt_state, params, denom, norm):
    return params, opt_state


def _renamed(stacks: dict, before, after) -> dict:
    """``stacks`` (``model.frozen_stacks`` of ``before``'s leaves) keyed by ``after``'s leaves,
    the same values as another trace sees them (the loop's barrier gives new ones)."""
    return {id(b): stacks[id(a)] for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
            if id(a) in stacks}


def _summed(grad_fn, like_params, params, frozen, batch, stacks):
    """(loss sums, gradient sums) over the micro-batches of ``batch`` ([accum, micro, ...]
    leaves) for ``grad_fn`` (``value_and_grad`` of one micro-batch's loss; ``like_params`` lays
    out a tree like the weights): one micro-batch as the backward pass gives them (no running
    sum to start from and add to), several summed in float32. ``stacks``: the scanned blocks'
    frozen weights, stacked once for every micro-batch (``model.frozen_stacks``)."""
    n = jax.tree.leaves(batch)[0].shape[0]
    if n == 1:
        with model.given_stacks(stacks):
            loss, grads = grad_fn(params, frozen, jax.tree.map(lambda x: x[0], batch))
        return jax.tree.map(lambda x: x.astype(jnp.float32), loss), like_params(grads)

    def accumulate(grad_sum, micro_batch):
        # a barrier with the running sum: what XLA derives from the weights (FSDP's gathers,
        # conversions) stays in each iteration, not hoisted out with every layer's held at once
        p, f, grad_sum = jax.lax.optimization_barrier((params, frozen, grad_sum))
        with model.given_stacks(_renamed(stacks, frozen, f)):
            loss, grads = grad_fn(p, f, micro_batch)
        grads = like_params(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        return _sum_tree(grad_sum, grads), jax.tree.map(lambda x: x.astype(jnp.float32), loss)

    # the gradients' running sum starts from zeros of the weights' shapes; the losses and
    # metrics come out per micro-batch and are summed after the loop, in the same order (no
    # trace of the model just for their shapes: it doubled the step's tracing time)
    zeros = like_params(jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), params))
    grads, losses = jax.lax.scan(accumulate, zeros, batch)
    return functools.reduce(_sum_tree, [jax.tree.map(lambda x: x[i], losses)
                                        for i in range(n)]), grads


def jit_train_step(graphdef, loss_fn, optimizer, state_shardings, mesh):
    """The jitted training step, as the loop and ``nnx_posttrain.plan`` build it: the state
    donated, its output shardings pinned to ``state_shardings`` (``sharding.tree_shardings`` of
    the state; without that they drift after an update), the metrics replicated. ``optimizer``:
    ``(tx, lr_schedule)`` as ``optimizer`` returns them."""
    tx, lr = optimizer
    step = make_train_step(graphdef, loss_fn, tx, lr, state_shardings["params"])
    return jax.jit(step, donate_argnums=(0,),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())))


def make_train_step(graphdef, loss_fn, tx, lr_schedule, param_shardings=None):
    """step(state, frozen, batch) -> (state, metrics). ``batch`` leaves are [accum, micro, ...];
    ``loss_fn(module, micro_batch, reference_module)``; ``frozen`` as in ``algorithms.merge``.
    ``param_shardings`` (the trainable weights' shardings, a tree like ``state["params"]``):
    the gradients and their running sum are laid out like the weights (under FSDP, summed over
    the batch shards by a reduce-scatter into each device's share, never held whole)."""

    def micro_loss(params, frozen, micro_batch):
        total, weight, metrics = _loss(loss_fn, merge(graphdef, params, frozen), micro_batch)
        return total, (weight, metrics)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    like_params = functools.partial(_laid_out, shardings=param_shardings)

    def step(state, frozen, batch):
        params = state["params"]
        stacks = model.frozen_stacks(merge(graphdef, params, frozen), frozen)
        (total, (weight, metrics)), grads = _summed(grad_fn, like_params, params, frozen,
                                                    batch, stacks)
        denom = jnp.maximum(weight, 1e-9)
        grad_norm = optax.tree.norm(_mean(grads, denom))  # logged; clipping divides by it
        # a NaN / inf loss or gradient never reaches the weights or the AdamW moments: the update
        # runs only on a finite step (a cond, not a select on every leaf: a select costs one more
        # pass over the weights and both moments, and keeps the old moments alive beside the new)
        finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)

        new_params, new_opt_state = jax.lax.cond(finite, functools.partial(_updated, tx), _kept,
                                                 grads, state["opt_state"], params, denom,
                                                 grad_norm)
        new_state = {
            "params": new_params,
            "opt_state": new_opt_state,
            "step": state["step"] + 1,
            "rng": jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0]),
        }
        out = metric_means(metrics)
        out.update(grad_norm=grad_norm, learning_rate=lr_schedule(state["step"]),
                   nonfinite=1 - finite.astype(jnp.int32))
        return new_state, out

    return step


def make_eval_step(graphdef, loss_fn):
    """eval(params, frozen, batch) -> (total, weight, metric sums): summed, divided by the caller."""

    def evaluate(params, frozen, batch):
        return _loss(loss_fn, merge(graphdef, params, frozen), batch)

    return evaluate
