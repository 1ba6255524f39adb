"""What a plan compiles for: a Cloud TPU slice by its name, or this host's CPU as N devices.

    v5e-16, v5e-64, v6e-8     v5e / v6e: the number is chips (one TensorCore each), a 2-D grid
    v4-8, v5p-128             v4 / v5p: the number is TensorCores (2 per chip, one megacore
                              device per chip): v5p-128 is 64 chips, a 3-D grid 4x4x4
    cpu-8                     this host's CPU split into 8 XLA devices

A TPU topology is described by the TPU compiler in the ``libtpu`` package (``pip install
"jax[tpu]"``), which runs on a CPU host: ``jax.experimental.topologies.get_topology_desc`` gives
devices that can be compiled for but not run on. ``--slices N`` is N such slices joined over the
data-centre network (the mesh's data axis spans them). The chip grids are those Cloud TPU
provisions for each size (the largest dimension doubled last: v4-32 is 2x2x4).

Memory per chip, from the Cloud TPU system-architecture pages
(https://cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e): v4 32 GiB, v5e 16 GiB, v5p 95 GiB,
v6e 32 GiB of HBM.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from nnx_posttrain import errors

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Generation:
    prefix: str  # libtpu's topology-name prefix
    counts_cores: bool  # the slice name counts TensorCores (2 per chip), not chips
    dims: int  # the chip grid's dimensions
    hbm_bytes: int  # per chip (one device)
    pod_chips: int | None = None  # the chips of a whole pod: no slice is larger (--slices)


GENERATIONS = {
    "v4": Generation("v4", True, 3, 32 * GiB, 4096),
    "v5p": Generation("v5", True, 3, 95 * GiB, 8960),
    "v5e": Generation("v5e", False, 2, 16 * GiB, 256),
    "v6e": Generation("v6e", False, 2, 32 * GiB, 256),
}
CPU_DEVICES = 1024  # the most devices --topology cpu-N splits this host's CPU into
TPU_DEVICES = 65536  # the most chips a plan describes (each one a device object, here)


@dataclasses.dataclass
class Topology:
    """Devices to compile for and the memory each has (None: no limit known)."""

    name: str
    devices: list
    memory_bytes: int | None
    slices: int = 1

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    @property
    def kind(self) -> str:
        return self.devices[0].device_kind


def chip_grid(chips: int, dims: int) -> tuple[int, ...]:
    """The grid of ``chips`` (a power of two) Cloud TPU provisions, as libtpu names it: from 1x1
    (2-D) or 2x2x1 (3-D, one host's four chips), the smallest dimension doubled, the last of
    equal ones first (v5e-8 2x4, v4-32 2x2x4, v5p-128 4x4x4)."""
    grid = [1, 1] if dims == 2 else [2, 2, 1]
    if chips < math.prod(grid) or chips & (chips - 1):
        raise ValueError(chips)
    while math.prod(grid) < chips:
        smallest = min(grid)
        i = max(k for k, g in enumerate(grid) if g == smallest)
        grid[i] *= 2
    return tuple(grid)


def _tpu(name: str, generation: str, count: int, slices: int) -> Topology:
    gen = GENERATIONS[generation]
    chips = count // 2 if gen.counts_cores else count
    pod = gen.pod_chips or max(chips, 1)
    try:
        if gen.counts_cores and count % 2 or chips > pod:
            raise ValueError(count)
        grid = chip_grid(chips, gen.dims)
    except ValueError:
        smallest = 8 if gen.counts_cores else 1
        largest = 2 ** int(math.log2(pod)) * (2 if gen.counts_cores else 1)
        raise errors.ConfigError(
            f"--topology {name}: not a {generation} slice size; the sizes are powers of two "
            f"from {generation}-{smallest} to a pod's, {generation}-{largest} or less (the "
            f"number counts {'TensorCores, 2 per chip' if gen.counts_cores else 'chips'}; "
            "more than a pod: --slices N)") from None
    if chips * slices > TPU_DEVICES:
        raise errors.ConfigError(
            f"--topology {name} --slices {slices}: {chips * slices:,} chips, more than a plan "
            f"describes ({TPU_DEVICES:,}): plan fewer slices (the step per device is the same)")
    from jax.experimental import topologies

    _compile_only_libtpu()
    options = dict(chip_config_name="megacore" if gen.counts_cores else "default",
                   chips_per_host_bounds=_host_bounds(grid), num_slices=slices,
                   wrap=tuple(g >= 16 if gen.dims == 2 else g >= 4 for g in grid)
                   + (False,) * (3 - gen.dims))
    try:
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{gen.prefix}:{'x'.join(map(str, grid))}", **options)
    except Exception as exc:  # noqa: BLE001 - libtpu missing or refusing: one clear message
        raise errors.ConfigError(
            f"--topology {name}: JAX could not describe this TPU topology ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else exc!r}). Planning "
            "for TPUs needs the TPU compiler: pip install \"jax[tpu]\" (libtpu; it runs on a CPU "
            "host), or plan on this host's CPU with --topology cpu-N") from None
    return Topology(name, list(desc.devices), gen.hbm_bytes, slices)


def _host_bounds(grid: tuple[int, ...]) -> tuple[int, int, int]:
    """The chips one host holds: four (2x2x1), or all of a smaller slice (v5e-1: one chip)."""
    full = (2, 2, 1)
    return tuple(min(g, f) for g, f in zip((*grid, 1, 1)[:3], full))


def _compile_only_libtpu() -> None:
    """libtpu is loaded here only to compile: it must not take this host's TPU lock (several
    plans at once, or a training job on the same TPU VM, hold it), and it has no workers to
    find (else it logs a page of warnings). These two settings of libtpu's say so; they are read
    when libtpu loads, so they are set before, unless already set."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def _cpu(name: str, count: int) -> Topology:
    import jax

    from nnx_posttrain.model import device_memory
    from nnx_posttrain.train.mesh import split_host_cpu

    split_host_cpu(count, "--topology")
    have = len(jax.devices("cpu"))
    if have != count:
        raise errors.ConfigError(
            f"--topology {name}: this process already started JAX with {have} CPU devices; plan "
            "from a new process (the command does), or call jax.config.update("
            f"'jax_num_cpu_devices', {count}) right after importing jax")
    free = device_memory.available_bytes()
    return Topology(name, jax.devices("cpu"), None if free is None else free // count)


def resolve(name: str, slices: int = 1) -> Topology:
    """The topology named ``name`` (see the module docstring); ``ConfigError`` naming the
    choices for anything else."""
    match = re.fullmatch(r"(v4|v5p|v5e|v6e|cpu|gpu)-(\d+)", name or "")
    if slices < 1:
        raise errors.ConfigError(f"--slices must be >= 1, got {slices}")
    if match is None:
        raise errors.ConfigError(
            f"--topology {name!r}: not a topology; one of v4-N, v5p-N (N TensorCores), v5e-N, "
            "v6e-N (N chips), or cpu-N (this host's CPU as N devices), e.g. v5e-16")
    kind, count = match.group(1), int(match.group(2))
    if kind == "gpu":
        raise errors.ConfigError(
            f"--topology {name}: JAX describes a GPU topology for compilation only through the "
            "CUDA plugin on a host with the GPUs themselves; plan a GPU run on that host, or "
            "plan here with cpu-N or a TPU topology")
    if kind == "cpu":
        if slices != 1:
            raise errors.ConfigError("--slices applies to TPU topologies only")
        if not 1 <= count <= CPU_DEVICES:
            raise errors.ConfigError(
                f"--topology {name}: this host's CPU splits into 1 to {CPU_DEVICES} devices "
                "(cpu-N); e.g. cpu-8")
        return _cpu(name, count)
    return _tpu(name, kind, count, slices)
