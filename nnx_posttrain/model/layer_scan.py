"""The decoder blocks as one ``jax.lax.scan`` over their stacked weights (``--scan-layers``).

A KerasHub backbone calls its decoder blocks one after the other in Python, inside its functional
graph: a trace of the training step traces every block, and XLA compiles every copy (a
gemma_2b-shaped step: 18 blocks traced twice, then compiled one by one). Where the blocks are
the same layer ``L`` times over, one block is enough: while ``hidden_states`` runs
(``blocks._block_calls``, ``blocks._scanned``), block 0's ``call`` runs the whole stack as
``jax.lax.scan``, whose body is block 0's own call (with every override of the forward pass:
remat, the attention path, packed rows, rotary positions, the projections' gradient, the batch's
sharding) on the weights of block ``i`` (``keras.StatelessScope`` maps block 0's variables to the
``i``-th slice of the stacked weights), and blocks 1 .. L-1 return their input. The weights are
stacked inside the traced step (``jnp.stack``; the gradient of each block's variables flows back
through it): the step holds one more copy of the blocks' weights. The frozen ones are stacked
once a step, before its loop over micro-batches (``blocks.frozen_stacks``, ``given_stacks``);
the trainable ones (LoRA factors, or every weight of a full fine-tune) in each micro-batch.

That is the same computation only where the backbone's graph passes the hidden state straight
from each block to the next with the same other inputs (the padding mask), and where every block
is the same layer: same class and configuration (its name aside), the same sublayers, variables
of the same shapes, dtypes and trainability (``problem`` checks all of it on the graph and the
blocks). Families whose blocks differ (Gemma 2 / 3's alternating sliding window, Gemma 4, SmolLM3's
NoPE layers, Qwen 3.5's recurrent and attention blocks) and mixtures of experts (their router
logits are collected block by block: ``blocks.SINKS``) keep the unrolled loop; a block whose call
assigns a variable (none of the supported families') is refused when traced. The sampler's
KV-cache decoding calls the blocks itself and is not affected.

``set_scan(module, mode)``: ``off``; ``on`` (a ``ConfigError`` naming why not where it cannot);
``auto`` (the default of ``--scan-layers``): on where it can and the stack has at least
``MIN_BLOCKS`` blocks (a short stack traces and compiles fast anyway, and the small models keep
their unrolled programs exactly).
"""

from __future__ import annotations

from nnx_posttrain import errors
from nnx_posttrain.model.blocks import SCAN_ATTRIBUTE, decoder_blocks

MODES = ("auto", "on", "off")
MIN_BLOCKS = 8  # ``auto`` scans stacks of at least this many blocks


def _config(layer) -> dict:
    """``layer.get_config()`` without its name (blocks and sublayers differ by name only)."""
    try:
        config = dict(layer.get_config())
    except Exception:  # noqa: BLE001 - a config that fails (KerasHub's LlamaAttention): its
        config = {k: v for k, v in vars(layer).items()  # plain public attributes
                  if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}
    config.pop("name", None)
    config.pop("path", None)
    return config


def _signature(block) -> tuple:
    """What two blocks must share to be the same layer: class and configuration, their
    sublayers' (with LoRA and quantization as set now), the variables' shapes, dtypes and
    trainability, in order."""
    sublayers = [(type(layer).__name__, _config(layer), getattr(layer, "lora_enabled", None),
                  getattr(layer, "quantization_mode", None), getattr(layer, "lora_alpha", None))
                 for layer in block._flatten_layers(include_self=False)]
    variables = [(v.name, tuple(v.shape), str(v.dtype), bool(v.trainable)) for v in block.weights]
    return type(block), _config(block), sublayers, variables


def _equal(a, b) -> bool:
    """``a == b`` as one bool; False where that is not one (arrays of several values)."""
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _chain_problem(module, blocks) -> str | None:
    """Why ``module``'s graph does not pass its hidden state straight from block to block with
    the same other inputs, or None."""
    import keras

    nodes = []
    for block in blocks:
        own = getattr(block, "_inbound_nodes", None) or []
        if len(own) != 1:
            return f"{block.name} is called {len(own)} times in the backbone's graph"
        nodes.append(own[0])

    def same(a, b) -> bool:
        if isinstance(a, keras.KerasTensor) or isinstance(b, keras.KerasTensor):
            return a is b
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(map(same, a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return type(a) is type(b) and _equal(a, b)

    first = nodes[0].arguments
    if not first.args or not isinstance(first.args[0], keras.KerasTensor):
        return f"{blocks[0].name} does not take the hidden state as its first input"
    for before, node, block in zip(nodes, nodes[1:], blocks[1:]):
        args = node.arguments
        if len(before.outputs) != 1 or not args.args or args.args[0] is not before.outputs[0]:
            return f"{block.name} does not take the previous block's output as its input"
        if not (same(list(args.args[1:]), list(first.args[1:]))
                and same(args.kwargs, first.kwargs)):
            return f"{block.name} takes other inputs than {blocks[0].name}"
    inner = {id(node.outputs[0]): i for i, node in enumerate(nodes[:-1])}
    for operation in module.operations:
        for node in getattr(operation, "_inbound_nodes", None) or []:
            for tensor in node.arguments.keras_tensors:
                i = inner.get(id(tensor))
                if i is not None and operation is not blocks[i + 1]:
                    return f"the output of {blocks[i].name} is read by {operation.name} too"
    if any(id(t) in inner for t in module.outputs):
        return "the backbone outputs a hidden state from inside its stack of blocks"
    return None


def problem(module) -> str | None:
    """Why ``module``'s decoder blocks cannot run as one scan, or None (see the module
    docstring)."""
    from nnx_posttrain import families

    blocks = decoder_blocks(module)
    if len(blocks) < 2:
        return f"{type(module).__name__} has {len(blocks)} decoder block(s)"
    family = families.of(module)
    if family is not None and family.moe is not None and any(map(family.moe.router, blocks)):
        return "a mixture of experts' router logits are collected block by block"
    first = _signature(blocks[0])
    other = next((b for b in blocks[1:] if not _equal(_signature(b), first)), None)
    if other is not None:
        return f"its blocks differ ({blocks[0].name} and {other.name})"
    return _chain_problem(module, blocks)


def scanning(module) -> bool:
    """Whether ``module``'s training forward runs its blocks as one scan (``set_scan``)."""
    return bool(getattr(module, SCAN_ATTRIBUTE, False))


def set_scan(module, mode: str = "auto") -> str:
    """Choose whether ``module``'s training forward runs its decoder blocks as one scan
    (``--scan-layers``) and return a line saying which, and why. ``on`` where the blocks cannot:
    ``ConfigError``. A plain attribute of the module (``nnx.split`` / ``merge`` keep it)."""
    if mode not in MODES:
        raise errors.ConfigError(f"--scan-layers must be one of {', '.join(MODES)}, not {mode!r}")
    n = len(decoder_blocks(module))
    short = mode == "auto" and n < MIN_BLOCKS
    why = None if mode == "off" or short else problem(module)
    if mode == "on" and why:
        raise errors.ConfigError(f"--scan-layers on: the decoder blocks of {type(module).__name__} "
                                 f"cannot run as one scan: {why}; use --scan-layers off or auto")
    if mode == "off":
        on, reason = False, "requested"
    elif short:
        on, reason = False, f"auto: {n} blocks, fewer than {MIN_BLOCKS}"
    elif why:
        on, reason = False, f"auto: {why}"
    else:
        on, reason = True, f"{mode}: {n} identical blocks"
    object.__setattr__(module, SCAN_ATTRIBUTE, on)
    return f"layer scan: {'on' if on else 'off'} ({reason})"
