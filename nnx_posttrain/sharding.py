"""Sharding is a rule: (Keras variable path, shape, mesh) -> PartitionSpec; and the mesh itself.

The mesh has three axes, sized by ``--mesh.data / --mesh.fsdp / --mesh.tensor``, and a fourth,
``expert``, when ``--mesh.expert`` is more than 1 (a mesh without it is exactly the three-axis one):

- ``data``: pure data parallelism — the batch is split, every weight is replicated;
- ``fsdp``: the batch is split *and* every weight is sharded along its model dimension (ZeRO-3:
  XLA gathers a weight just before it is used); optimizer state and gradients follow the weights;
- ``tensor``: Megatron-style tensor parallelism — attention heads, the MLP's intermediate
  dimension and the vocabulary are split; the batch is replicated over it;
- ``expert``: expert parallelism for mixtures of experts — the stacked experts' leading
  dimension is split (each device holds, and computes for its rows, its share of the experts of
  every MoE layer), and the batch is split over it *as over data*: the axis is data parallelism
  for everything but the experts (their weights replicated on it, like ``data``), so no device
  repeats another's attention. It is a batch axis because KerasHub computes every expert for
  every token (no dispatch): a device's tokens meet the other devices' experts through XLA's
  collectives over the axis, and the rule ``(expert, fsdp, tensor)`` of an expert kernel
  composes with the other axes. ``--mesh.expert`` must divide the expert count
  (``check_experts``: a model without experts refuses it).

Each model family declares its rules (``families``): Gemma 1/2/3 (``decoder_block_i/attention/...``,
q/k/v kernels laid out [heads, hidden, head_dim]), Llama 3 / Mistral / Qwen 2 / 2.5 / 3
(``transformer_layer_i/self_attention/...``, q/k/v kernels [hidden, heads, head_dim]), ... Each rule
names a *logical* axis per dimension (``fsdp``, ``tensor``, ``expert``: the mesh axis of that
name); a dimension that does not divide by its mesh axis (gemma_2b has one key/value head) is
replicated on that axis instead of failing — see ``spec_for``. LoRA
factors follow their base kernel (A: the kernel's input dimensions, B: its output dimension);
norms, biases of the output projections, scalars and anything unknown of rank < 2 are replicated.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nnx_posttrain import config as config_lib, errors, families

AXES = ("data", "fsdp", "tensor")  # the mesh's axes; --mesh.expert > 1 adds "expert" before tensor
BATCH_AXES = ("data", "fsdp", "expert")  # the batch dimension is split over those the mesh has
F, T = "fsdp", "tensor"

# (regular expression searched in the Keras path, logical axis of each dimension). First match
# wins: the embeddings, every family's own rules (``families``: anchored on their path names, so
# no family's rule matches another's variables, which tests/test_families.py checks), the heads.
COMMON_RULES: list[tuple[str, tuple]] = [
    # token embedding [vocab, hidden]; an untied output embedding [hidden, vocab]
    (r"token_embedding/embeddings$", (T, F)),
    (r"token_embedding/reverse_embeddings$", (F, T)),
]
HEAD_RULES: list[tuple[str, tuple]] = [
    # scalar heads of reward / value models [hidden, 1]
    (r"(reward_head|value_head)/kernel$", (F, None)),
]
RULES: list[tuple[str, tuple]] = COMMON_RULES + list(dict.fromkeys(
    rule for family in families.FAMILIES.values() for rule in family.sharding)) + HEAD_RULES
_COMPILED = [(re.compile(pattern), axes) for pattern, axes in RULES]


def _sizes(mesh) -> dict[str, int]:
    """Axis sizes of a ``Mesh``, an ``AbstractMesh`` or a plain {axis: size} dict."""
    return dict(getattr(mesh, "shape", mesh))


def logical_axes(path: str, ndim: int) -> tuple:
    """The logical axis (``fsdp``, ``tensor``, ``expert`` or None) of each dimension of variable
    ``path``."""
    if path.endswith(("/lora_kernel_a", "/lora_kernel_b")):
        base, which = path.rsplit("/", 1)
        kernel = _match(base + "/kernel")
        if kernel is None:
            return _generic(ndim)
        if which == "lora_kernel_a":  # the kernel's input dimensions, then the rank
            return (*kernel[: ndim - 1], None) if len(kernel) == ndim else _generic(ndim)
        return (None, kernel[-1]) if ndim == 2 else _generic(ndim)  # rank, then the output dim
    expert = _EXPERT_FACTOR.search(path)
    if expert is not None and ndim == 3:  # per-expert LoRA factors of a stacked kernel
        kernel = _match(path[:expert.start()] + "/" + expert.group(1))
        if kernel is None or len(kernel) != 3:
            return _generic(ndim)
        # A [E, in, rank]: the kernel's expert and input axes; B [E, rank, out]: expert, output
        return (kernel[0], kernel[1], None) if expert.group(2) == "a" else \
            (kernel[0], None, kernel[2])
    axes = _match(path)
    if axes is None or len(axes) != ndim:
        return _generic(ndim)
    return axes


_EXPERT_FACTOR = re.compile(r"/lora_(\w+)_(a|b)$")


def _match(path):
    for pattern, axes in _COMPILED:
        if pattern.search(path):
            return axes
    return None


def _generic(ndim):
    """Unknown variables: replicated below rank 2 (norms, biases, scalars), else the first
    dimension over fsdp."""
    return (None,) * ndim if ndim < 2 else (F,) + (None,) * (ndim - 1)


def spec_for(path: str, shape, mesh) -> P:
    """PartitionSpec of variable ``path`` with ``shape`` on ``mesh``.

    An axis of size 1 is dropped, and a dimension that its axis does not divide falls back to
    replication on that axis (so a single key/value head stays whole under tensor parallelism)."""
    sizes = _sizes(mesh)
    out = []
    for dim, axis in zip(shape, logical_axes(path, len(shape))):
        size = sizes.get(axis, 1) if axis else 1
        out.append(axis if size > 1 and dim % size == 0 else None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


# ----------------------------------------------------------------------------- trees of variables


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def tree_specs(tree, mesh):
    """A tree like ``tree`` with a PartitionSpec for every array: the rule's spec for every
    variable (parameters, their optimizer moments — optax mirrors the parameters' variables, Keras
    paths included — and frozen variables), replicated for everything else (step, RNG, counts)."""

    def one(x):
        if _is_variable(x):
            spec = spec_for(x.path, tuple(x.value.shape), mesh)
            return jax.tree.map(lambda _: spec, x)
        return P()

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def tree_shardings(tree, mesh: Mesh):
    """NamedShardings of every array of ``tree`` on ``mesh`` (see ``tree_specs``)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def put(tree, shardings):
    """Place host or single-device arrays onto (possibly multi-process) ``shardings``. Every
    process holds the same full values and contributes the shards of its own devices."""

    def one(x, sharding):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def batch_axes(mesh) -> tuple[str, ...]:
    """The batch axes (``BATCH_AXES``) ``mesh`` has: data, fsdp, and expert where it has one."""
    sizes = _sizes(mesh)
    return tuple(a for a in BATCH_AXES if a in sizes)


def batch_flags(mesh) -> str:
    """The options that size the batch shards of ``mesh``, for messages."""
    return " x ".join(f"--mesh.{a}" for a in batch_axes(mesh))


def batch_spec(ndim: int, mesh, leading: int = 0) -> P:
    """Spec of a batch array on ``mesh``: dimension ``leading`` (the examples) over its batch
    axes (``batch_axes``)."""
    return P(*([None] * leading), batch_axes(mesh), *([None] * (ndim - leading - 1)))


def context_row_axes(rows: int) -> tuple[str, ...] | None:
    """The batch axes of the mesh in context (``jax.set_mesh``: the run's) that ``rows`` split
    over: those of more than one device, or None without a mesh of several devices, or where
    ``rows`` do not divide over them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    return axes if axes and rows % math.prod(sizes[a] for a in axes) == 0 else None


def constrain_batch(x):
    """``x`` [rows, ...] with its rows laid out over the batch axes of the mesh in context
    (``context_row_axes``), so that XLA partitions a block's computation by rows and gathers
    FSDP-sharded weights, rather than splitting the weights' hidden dimension and holding every
    row's activations on every device (what its sharding propagation picks on its own for a
    batch of one row per device). Unchanged where there are no such axes."""
    axes = context_row_axes(x.shape[0]) if getattr(x, "ndim", 0) else None
    if axes is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(axes, *[None] * (x.ndim - 1)))


def batch_divisor(mesh) -> int:
    """How many ways the batch dimension is split (data x fsdp x expert)."""
    sizes = _sizes(mesh)
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


# ----------------------------------------------------------------------------- memory


def shard_shape(shape, spec: P, mesh) -> tuple:
    sizes = _sizes(mesh)
    out = []
    for i, dim in enumerate(shape):
        axes = spec[i] if i < len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        out.append(-(-dim // math.prod(sizes[a] for a in axes)))
    return tuple(out)


def per_device_bytes(tree, mesh, itemsize: int | None = None) -> int:
    """Bytes of ``tree``'s arrays held by one device (the largest share) under the rules, computed
    from shapes alone (works for ``jax.ShapeDtypeStruct`` leaves and for meshes of any size).
    ``itemsize`` overrides the leaves' dtypes (e.g. 4 for float32 optimizer moments)."""
    total = 0
    specs = jax.tree.leaves(tree_specs(tree, mesh), is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(jax.tree.leaves(tree), specs):
        size = itemsize or np.dtype(leaf.dtype).itemsize
        total += math.prod(shard_shape(leaf.shape, spec, mesh)) * size
    return total


def device_bytes(tree) -> dict:
    """Bytes of ``tree``'s arrays actually resident on each addressable device: {device id: bytes}."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def describe(tree, mesh) -> dict[str, str]:
    """{Keras path: 'shape -> spec'} of every variable of ``tree`` (for reports and debugging)."""
    out = {}
    for _, v in nnx.to_flat_state(tree):
        out[v.path] = f"{tuple(v.value.shape)} -> {spec_for(v.path, tuple(v.value.shape), mesh)}"
    return out


# ----------------------------------------------------------------------------- the mesh


def mesh_shape(cfg: config_lib.MeshConfig, n_devices: int) -> dict[str, int]:
    """{data, fsdp, tensor} sizes for ``n_devices`` (with ``expert`` before tensor when
    ``--mesh.expert`` is more than 1), the -1 axis taking the rest; ``ConfigError`` with the
    reason, naming the options, when they do not multiply to the device count."""
    sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "expert": cfg.expert, "tensor": cfg.tensor}
    if sizes["expert"] == 1:
        del sizes["expert"]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if n_devices % fixed:
            raise errors.ConfigError(
                f"mesh {sizes}: {n_devices} device(s) do not divide by the fixed axes' "
                f"product {fixed} ({' x '.join(f'--mesh.{k}' for k in sizes if k not in rest)})")
        sizes[rest[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise errors.ConfigError(
            f"mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())} = "
            f"{math.prod(sizes.values())} devices, but {n_devices} are available "
            f"({jax.process_count()} process(es)); the product must equal the device count "
            f"(set one axis to -1 to take the rest: {' / '.join(f'--mesh.{k}' for k in sizes)})"
        )
    return sizes


def make_mesh(cfg: config_lib.MeshConfig, devices: list | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over ``devices`` (default: every device of every process),
    (data, fsdp, expert, tensor) with ``--mesh.expert`` > 1. Tensor-parallel neighbours are
    adjacent devices (same host / fast links), then expert, then fsdp, then data."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(cfg, len(devices))
    shape = tuple(sizes.values())
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # noqa: BLE001 - CPU / odd topologies: the plain order is fine
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, tuple(sizes))


def expert_count(backbone) -> int:
    """How many experts each mixture-of-experts layer of ``backbone`` has (its family's
    ``MoE.experts``); 0 for a model without experts."""
    family = families.of(backbone)
    if family is None or family.moe is None:
        return 0
    return family.moe.experts(backbone)


def check_experts(expert: int, backbone, model: str) -> None:
    """``ConfigError`` when ``--mesh.expert`` (``expert``) cannot split ``backbone``'s experts:
    a model without experts, or an expert count it does not divide (the message lists the
    values that do). ``model``: the model's name, for the message."""
    if expert == 1:
        return
    count = expert_count(backbone)
    if count == 0:
        raise errors.ConfigError(
            f"--mesh.expert {expert}: model {model} ({type(backbone).__name__}) has no experts; "
            "the expert axis splits a mixture of experts' experts (leave --mesh.expert at 1)")
    if count % expert:
        valid = ", ".join(str(k) for k in range(1, count + 1) if count % k == 0)
        raise errors.ConfigError(
            f"--mesh.expert {expert}: model {model} has {count} experts per MoE layer, which do "
            f"not divide over {expert} devices; valid values: {valid}")
