"""Which variables train: the trainable-variable filter, the NNX split, LoRA and its off switch.

Keras variables are ``nnx.Variable`` subclasses but not ``nnx.Param``: every filter here selects on
``keras.Variable`` with ``v.trainable``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import keras
import numpy as np
from flax import nnx

from nnx_posttrain import errors, families
from nnx_posttrain.model import expert_lora

# Layer names most KerasHub decoder families give their attention projections; a family's own
# (``families``: ``lora["attention"]``, ``lora["mlp"]``) name ``attention`` and ``mlp``.
ATTENTION_LAYERS = ("query", "key", "value", "attention_output")
LORA_TARGETS = {
    "qv": ("query", "value"),  # KerasHub's own default
    "attention": ATTENTION_LAYERS,  # the family's attention projections
    "mlp": (),  # the family's MLP projections (a mixture of experts': its expert kernels too)
    "experts": (),  # a mixture of experts' stacked expert kernels (``model.expert_lora``)
    "all-linear": None,  # every Dense / EinsumDense of the decoder blocks (not the experts)
}


def target_names(module, targets: str) -> tuple[str, ...] | None:
    """The layer names ``targets`` selects in ``module`` (None: every linear layer): 'qv',
    'attention' and 'mlp' as the module's family names its projections (``families``),
    'experts' (a mixture of experts' stacked kernels), 'all-linear', or comma-separated names
    (layers' or expert kernels')."""
    family = families.of(module)
    if targets == "experts":
        names = expert_lora.kernel_names(module)
        if not names:
            raise errors.ConfigError(f"--lora.targets experts: {type(module).__name__} has no "
                                     "stacked experts LoRA can adapt")
        return names
    if targets in ("attention", "mlp") and family is not None:
        if isinstance(family.lora[targets], families.Unsupported):
            raise errors.ConfigError(f"--lora.targets {targets}: {family.lora[targets].reason}")
        return family.lora[targets]
    if targets in LORA_TARGETS:
        return LORA_TARGETS[targets]
    names = [t.strip() for t in targets.split(",") if t.strip()]  # 'experts' among names: theirs
    return tuple(n for t in names for n in (expert_lora.kernel_names(module) if t == "experts"
                                            else (t,)))


def trainable_filter(path, value) -> bool:
    """NNX filter selecting trainable Keras variables.

    Keras variables are ``nnx.Variable`` subclasses but not ``nnx.Param``: filtering on
    ``nnx.Param`` selects nothing and would silently train nothing.
    """
    return isinstance(value, keras.Variable) and value.trainable


def split(module: nnx.Module):
    """(graphdef, trainable state, frozen state); fails loudly if nothing is trainable."""
    graphdef, trainable, frozen = nnx.split(module, trainable_filter, ...)
    if not jax.tree_util.tree_leaves(trainable):
        raise ValueError("the trainable-variable filter selected no variable: nothing would train")
    return graphdef, trainable, frozen


def merge(graphdef, params, frozen: dict):
    """(module, reference) from the trainable ``params`` and ``frozen`` = {"model": the frozen
    variables of ``split``, "reference": a frozen copy of the trainable ones, or None, and
    optionally "partner": the state of another frozen model an algorithm reads (distillation's
    teacher)}: the layout of the training state that every step and rollout reads. The
    reference is the reference module, else the partner's state as it is (the algorithm merges
    it with its own graphdef), else None."""
    module = nnx.merge(graphdef, params, frozen["model"])
    if frozen.get("partner") is not None:
        return module, frozen["partner"]
    ref = frozen.get("reference")
    return module, (None if ref is None else nnx.merge(graphdef, ref, frozen["model"]))


def named_variables(state) -> dict[str, jax.Array]:
    """{Keras variable path (e.g. 'decoder_block_0/attention/query/kernel'): array} of a state.
    A plain array in the state (a constant such as Gemma 3's vision embedding's position ids) is
    no variable and has no path: left out."""
    return {v.path: v.value for _, v in nnx.to_flat_state(state) if hasattr(v, "path")}


def count_params(state) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(state))


# ----------------------------------------------------------------------------- LoRA


def split_targets(targets: str) -> tuple[str, tuple[str, ...]]:
    """(the language model's targets, the vision groups) of ``--lora.targets``: the items of a
    comma-separated list that name ``vision_tower.VISION_LORA`` groups ('projector',
    'vision-attention'), and the rest (``target_names``; '' when only vision groups are given)."""
    from nnx_posttrain.model.vision_tower import VISION_LORA

    items = [t.strip() for t in targets.split(",") if t.strip()]
    return (",".join(t for t in items if t not in VISION_LORA),
            tuple(t for t in items if t in VISION_LORA))


def _language_layers(module, names) -> list:
    """The language model's Dense / EinsumDense layers that ``names`` select (None: every one but
    the routers); a vision tower's never (``--lora.targets projector`` etc. name those)."""
    routers = _routers(module) if names is None else set()
    tower = getattr(module, "vision_encoder", None)
    skip = {id(t) for t in tower._flatten_layers()} if tower is not None else set()
    return [layer for layer in module._flatten_layers(include_self=False)
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
            and id(layer) not in skip and id(layer) not in routers
            and (names is None or layer.name in names)]


def enable_lora(module, rank: int, alpha: float | None = None, targets: str = "attention",
                seed: int = 0, factor_dtype: str | None = None) -> list[str]:
    """Freeze every weight and add LoRA factors (scale alpha / rank) to the target layers.

    ``targets``: 'qv' (KerasHub's default), 'attention' (q, k, v, o), 'mlp' (the MLP's
    projections; a mixture of experts': its stacked expert kernels too), 'experts' (those
    alone: per-expert factors, ``model.expert_lora``), 'all-linear' (every Dense or EinsumDense
    of the decoder blocks), or comma-separated layer or expert kernel names (``target_names``);
    none of these names a layer of a vision encoder (``vision_tower.freeze_tower``). A vision model's encoder is adapted only where the
    comma-separated list names its groups (``vision_tower.VISION_LORA``): 'projector' (its projection
    into the language model), 'vision-attention' (the tower's attention projections), with the
    language model's targets or alone (e.g. 'attention,projector', 'projector'). The A factors
    are He-uniform from ``seed`` (each layer its own stream; Keras' default would draw from
    Python's global random state), the B factors zero. ``factor_dtype`` 'float32' on a layer with
    16-bit weights gives its factors float32 master weights (the layer's policy becomes mixed:
    the frozen kernel keeps its dtype, compute stays in 16 bits). Returns the paths of the
    adapted layers; raises if none matched.
    """
    from nnx_posttrain.model import vision_tower

    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    language, groups = split_targets(targets)
    names = target_names(module, language) if language else ()
    chosen = _language_layers(module, names) if language else []
    chosen += vision_tower.lora_layers(module, groups) if groups else []
    for layer in module._flatten_layers(include_self=False):
        layer.trainable = False
    for index, layer in enumerate(chosen):
        layer.trainable = True
        if factor_dtype == "float32" and layer.variable_dtype != "float32":
            mixed, mode = f"mixed_{layer.compute_dtype}", layer.dtype_policy.quantization_mode
            layer.dtype_policy = (keras.dtype_policies.QuantizedDTypePolicy(mode, mixed) if mode
                                  else keras.DTypePolicy(mixed))
        layer_seed = int(np.random.SeedSequence([seed, index]).generate_state(1)[0] >> 1)
        layer.enable_lora(rank, lora_alpha=alpha,
                          a_initializer=keras.initializers.HeUniform(seed=layer_seed))
    adapted = [layer.path for layer in chosen]
    for layer in expert_lora.expert_layers(module) if names else ():
        stream = int(np.random.SeedSequence([seed, len(adapted)]).generate_state(1)[0] >> 1)
        adapted += expert_lora.enable(layer, names, rank, alpha, stream, factor_dtype)
    if not adapted:
        raise ValueError(
            f"LoRA targets {targets!r} matched no Dense/EinsumDense layer of {type(module).__name__}"
        )
    return adapted


def _routers(module) -> set[int]:
    """The ids of a mixture-of-experts backbone's router layers (its family's ``MoE.router``)."""
    from nnx_posttrain.model.blocks import decoder_blocks

    family = families.of(module)
    if family is None or family.moe is None:
        return set()
    return {id(r) for r in (family.moe.router(b) for b in decoder_blocks(module)) if r is not None}


def lora_delta(layer):
    """(alpha / rank) * A @ B in float32, shaped like the layer's kernel. EinsumDense kernels may
    be 3-D: A is kernel_shape[:-1] + (rank,), B is (rank, kernel_shape[-1]), and matmul contracts
    the last axis of A with B, exactly as Keras's ``kernel`` property does."""
    a = jnp.asarray(layer.lora_kernel_a.value, jnp.float32)
    b = jnp.asarray(layer.lora_kernel_b.value, jnp.float32)
    return (layer.lora_alpha / layer.lora_rank) * jnp.matmul(a, b)


@contextlib.contextmanager
def lora_disabled(module):
    """Within the block, LoRA layers compute with their base kernel only: the reference model of
    preference and RL methods, with no second copy of the weights."""
    layers = [l for l in module._flatten_layers(include_self=False) if getattr(l, "lora_enabled", False)]
    if not layers:
        raise ValueError("lora_disabled: the model has no LoRA layer (use a 'copy' reference)")
    for layer in layers:
        object.__setattr__(layer, "lora_enabled", False)
    try:
        yield
    finally:
        for layer in layers:
            object.__setattr__(layer, "lora_enabled", True)


def has_lora(module) -> bool:
    return any(getattr(l, "lora_enabled", False) for l in module._flatten_layers(include_self=False))
