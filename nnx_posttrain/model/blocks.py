"""Changing what every decoder block of a KerasHub backbone does, for the duration of a call.

KerasHub backbones expose no hook for a custom attention mask or for rematerialisation, so these
shadow a method of each decoder block *instance* (``object.__setattr__``, bypassing Keras'
attribute tracking) and remove the shadow afterwards; the class is never touched. One helper,
``shadowed``, does the patching for its users, through ``override_blocks`` for the blocks: the
packed-row attention mask (``hidden_states``), remat (``set_remat``), the attention path
(``attention.overridden``: the training forward's kernels and the sampler's KV-cache decoding),
the recurrent layers' delta rule (``recurrent_calls``); directly for the blocks' projections
(``dense.overridden``). Where ``model.layer_scan`` allows it, block 0's ``call`` runs every
block as one ``jax.lax.scan`` over their stacked weights and the others return their input
(``_scanned``): the shadows of block 0 and its sublayers then apply to every block.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp


def backbone_inputs(module, token_ids, padding_mask) -> dict:
    """The backbone's inputs for ``token_ids`` / ``padding_mask`` [batch, T]: with the positions
    0 .. T - 1 where the backbone takes them (Gemma 4's ``position_ids``; rotary attention depends
    on relative positions only, as in the backbones that count them themselves)."""
    inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
    if "position_ids" in {getattr(x, "name", None) for x in getattr(module, "inputs", None) or ()}:
        t = token_ids.shape[1]
        inputs = {k: jnp.asarray(v) for k, v in inputs.items()}  # Keras takes no mix of kinds
        inputs["position_ids"] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), token_ids.shape)
    return inputs


def decoder_blocks(module) -> list:
    """The decoder blocks that the backbone's functional graph calls. ``module.transformer_layers``
    is not it after ``nnx.merge``: that list still holds the blocks of the module that was split,
    while the merged graph calls new block objects (those in ``module.layers``)."""
    kind = type(module.transformer_layers[0])
    return [layer for layer in module.layers if isinstance(layer, kind)]


@contextlib.contextmanager
def shadowed(targets: list, name: str, make: Callable[[Any, Any], Any]) -> Iterator[list]:
    """Within the block, attribute ``name`` of every object in ``targets`` is
    ``make(target, original)`` (``original``: what ``getattr(target, name)`` gave before, e.g. a
    bound method), set on the instances and, on exit (also on error), put back as it was: removed,
    or an enclosing shadow of the same attribute restored (shadows nest). Yields ``targets``."""
    patched = []
    missing = object()
    try:
        for target in targets:
            before = vars(target).get(name, missing)
            object.__setattr__(target, name, make(target, getattr(target, name)))
            patched.append((target, before))
        yield targets
    finally:
        for target, before in reversed(patched):
            if before is missing:
                object.__delattr__(target, name)
            else:
                object.__setattr__(target, name, before)


@contextlib.contextmanager
def override_blocks(module, name: str, make: Callable[[Any, Any], Any], *,
                    part: Callable[[Any], Any] | None = None) -> Iterator[list]:
    """Within the block, every decoder block's attribute ``name`` (a method, e.g. ``call``) is
    ``make(block, original)``, where ``original`` is what ``getattr(block, name)`` gave before
    (a bound method). The override is set on the instances and removed on exit, also on error.
    Yields the blocks (``decoder_blocks(module)``). With ``part`` (block -> one of its sublayers,
    e.g. its attention layer), the attribute of ``part(block)`` is overridden instead, and
    ``make`` receives that sublayer; a block without one (``part`` gives None: Qwen 3.5's
    recurrent blocks have no attention layer) is left as it is."""
    blocks = decoder_blocks(module)
    targets = blocks if part is None else [p for p in map(part, blocks) if p is not None]
    with shadowed(targets, name, make):
        yield blocks


def recurrent_calls(module):
    """While active, every recurrent layer of ``module``'s blocks (Qwen 3.5's Gated DeltaNet)
    whose family has its own ``recurrent_call`` is called through it (``Family.recurrent_call``:
    KerasHub's code with its delta rule as a scan)."""
    from nnx_posttrain import families

    family = families.of(module)
    own = family.recurrent_call if family is not None else None
    if own is None:
        return contextlib.nullcontext()
    return override_blocks(module, "call", lambda layer, original: functools.partial(
        own, layer, original), part=families.recurrent_layer)


# ----------------------------------------------------------------------------- packed rows


# The method each KerasHub decoder block uses to build its [batch, query, key] attention mask:
# Gemma / Gemma 3 blocks, and Llama / Llama 3 / Mistral / Qwen / Qwen 3 decoders.
_MASK_METHODS = ("_compute_attention_mask", "_compute_self_attention_mask")


def mask_method(block) -> str | None:
    """The name of ``block``'s attention-mask method (``_MASK_METHODS``), or None."""
    return next((n for n in _MASK_METHODS if hasattr(type(block), n)), None)


def segment_attention_mask(segment_ids):
    """[batch, T, T] causal mask that never crosses examples of a packed row, nor the branches of
    a shared-prefix row (``flash.allowed``; segment 0 = padding; a padding query sees itself only,
    so no softmax row is empty)."""
    from nnx_posttrain.model.flash import allowed

    seg = segment_ids
    t = seg.shape[1]
    pos = jnp.arange(t)
    ok = allowed(seg, seg, pos, pos, None) & (seg[:, None, :] != 0)
    return (ok | jnp.eye(t, dtype=bool)[None]).astype(jnp.int32)


# ----------------------------------------------------------------------------- rotary positions


def rope_layers(module) -> list:
    """The rotary-embedding layers of every decoder block (any KerasHub family)."""
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    out = []
    for block in decoder_blocks(module):
        out += [layer for layer in block._flatten_layers(include_self=False)
                if isinstance(layer, RotaryEmbedding)]
    return out


def takes_positions(module) -> bool:
    """Whether every rotary layer of ``module`` accepts per-token ``positions`` (KerasHub's
    ``RotaryEmbedding.call(inputs, start_index, positions)``) and there is at least one."""
    import inspect

    layers = rope_layers(module)
    return bool(layers) and all("positions" in inspect.signature(layer.call).parameters
                                for layer in layers)


@contextlib.contextmanager
def rope_positions(module, positions):
    """While active, every rotary layer of ``module`` rotates at ``positions`` [batch, T] (the
    position of each token within its example) instead of ``0 .. T - 1``."""
    def make(layer, original):
        return lambda inputs, start_index=0, positions=None: original(inputs, positions=pos)

    pos = positions
    with shadowed(rope_layers(module), "call", make):
        yield


def _attention_mask_override(module, mask):
    """Make every decoder block's attention mask its own (causal, padding, and the sliding window
    where the block builds it: Mistral, Gemma 4) restricted to ``mask`` (the block-diagonal mask
    of packed rows, ``segment_attention_mask``).

    KerasHub backbones accept only a [batch, T] padding mask; packed rows need a block-diagonal
    one. The blocks' mask method is shadowed on the instances for the duration of the call."""
    blocks = decoder_blocks(module)  # not module.transformer_layers: see decoder_blocks
    name = mask_method(blocks[0])
    if name is None:
        raise NotImplementedError(f"packed sequences are not supported for {type(module).__name__}")

    def make(block, original):
        def masked(*args, **kwargs):
            own = original(*args, **kwargs)
            if own is None:
                return mask
            both = jnp.logical_and(jnp.asarray(own).astype(bool), mask.astype(bool))
            return both.astype(jnp.asarray(own).dtype)
        return masked

    return override_blocks(module, name, make)


# ----------------------------------------------------------------------------- remat


def set_remat(module, enabled: bool, lazy_frozen: bool = False) -> None:
    """Rematerialise each decoder block of the backbone ``module`` (``--remat blocks``): the
    backward pass recomputes a block's activations from its input instead of keeping them, so
    activation memory holds one block's internals rather than all of them. ``lazy_frozen``
    (bfloat16 weights on CPU) recomputes the blocks too, reading their frozen weights lazily in
    each pass (``model.frozen``). A plain attribute, kept by ``nnx.split`` / ``nnx.merge``;
    ``hidden_states`` applies it."""
    object.__setattr__(module, "_nnx_posttrain_remat",
                       "lazy_frozen" if lazy_frozen else bool(enabled))


# Lists that collect arrays computed inside a block's call (``model.router``'s router logits):
# a block under ``jax.checkpoint`` returns what it added to them as outputs, so that they are
# arrays of the enclosing computation, not of the checkpointed one.
SINKS: list[list] = []


def _checkpointed(call):
    """``call`` under ``jax.checkpoint``. Only array arguments are traced; the others (flags,
    None) stay static. What the call adds to ``SINKS`` comes out of the checkpoint."""
    def wrapper(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

        def inner(*arrays):
            full = list(leaves)
            for i, x in zip(where, arrays):
                full[i] = x
            args, kwargs = jax.tree.unflatten(treedef, full)
            marks = [len(sink) for sink in SINKS]
            out = call(*args, **kwargs)
            added = [sink[m:] for sink, m in zip(SINKS, marks)]
            for sink, m in zip(SINKS, marks):
                del sink[m:]
            return out, added

        out, added = jax.checkpoint(inner)(*(leaves[i] for i in where))
        for sink, new in zip(SINKS, added):
            sink.extend(new)
        return out
    return wrapper


def _rows_sharded(call):
    """``call`` with the block's input and output rows laid out over the mesh's batch axes
    (``sharding.constrain_batch``)."""
    from nnx_posttrain.sharding import constrain_batch

    def wrapper(x, *args, **kwargs):
        out = call(constrain_batch(x), *args, **kwargs)
        if isinstance(out, tuple):
            return (constrain_batch(out[0]), *out[1:])
        return constrain_batch(out)

    return wrapper


def _block_calls(module):
    """While active, each decoder block's ``call`` keeps its rows over the mesh's batch axes
    (``_rows_sharded``) and runs under ``jax.checkpoint`` (when enabled by ``set_remat``). Only
    array arguments are traced; the others (flags, None) stay static. Where the blocks run as
    one scan (``layer_scan.set_scan``), that is the scan's body, on each block's weights."""
    mode = getattr(module, "_nnx_posttrain_remat", False)
    if mode == "lazy_frozen":
        from nnx_posttrain.model.frozen import lazy_frozen_call as inner
    elif mode:
        inner = lambda block, call: _checkpointed(call)  # noqa: E731
    else:
        inner = lambda block, call: call  # noqa: E731
    wrap = lambda block, call: _rows_sharded(inner(block, call))  # noqa: E731
    if getattr(module, SCAN_ATTRIBUTE, False):  # one block traced, run over every block's weights
        return override_blocks(module, "call", _scanned(decoder_blocks(module), wrap))
    return override_blocks(module, "call", wrap)


# ----------------------------------------------------------------------------- layer scan


# Set by ``layer_scan.set_scan``: the blocks of the training forward run as one scan
SCAN_ATTRIBUTE = "_nnx_posttrain_scan"


def _stored(variables) -> list:
    """The variables' values as stored (in the current stateless scope, if any), not cast to a
    layer's compute dtype (a block's call runs under its autocast scope)."""
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope(None):
        return [jnp.asarray(v.value) for v in variables]


# The frozen columns of the scanned stacks, stacked once a step before the training step's loop
# over micro-batches (``given_stacks``): {id(block 0's value of a column): the column stacked}
_GIVEN: list[dict] = []


def frozen_stacks(modules, frozen) -> dict:
    """The columns of every scanned stack of ``modules`` (merged from the training state: a
    backbone, or a head over ``.backbone``; a partner's state is left out) whose
    values are all leaves of ``frozen``, stacked over the blocks: {id(block 0's value): the
    stacked column}. The training step stacks them once, before its loop over micro-batches,
    and hands them to each micro-batch's forward (``given_stacks``), instead of a new copy of
    the blocks' frozen weights stacked in each micro-batch (the loop's barrier keeps what the
    weights give in each iteration). The policy and a reference merged from the same frozen
    state share them. {} where nothing is scanned."""
    frozen_ids = {id(x) for x in jax.tree.leaves(frozen)}
    backbones = [b for m in modules for b in (m, getattr(m, "backbone", None))  # a head's
                 if getattr(b, SCAN_ATTRIBUTE, False) is True]
    out = {}
    for backbone in backbones:
        for column in zip(*(_stored(b.weights) for b in decoder_blocks(backbone))):
            if all(id(v) in frozen_ids for v in column):
                out[id(column[0])] = jnp.stack(column)
    return out


@contextlib.contextmanager
def given_stacks(stacks: dict) -> Iterator[None]:
    """Within the block, a scanned stack's forward takes the columns ``stacks`` holds
    (``frozen_stacks``, keyed by block 0's value as this trace sees it) instead of stacking
    them."""
    _GIVEN.append(stacks)
    try:
        yield
    finally:
        _GIVEN.pop()


def _scanned(blocks: list, wrap: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``make(block, original)`` for ``override_blocks(module, "call", make)``: block 0's call
    runs every block of ``blocks`` as one ``jax.lax.scan`` over their stacked weights, whose
    body is ``wrap(block 0, its original call)`` with block 0's variables read as block ``i``'s
    (``keras.StatelessScope``); the other blocks' calls return their input. ``model.layer_scan``
    says where that is the same computation as the blocks one after the other."""
    import keras

    def make(block, original):
        if block is not blocks[0]:
            return lambda x, *args, **kwargs: x
        one = wrap(block, original)
        variables = list(block.weights)

        def call(x, *args, **kwargs):
            def body(h, values):
                with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
                    given = [scope.get_current_value(v) for v in variables]
                    out = one(h, *args, **kwargs)
                if any(scope.get_current_value(v) is not g for v, g in zip(variables, given)):
                    raise NotImplementedError(f"{block.name} assigns a variable in its call: "
                                              "its blocks cannot run as one scan")
                return out, None

            given = _GIVEN[-1] if _GIVEN else {}
            stacked = [given[id(column[0])] if id(column[0]) in given else jnp.stack(column)
                       for column in zip(*(_stored(b.weights) for b in blocks))]
            return jax.lax.scan(body, x, stacked)[0]

        return call

    return make
