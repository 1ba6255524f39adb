"""Per-token log-probabilities in float32, without materialising [batch, length, vocab] logits.

The forward pass (``hidden_states``, with packed rows and remat applied through ``blocks``, the
projections' gradient through ``dense``), then
the vocabulary projection a chunk of positions at a time, only at the positions that carry loss
when asked (``scored_positions``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from nnx_posttrain.model import attention, dense, quantize, router
from nnx_posttrain.model.vision import backbone_inputs, encoded_once, rotary_positions
from nnx_posttrain.model.blocks import (
    _attention_mask_override,
    _block_calls,
    recurrent_calls,
    segment_attention_mask,
)
from nnx_posttrain.model.blocks import rope_positions as rope_positions_scope
from nnx_posttrain.sharding import constrain_batch


def hidden_states(module, token_ids, padding_mask, segment_ids=None, rope_positions=None):
    """Final hidden states. With ``segment_ids`` (packed rows), attention stays within each
    example. Positions are not restarted per example: every supported family uses rotary
    embeddings, whose attention scores depend only on relative positions within an example.
    ``rope_positions`` [batch, T] are the rotary positions where that does not hold (a shared-prefix
    row, whose second branch continues the prefix: ``algorithms.shared_prompt``). A vision
    backbone reads the images of ``vision.images``' scope (``vision.backbone_inputs``). A
    backbone with recurrent blocks (Qwen 3.5's Gated DeltaNet, whose state runs along the whole
    row) takes no packed rows: ``ConfigError``."""
    if segment_ids is not None:
        _refuse_packing(module)
    rope = (contextlib.nullcontext() if rope_positions is None
            else rope_positions_scope(module, rope_positions))
    branched = rope_positions is not None
    rows = padding_mask if segment_ids is None else segment_ids != 0
    with _block_calls(module), dense.overridden(module), router.recording(module, rows), rope, \
            encoded_once(module), rotary_positions(module, token_ids, padding_mask), \
            recurrent_calls(module), \
            attention.scope(module, padding_mask, segment_ids, branched) as own:
        if segment_ids is None:
            return constrain_batch(module(backbone_inputs(module, token_ids, padding_mask)))
        inputs = backbone_inputs(module, token_ids, (segment_ids != 0).astype(jnp.int32))
        if own:  # the attention path compares the segment ids itself (model.set_attention)
            return constrain_batch(module(inputs))
        with _attention_mask_override(module, segment_attention_mask(segment_ids)):
            return constrain_batch(module(inputs))


def _refuse_packing(module) -> None:
    """``ConfigError`` when ``module`` has a recurrent block (``attention.recurrent_layer``):
    its state would carry one packed example into the next."""
    from nnx_posttrain import errors
    from nnx_posttrain.model.blocks import decoder_blocks

    if any(attention.recurrent_layer(block) is not None for block in decoder_blocks(module)):
        raise errors.ConfigError(
            f"--batching.packing: {type(module).__name__}'s recurrent blocks (Gated DeltaNet) "
            "carry their state along the whole row, across packed examples; train it unpacked")


# The default (``chunk_size=None``): the logits of the whole batch at once, kept for the backward
# pass, while they take at most ``logits_budget()`` bytes (float32); beyond it chunks of positions
# whose logits take at most that much (a multiple of CHUNK positions, at least CHUNK), recomputed
# in the backward pass. Keeping them saves one vocabulary projection per step (medium benchmark
# SFT on a CPU: 1,750 -> 1,555 ms); chunks bound the memory at a real vocabulary (Gemma's 256 k).
# On an accelerator the budget is a sixteenth of the device's memory: each chunk adds a pass over
# the embedding's gradient (its running sum), and 16 chunks of 128 positions made a ~1 B SFT step
# on a TPU v5e 276 ms against 227 ms with 4 chunks of 512 (docs/benchmarks.md, "TPU").
KEEP_LOGITS_BYTES = 256 * 2**20
CHUNK = 128


_DEVICE_MEMORY: contextvars.ContextVar[int | None] = contextvars.ContextVar("device_memory",
                                                                           default=None)


@contextlib.contextmanager
def assume_device_memory(nbytes: int | None):
    """The logits budget within: that of a device with ``nbytes`` of memory, whatever device
    this process has (``plan`` compiles a TPU's step on a CPU host: the chunks the TPU's run
    will take)."""
    token = _DEVICE_MEMORY.set(nbytes)
    try:
        yield
    finally:
        _DEVICE_MEMORY.reset(token)


def logits_budget() -> int:
    """Bytes of float32 logits the vocabulary projection may hold at once: ``KEEP_LOGITS_BYTES``
    on a host CPU (or where the device does not say its memory), a sixteenth of the device's
    memory on an accelerator (about 1 GB on a 16 GB TPU v5e chip): the first device's, or that
    ``assume_device_memory`` names."""
    limit = _DEVICE_MEMORY.get()
    if limit is None:
        try:
            limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
        except Exception:  # noqa: BLE001 - a backend without memory statistics: the host's rule
            limit = None
    return max(KEEP_LOGITS_BYTES, int(limit) // 16) if limit else KEEP_LOGITS_BYTES


def vocabulary_logits(embedding, h):
    """float32 logits [..., vocab] of hidden states ``h`` [..., width]: ``embedding(h,
    reverse=True)`` (its soft cap included); an int8 embedding a block of vocabulary rows at a
    time (``quantize.reverse_logits``: no float copy of its whole table)."""
    if getattr(embedding, "quantization_mode", None) == "int8":
        return quantize.reverse_logits(embedding, h).astype(jnp.float32)
    return checkpoint_name(embedding(h, reverse=True), SAVED_LOGITS).astype(jnp.float32)


SAVED_LOGITS = "vocabulary_logits"


def _recomputation(embedding, rows: int, vocab: int):
    """The checkpoint policy of a chunk of the vocabulary projection over ``rows`` positions in
    all: the logits of every chunk kept for the backward pass, in the model's own 16-bit dtype,
    while they take at most ``logits_budget()`` (1 GiB on a 16 GiB TPU v5e), so that only the
    cheap float32 terms (log-sum-exp, softmax) are recomputed, not the projection (one of its
    four matmuls); else (float32 logits, an int8 table, more logits than that) the whole chunk is
    recomputed. The kept values are those the forward pass computed: the gradients are the same
    either way. Measured on the v5e with twice that budget (docs/benchmarks.md): the ~1 B SFT
    step 206.8 -> 198.1 ms for 3.4 GiB more temporaries, DPO at 15.7 of the chip's 15.7 GiB:
    not worth the default."""
    itemsize = jnp.dtype(getattr(embedding, "compute_dtype", "float32")).itemsize
    if itemsize > 2 or rows * vocab * itemsize > logits_budget():
        return None  # recompute everything
    return jax.checkpoint_policies.save_only_these_names(SAVED_LOGITS)


def chunk_positions(chunk_size: int | None, batch: int, length: int, vocab: int,
                    budget: int | None = None) -> int:
    """Positions per chunk of the vocabulary projection (0: all at once, nothing recomputed):
    ``chunk_size`` when given, else by the budget rule above (``budget``: bytes, default
    ``logits_budget()``)."""
    if chunk_size is not None:
        return chunk_size
    budget = logits_budget() if budget is None else budget
    if batch * length * vocab * 4 <= budget:
        return 0
    return max(CHUNK, budget // (batch * vocab * 4) // CHUNK * CHUNK)


@dataclasses.dataclass(frozen=True)
class Projection:
    """How ``token_logprobs`` runs the vocabulary projection, and what it returns besides the
    log-probs.

    ``chunk_size``: positions projected at a time (and recomputed in the backward pass), so peak
    memory holds [batch, chunk, vocab], never [batch, length, vocab]; 0 projects the whole
    sequence at once, without recomputation (more memory, fewer FLOPs); None (the default)
    chooses by the size of the logits (``chunk_positions``). ``temperature`` divides the logits
    (RL: the sampling distribution). Then, in this order after the log-probs: ``entropy``, the
    per-position entropy of the predictive distribution; ``log_sum_sq``, log sum_v p(v | x_<t)^2
    per position, without gradient (WPO's weights; TRL's fused LM head output
    ``log_sum_sq_probs``); ``correct``, 1.0 where the token is the model's most likely next
    token (its logit is the largest; a tie counts as correct) and 0.0 elsewhere, without
    gradient: SFT's ``mean_token_accuracy`` (the largest logit is the one the log-sum-exp
    already takes, so this costs no pass over the vocabulary)."""

    chunk_size: int | None = None
    temperature: float = 1.0
    entropy: bool = False
    log_sum_sq: bool = False
    correct: bool = False


LOGPROBS = Projection()


def token_logprobs(module, token_ids, padding_mask, projection: Projection = LOGPROBS,
                   positions=None, segment_ids=None):
    """log p(token_ids[:, t] | token_ids[:, <t]) for every t, float32, shape [batch, length];
    with the extras ``projection`` asks for, a tuple (log-probs first, see :class:`Projection`).

    Position 0 has no prediction and is 0. ``segment_ids`` marks the examples of packed rows
    (see ``hidden_states``); the first token of each example has no meaningful prediction and
    must carry no loss.

    ``positions`` [batch, k] (from :func:`scored_positions`) limits the vocabulary projection to
    those positions, the ones that carry loss: the others come back as 0. The projection is the
    largest matmul of a small model; a preference pair's prompt needs none (TRL's fused LM head
    does the same).
    """
    h = hidden_states(module, token_ids, padding_mask, segment_ids)
    return logprobs_from_hidden(module, h, token_ids, projection, positions)


def scored_positions(*loss_masks: np.ndarray) -> list[np.ndarray] | None:
    """Host side: for each [batch, length] loss mask, the positions that carry loss, ascending,
    as a [batch, k] int32 array padded with ``length`` (an index that selects nothing), for
    ``token_logprobs(positions=...)``. One ``k`` for all masks, rounded up to length/8, /4 or /2
    (a few compiled shapes at most); None when some row needs more than half the positions
    (projecting every position is then as cheap)."""
    length = loss_masks[0].shape[1]
    need = max(int((m[:, 1:] > 0).sum(axis=1).max(initial=0)) for m in loss_masks)
    k = next((-(-length // d) for d in (8, 4, 2) if need <= -(-length // d)), None)
    if k is None:
        return None
    out = []
    for mask in loss_masks:
        scored = mask > 0
        scored[:, 0] = False  # position 0 has no prediction
        order = np.argsort(~scored, axis=1, kind="stable")[:, :k]
        out.append(np.where(np.take_along_axis(scored, order, axis=1), order, length)
                   .astype(np.int32))
    return out


def _chunked(x, chunk: int):
    """[batch, length, ...] -> [n_chunks, batch, chunk, ...], zero-padded to whole chunks (the
    layout ``jax.lax.map`` walks, one chunk at a time)."""
    batch, length = x.shape[:2]
    n_chunks = -(-length // chunk)
    x = jnp.pad(x, ((0, 0), (0, n_chunks * chunk - length)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(batch, n_chunks, chunk, *x.shape[2:]).swapaxes(0, 1)


def _placed(x, length: int, full_length: int, places=None):
    """Per-chunk results [n_chunks, batch, chunk] of ``length`` predictions -> [batch,
    full_length]: position t holds the prediction of token t (0 at position 0), or, with
    ``places`` [batch, length], each result at its place (out of range: dropped), 0 elsewhere."""
    batch = x.shape[1]
    x = x.swapaxes(0, 1).reshape(batch, -1)[:, :length]
    if places is None:
        return jnp.pad(x, ((0, 0), (1, 0)))
    rows = jnp.arange(batch)[:, None]
    return jnp.zeros((batch, full_length), x.dtype).at[rows, places].set(x, mode="drop")


def _gathered(h, token_ids, positions, gather):
    """(hidden states, targets, where the results go: ``places`` or None, their length)."""
    full_length = token_ids.shape[1]
    if positions is not None:  # position t is predicted from the hidden state at t - 1
        clipped = jnp.clip(positions, 1, full_length - 1)
        gather = (clipped - 1, clipped, positions, full_length)
    if gather is None:
        return h[:, :-1], token_ids[:, 1:], None, full_length
    sources, targets, places, full_length = gather
    return (jnp.take_along_axis(h, sources[..., None], axis=1),
            jnp.take_along_axis(token_ids, targets, axis=1), places, full_length)


def _chunk_terms(embedding, projection: Projection):
    """The per-chunk function of ``logprobs_from_hidden``: (hidden states, targets) of a chunk
    -> (log-probs, entropy, log sum p^2, correct), zeros for what ``projection`` does not ask."""
    temperature = projection.temperature

    def one_chunk(args):
        h_c, t_c = args
        logits = vocabulary_logits(embedding, h_c)
        if temperature != 1.0:
            logits = logits / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        logp = picked - log_z
        zeros = jnp.zeros_like(logp)
        lss = (jax.lax.stop_gradient(jax.nn.logsumexp(2.0 * logits, axis=-1) - 2.0 * log_z)
               if projection.log_sum_sq else zeros)
        correct = (jax.lax.stop_gradient(picked >= jnp.max(logits, axis=-1)).astype(jnp.float32)
                   if projection.correct else zeros)
        if not projection.entropy:
            return logp, zeros, lss, correct
        probs = jax.nn.softmax(logits, axis=-1)
        entropy = log_z - jnp.sum(probs * logits, axis=-1)
        return logp, entropy, lss, correct

    return one_chunk


def logprobs_from_hidden(module, h, token_ids, projection: Projection = LOGPROBS, positions=None,
                         gather=None):
    """``token_logprobs`` from the final hidden states ``h`` [batch, length, width] (for models
    that read the hidden states twice, e.g. a policy with a value head). ``gather`` (sources,
    targets, places, out_length), each [batch, k] but the last: the token at index ``targets``
    predicted from the hidden state at ``sources``, its results placed at ``places`` (out of
    range: dropped) of [batch, out_length] arrays; ``positions`` p is the gather (p - 1, p, p,
    length)."""
    batch = token_ids.shape[0]
    h, targets, places, full_length = _gathered(h, token_ids, positions, gather)
    length = h.shape[1]
    embedding = module.token_embedding
    chunk_size = chunk_positions(projection.chunk_size, batch, length, int(embedding.input_dim))
    chunk = min(chunk_size, length) if chunk_size > 0 else length
    h, targets = _chunked(h, chunk), _chunked(targets, chunk)
    one_chunk = _chunk_terms(embedding, projection)
    if chunk_size > 0:  # recomputed in the backward pass: one chunk of f32 logits alive at a time
        one_chunk = jax.checkpoint(one_chunk, policy=_recomputation(
            embedding, h.shape[0] * h.shape[1] * h.shape[2], int(embedding.input_dim)))

    def project(h, targets):
        return jax.lax.map(one_chunk, (h, targets))

    lazy = getattr(module, "_nnx_posttrain_remat", False) == "lazy_frozen"
    if lazy and getattr(embedding, "quantization_mode", None) != "int8":  # int8: converted by block
        from nnx_posttrain.model.frozen import lazy_frozen_call

        project = lazy_frozen_call(embedding, project)  # bfloat16 on CPU: see model.frozen
    logp, entropy, lss, correct = project(h, targets)

    def unchunk(x):
        return _placed(x, length, full_length, places)

    out = (unchunk(logp),) + ((unchunk(entropy),) if projection.entropy else ())
    out += (unchunk(lss),) if projection.log_sum_sq else ()
    out += (unchunk(correct),) if projection.correct else ()
    return out if len(out) > 1 else out[0]


def paired_terms(models, token_ids, padding_mask, fn, chunk_size: int | None = None,
                 positions=None):
    """``fn(logits, other_logits)`` -> per-position arrays, from two models ``models`` = (module,
    other) that read the same ``token_ids`` (distillation's student and frozen teacher, sharing
    one tokenizer): each a ``[batch, length]`` array placed as ``token_logprobs`` places its
    log-probs (position t: the prediction of token t; 0 where not computed). Both vocabulary
    projections run a chunk of positions at a time (recomputed in the backward pass): the step
    holds [batch, chunk, vocab] logits of each model, never [batch, length, vocab];
    ``positions`` (``scored_positions``) projects only those. ``other`` gets no gradient. Logits
    are float32, after each family's final soft cap (Gemma 2's)."""
    module, other = models
    h = hidden_states(module, token_ids, padding_mask)
    h_other = jax.lax.stop_gradient(hidden_states(other, token_ids, padding_mask))
    batch, full_length = token_ids.shape
    if positions is None:
        h, h_other = h[:, :-1], h_other[:, :-1]
    else:  # position t is predicted from the hidden state at t - 1
        sources = (jnp.clip(positions, 1, full_length - 1) - 1)[..., None]
        h = jnp.take_along_axis(h, sources, axis=1)
        h_other = jnp.take_along_axis(h_other, sources, axis=1)
    length = h.shape[1]
    vocab = int(module.token_embedding.input_dim)
    chunk_size = chunk_positions(chunk_size, 2 * batch, length, vocab)  # two models' logits
    chunk = min(chunk_size, length) if chunk_size > 0 else length

    def one_chunk(args):
        h_c, other_c = args
        return fn(vocabulary_logits(module.token_embedding, h_c),
                  vocabulary_logits(other.token_embedding, other_c))

    if chunk_size > 0:  # one chunk of each model's logits alive at a time
        one_chunk = jax.checkpoint(one_chunk)
    outs = jax.lax.map(one_chunk, (_chunked(h, chunk), _chunked(h_other, chunk)))
    return tuple(_placed(x, length, full_length, positions) for x in outs)


def full_logits(module, token_ids, padding_mask):
    """Reference path: the [batch, length, vocab] logits in one piece (tests, short sequences)."""
    h = hidden_states(module, token_ids, padding_mask)
    return vocabulary_logits(module.token_embedding, h)
