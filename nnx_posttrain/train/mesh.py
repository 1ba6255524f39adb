"""The device mesh, multi-process start-up, and batches laid out on the mesh; the same mesh
over devices a run compiles for without running (``abstract_mesh``, ``place_abstract``)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nnx_posttrain import config as config_lib, errors
from nnx_posttrain import sharding
from nnx_posttrain.sharding import make_mesh, mesh_shape  # noqa: F401  (the loop builds it)


def cpu_devices_for(cfg: config_lib.Config, cores: int | None = None) -> tuple[int, str | None]:
    """``--mesh.cpu-devices`` as a count, and for ``auto`` the reason for it. ``auto``: one device
    per core this process may use, the most that divides the micro-batch, where that was measured
    to pay: a built-in tiny model (``model.TINY``) on the default mesh (``--mesh.data -1``, fsdp and
    tensor 1) in a single process; 1 for any other model (the medium benchmark: no faster, and
    every device holds a replica of the weights and AdamW state) or mesh."""
    from nnx_posttrain import model

    n = cfg.mesh.cpu_devices
    if n != "auto":
        return n, None
    m = cfg.mesh
    if cfg.model not in model.TINY:
        return 1, f"1 cpu device (auto: {cfg.model} is not a built-in tiny model)"
    if (m.data, m.fsdp, m.expert, m.tensor) != (-1, 1, 1, 1) or _distributed(m)[0]:
        return 1, "1 cpu device (auto: the mesh is set by hand or spans several processes)"
    cores = cores or len(os.sched_getaffinity(0))
    micro = cfg.batching.batch_size // cfg.batching.grad_accum
    n = max(k for k in range(1, cores + 1) if micro % k == 0)
    return n, (f"{n} cpu device{'s' * (n != 1)} (auto: {cores} core{'s' * (cores != 1)}, "
               f"micro-batch {micro})")


def split_host_cpu(n: int, option: int | str | None = None) -> int:
    """JAX's CPU backend as ``n`` devices (``jax_num_cpu_devices``), so that the mesh's data axis
    splits each batch over the cores. Must run before JAX starts its backends; in a process where
    it already has (a notebook, a test), the CPU device count must already be ``n``, else
    ``ConfigError`` naming the option (``--mesh.cpu-devices n``, or ``option``'s value) and the fix;
    with ``option`` "auto", the count it has is taken instead. Returns the CPU device count."""
    if n == 1 and option != "auto":
        return n
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # JAX's backends are up: the count is fixed for this process
        have = len(jax.devices("cpu"))
        if option == "auto":
            return have
        if have != n:
            raise errors.ConfigError(
                f"--mesh.cpu-devices {n}: this process already started JAX with {have} CPU "
                f"device{'s' * (have != 1)}; set it before any JAX operation (e.g. run the "
                f"experiment as a command, or call jax.config.update('jax_num_cpu_devices', {n}) "
                f"right after importing jax)") from None
    return n


def initialize_distributed(cfg: config_lib.MeshConfig) -> bool:
    """``jax.distributed.initialize`` when configured (``--mesh.distributed``, the coordinator /
    process options, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID). Must run
    before anything else touches JAX's devices. Returns whether this is a multi-process run."""
    wanted, address, num, pid = _distributed(cfg)
    if not wanted or jax.distributed.is_initialized():
        return jax.distributed.is_initialized()
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
    return True


def _distributed(cfg: config_lib.MeshConfig):
    """(whether the run is multi-process, coordinator address, process count, process id), from
    the options or JAX's environment variables."""
    env = os.environ
    address = cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    num = cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    wanted = cfg.distributed == "on" or (
        cfg.distributed == "auto" and (address is not None or (num or 1) > 1))
    return wanted, address, num, pid


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def check_micro_batch(cfg: config_lib.Config, mesh: Mesh) -> None:
    b = cfg.batching
    shards = sharding.batch_divisor(mesh)
    if (b.batch_size // b.grad_accum) % shards:
        split_cpu = mesh.devices.flat[0].platform == "cpu" and cfg.mesh.cpu_devices != 1
        where = (f"--mesh.cpu-devices {cfg.mesh.cpu_devices}" if split_cpu
                 else sharding.batch_flags(mesh))
        raise errors.ConfigError(
            f"micro-batch {b.batch_size // b.grad_accum} (--batching.batch-size "
            f"{b.batch_size} / --batching.grad-accum {b.grad_accum}) does not divide over the "
            f"{shards} batch shards ({where}); choose a batch size whose micro-batch they divide"
        )


def check_batch_rows(name: str, rows: int, mesh: Mesh) -> None:
    """``ConfigError`` when the ``rows`` of a micro-batch array ``name`` do not split over the
    mesh's batch shards (an algorithm whose rows are not the examples: online DPO's pairs)."""
    shards = sharding.batch_divisor(mesh)
    if rows % shards:
        raise errors.ConfigError(
            f"the step's micro-batches hold {rows} rows of {name!r}, which do not divide over the "
            f"{shards} batch shards ({sharding.batch_flags(mesh)}); choose a --batching.batch-size "
            f"(/ --batching.grad-accum) that gives a multiple of {shards} rows")


def shard_batch(batch: dict, mesh: Mesh, accum: int) -> dict:
    """[batch, ...] host arrays -> [accum, micro, ...] device arrays, micro split over the data
    and fsdp axes and, where the mesh has one, the expert axis (replicated over tensor). Every
    process holds the whole global batch and contributes the rows of its own devices."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        check_batch_rows(k, v.shape[0] // accum, mesh)
        v = v.reshape(accum, v.shape[0] // accum, *v.shape[1:])
        target = NamedSharding(mesh, sharding.batch_spec(v.ndim, mesh, leading=1))
        out[k] = jax.make_array_from_callback(v.shape, target, lambda index, v=v: v[index])
    return out


def place(tree, mesh: Mesh):
    """A state tree onto the mesh, each variable sharded by its rule (nnx_posttrain.sharding)."""
    return sharding.put(tree, sharding.tree_shardings(tree, mesh))


def abstract_mesh(mesh_cfg: config_lib.MeshConfig, devices: list, slices: int = 1) -> Mesh:
    """The run's (data, fsdp[, expert], tensor) mesh over ``devices`` (a topology's, compiled for
    and never run on: ``nnx_posttrain.plan``); over several slices, the data axis spans them (a
    slice's devices share fast links, the slices the data-centre network)."""
    if slices == 1:
        return sharding.make_mesh(mesh_cfg, devices)
    from jax.experimental import mesh_utils

    sizes = sharding.mesh_shape(mesh_cfg, len(devices))
    if sizes["data"] % slices:
        raise errors.ConfigError(
            f"--slices {slices}: the mesh's data axis ({sizes['data']}) must divide by the "
            "slices (it spans them); set --mesh.data to a multiple of the slice count")
    ici = (sizes["data"] // slices, *list(sizes.values())[1:])
    dcn = (slices, *[1] * (len(sizes) - 1))
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    return Mesh(grid, tuple(sizes))


def place_abstract(tree, mesh: Mesh):
    """``tree``'s arrays (or their shapes) as ``jax.ShapeDtypeStruct``s laid out as ``place``
    lays them out: nothing allocated."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, sharding.tree_shardings(tree, mesh))
