"""Conventions and helpers shared by the losses of this package. Imports jax and
``nnx_posttrain.errors`` only.

Every loss returns ``(total, weight, metrics)``:

- ``total``: the loss *summed* over its unit (tokens for SFT, pairs for the pairwise preference
  losses, examples for the unpaired KTO);
- ``weight``: how many units were summed (float32), so that ``total / weight`` is the batch mean,
  and summing ``total`` and ``weight`` over micro-batches before dividing gives exactly the
  large-batch mean (gradient accumulation is token-weighted, not a mean of means);
- ``metrics``: metric name (TRL's names) -> ``(sum, count)``, reduced the same way.

Summing ``total``, ``weight`` and every metric's ``sum`` and ``count`` over micro-batches and then
dividing gives exactly the large-batch mean (for KTO, when the KL estimate is shared; see
:func:`nnx_posttrain.losses.preference.kto`). A metric whose count is 0 (e.g. ``rewards/rejected``
in a KTO batch with only desirable examples) has no value for that batch: skip it rather than
dividing 0 by 0.

Inputs of the preference losses are per-sequence log-probabilities, float32 arrays of shape
``[batch]``: the log-probability of the completion given the prompt, either summed over the
completion tokens or averaged over them (the caller computes both from per-token log-probs and a
0/1 mask). Which one a loss expects is stated in its docstring; it follows what TRL's trainer
feeds it, so that numbers are comparable with TRL runs:

================  ==========================================================================
loss              per-sequence log-probs
================  ==========================================================================
``dpo``           summed (TRL's DPOTrainer); ``ipo`` and ``sigmoid_norm`` divide by the
                  completion lengths given in ``chosen_lengths`` / ``rejected_lengths``
``cpo``           summed for ``sigmoid`` / ``hinge``, averaged for ``ipo`` (and ``simpo``:
                  :func:`simpo`), as TRL's CPOTrainer
``simpo``         averaged
``orpo``          averaged
``kto``           summed
================  ==========================================================================

NLL terms (DPO's ``sft``, CPO's and CPO-SimPO's ``nll_weight``, ORPO's) are TRL's: the token mean
of the cross-entropy over all the NLL tokens of the batch, -sum_i sum_t logp_it / sum_i T_i, not
a mean of per-example averages. The losses take it as a per-pair array ``chosen_nll`` whose mean
over the pairs is the term: :func:`token_mean_terms` turns per-example NLL sums into it, scaled
by pairs / tokens *of the whole accumulated batch* (computed on the host before the batch is
split into micro-batches), so the micro-batches' sums still add up to the large-batch token mean
exactly.

Numerics: everything is computed in float32 with ``log_sigmoid`` / ``softplus`` / ``log1mexp``
forms, so equal log-probs, huge margins (|x| ~ 1e4) and very negative log-probs give finite
losses and finite gradients.

Options: each loss family owns a frozen dataclass of its options (:class:`Options`; TRL's names
and defaults), whose checks run when it is made and raise ``nnx_posttrain.errors.ConfigError``
naming the option and the fix. An algorithm's settings (``--algo.*``) *are* its loss family's
options (the algorithm's ``Config`` derives from them), so every option and its default is written
once, here. A loss takes ``(arrays, options)``: a ``NamedTuple`` of arrays and the options.

Names with a leading underscore are internal to this package (shared by its modules).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnx_posttrain import errors

Metrics = dict[str, tuple[jax.Array, jax.Array]]

# ----------------------------------------------------------------------------- options

_CHECKED = contextvars.ContextVar("nnx_posttrain_options_checked", default=True)


@contextlib.contextmanager
def unchecked_options():
    """Options made inside this block are not checked when made: a run's settings built in
    layers (defaults, a config file, then flags) may pass through combinations the finished
    settings do not have. Check the finished ones with ``Options.check`` (``Config.validate``
    lists their ``problems`` with every other problem of the settings)."""
    token = _CHECKED.set(False)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def flag(name: str) -> str:
    """How an option is spelled on the command line: ``--algo.loss-type`` for ``loss_type``."""
    return "--algo." + name.replace("_", "-")


def out_of_range(options, name: str, ok: bool, rule: str) -> list[str]:
    """``[problem]`` when ``ok`` is false: ``--algo.NAME must be RULE, got VALUE``; else ``[]``."""
    return [] if ok else [f"{flag(name)} must be {rule}, got {getattr(options, name)}"]


@dataclasses.dataclass(frozen=True)
class Options:
    """The base of every loss family's options: frozen, checked when made (``problems``)."""

    def __post_init__(self):
        if _CHECKED.get():
            self.check()

    def problems(self) -> list[str]:
        """What is wrong with these options, one sentence each naming the option and the fix
        (a subclass adds its own to its base's)."""
        return []

    def check(self) -> None:
        """``ConfigError`` listing every problem of these options (none: returns)."""
        problems = self.problems()
        if problems:
            raise errors.ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


class Pairs(NamedTuple):
    """The arrays of a reference-free pairwise loss (SimPO, CPO, ORPO): the policy's log-probs of
    the chosen and rejected completions, ``[batch]`` (summed or averaged, as the loss's docstring
    says), and the per-pair NLL term of the chosen one (see :func:`token_mean_terms`) or None."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_nll: jax.Array | None = None

# log1mexp(x) = log(1 - exp(x)) is -inf at x = 0 (probability 1, infinite odds). Inputs are
# clamped to at most this value so ORPO stays finite for a sequence the model is certain of;
# it changes nothing for any average log-prob below -1e-12.
_LOG1MEXP_MAX_INPUT = -1e-12


def _f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _count(x: jax.Array) -> jax.Array:
    return jnp.asarray(x.shape[0], dtype=jnp.float32)


def _mean_metric(values: jax.Array, where: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` of ``values`` (optionally only where the 0/1 float ``where`` is 1)."""
    values = jax.lax.stop_gradient(_f32(values))
    if where is None:
        return jnp.sum(values), _count(values)
    return jnp.sum(jnp.where(where > 0, values, 0.0)), jnp.sum(where)


def _is_python_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _lengths(x) -> jax.Array:
    # TRL clamps completion lengths to at least 1 (``mask.sum(dim=1).clamp(min=1.0)``).
    return jnp.maximum(_f32(x), 1.0)


def token_mean_terms(nll_sums, nll_tokens=None, scale=None) -> jax.Array:
    """Per-example NLL sums -> per-pair terms whose mean over the pairs is the token-mean NLL.

        term_i = nll_sum_i * scale,   scale = pairs / tokens of the (whole, accumulated) batch

    so that mean_i term_i = sum_i nll_sum_i / sum_i T_i (TRL's cross-entropy over all the batch's
    NLL tokens). ``scale`` None: this batch's own, ``len(nll_sums) / sum(nll_tokens)``; pass the
    whole batch's when ``nll_sums`` is one micro-batch of it (the algorithms compute it on the
    host: ``nll_scale``), which keeps the accumulated loss exact.
    """
    nll_sums = _f32(nll_sums)
    if scale is None:
        scale = nll_sums.shape[0] / jnp.maximum(jnp.sum(_f32(nll_tokens)), 1.0)
    return nll_sums * _f32(scale)


def log1mexp(x) -> jax.Array:
    """log(1 - exp(x)) for x <= 0, accurate in float32 over the whole range.

    Mächler's rule ("Accurately Computing log(1 - exp(-|a|))", 2012): for -log 2 < x <= 0 use
    log(-expm1(x)) (exact near 0, where 1 - exp(x) cancels), otherwise log1p(-exp(x)) (exact for
    very negative x, where exp(x) underflows). Each branch only ever sees inputs from its own
    range, so neither produces inf/NaN that ``jnp.where`` would leak into the gradient. Inputs are
    clamped to at most -1e-12 so the result (and its gradient) stays finite at x = 0.
    """
    x = jnp.minimum(_f32(x), _LOG1MEXP_MAX_INPUT)
    near_zero = x > -jnp.log(2.0).astype(jnp.float32)
    x_near = jnp.where(near_zero, x, -1.0)
    x_far = jnp.where(near_zero, -1.0, x)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(x_near)), jnp.log1p(-jnp.exp(x_far)))


def _pair_metrics(
    chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, per_pair_loss
) -> Metrics:
    """The metrics TRL's DPO / CPO / ORPO trainers log, as ``(sum, count)`` over pairs."""
    return {
        "loss": _mean_metric(per_pair_loss),
        "rewards/chosen": _mean_metric(chosen_rewards),
        "rewards/rejected": _mean_metric(rejected_rewards),
        "rewards/margins": _mean_metric(chosen_rewards - rejected_rewards),
        "rewards/accuracies": _mean_metric((chosen_rewards > rejected_rewards).astype(jnp.float32)),
        "logps/chosen": _mean_metric(policy_chosen),
        "logps/rejected": _mean_metric(policy_rejected),
    }


def _smoothed_sigmoid(logits, label_smoothing) -> jax.Array:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the (conservative) logistic loss."""
    loss = -jax.nn.log_sigmoid(logits)
    if _is_python_number(label_smoothing) and label_smoothing == 0:
        return loss
    eps = _f32(label_smoothing)
    return (1.0 - eps) * loss - eps * jax.nn.log_sigmoid(-logits)


def _uses(weight) -> bool:
    """Whether a term weighted by ``weight`` is added (a Python 0 adds nothing)."""
    return not (_is_python_number(weight) and weight == 0)
