"""A plan: a run's training step compiled for a topology, and what XLA says of it.

Per device, in bytes, from ``compiled.memory_analysis()``: the step's inputs (broken down into
trainable weights, optimizer state, frozen weights, the reference copy and the batch from their
shapes and shardings), XLA's temporaries (the activations kept for the backward pass among
them), outputs not written over donated inputs, and the generated code; their total against the
device's memory. Also XLA's FLOPs per
device and step (``compiled.cost_analysis()``, each iteration of the gradient-accumulation loop
counted: ``train.flops``), and the collectives of the compiled program
(all-gathers, reduce-scatters, all-reduces, ...: count and bytes of their results, each
occurrence in the program counted once: an operation inside the gradient-accumulation loop runs
once per micro-batch).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import warnings

import jax
import numpy as np

from nnx_posttrain import errors, model
from nnx_posttrain.model import device_memory
from nnx_posttrain.model.device_memory import GiB
from nnx_posttrain.plan import build as build_lib, fixes as fixes_lib
from nnx_posttrain.plan.topology import Topology

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


@dataclasses.dataclass
class Plan:
    """What a run's step needs per device on a topology (bytes), and what it does."""

    run: dict  # the settings that decide it: algorithm, model, dtype, LoRA, batch shape, ...
    topology: str
    device_kind: str
    devices: int
    slices: int
    mesh: dict
    memory_bytes: int | None  # each device's (None: unknown)
    parts: dict  # per device: name -> bytes (XLA's: inputs, temporaries, outputs, code)
    inputs: dict  # per device: the inputs by kind -> bytes (from their shapes and shardings;
    # on TPU XLA pads small arrays to its tiles, so they may sum to less than the inputs part)
    flops: float | None  # XLA's count per device and step
    collectives: dict  # kind -> {"count", "bytes"}
    compile_seconds: float
    estimate: dict  # the loop's pre-compile estimate of what the step adds (train.memory)
    fixes: list  # [{"change", "estimated_total_bytes", "fits"}] cheapest first (plan.fixes)
    note: str = ""  # the TPU compiler's refusal, where it refused (no analysis then)

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.memory_bytes is None else self.total_bytes <= self.memory_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}

    def refusal(self) -> str | None:
        """Why this plan would not run (None: it fits, or the memory is unknown), with the
        changes estimated to make it fit."""
        if self.fits is not False:
            return None
        fit = [f for f in self.fixes if f["fits"]]
        shown = fit or self.fixes
        return (f"the {self.run['algorithm']} step needs {self.total_bytes / GiB:.2f} GiB per "
                f"device on {self.topology}, which has {self.memory_bytes / GiB:.2f} GiB: it "
                "would not fit. " + ("Estimated to fit, cheapest first: " if fit else
                                     "No single change is estimated to fit; each lowers it: ")
                + "; ".join(f"{f['change']} (~{f['estimated_total_bytes'] / GiB:.2f} GiB)"
                            for f in shown)
                + ". Plan the changed run to confirm, or choose a larger topology.")

    def table(self) -> str:
        """The plan as text: one line per part, the total against the device's memory."""
        width = max(map(len, self.parts))
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
        lines = [f"plan: {self.run['algorithm']} on {self.topology} ({self.devices} x "
                 f"{self.device_kind}{f', {self.slices} slices' if self.slices > 1 else ''}; "
                 f"mesh {mesh}), compiled in {self.compile_seconds:.1f} s",
                 "  " + ", ".join(f"{k} {v}" for k, v in self.run.items() if k != "algorithm"),
                 "per device:"]
        width = max(width, *(len(k) + 4 for k in self.inputs))
        for name, value in self.parts.items():
            lines.append(f"  {name:<{width}}  {value / GiB:9.3f} GiB")
            if name == "inputs":
                lines += [f"    {k:<{width - 2}}  {v / GiB:9.3f} GiB"
                          for k, v in self.inputs.items()]
        verdict = ("" if self.fits is None else
                   f" of {self.memory_bytes / GiB:.2f} GiB: "
                   + ("fits" if self.fits else "DOES NOT FIT"))
        lines.append(f"  {'total':<{width}}  {self.total_bytes / GiB:9.3f} GiB{verdict}")
        active = self.estimate.get("activations", 0) + self.estimate.get(
            "vocabulary projection", 0)
        lines.append(f"  (of the temporaries, the loop's estimate of the activations and the "
                     f"vocabulary projection: {active / GiB:.3f} GiB)")
        if self.note:
            lines.append(self.note)
        if self.flops:
            lines.append(f"FLOPs per device and step: {self.flops:.3e}")
        if self.collectives:
            lines.append("collectives in the program: " + ", ".join(
                f"{k} {v['count']} ({v['bytes'] / GiB:.3f} GiB)"
                for k, v in self.collectives.items()))
        return "\n".join(lines)


def _device_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s ShapeDtypeStructs (the largest shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def collectives(hlo_text: str) -> dict:
    """{kind: {"count", "bytes"}} of the collectives in an HLO module's text (each occurrence
    once; an asynchronous one's result counted as its largest array)."""
    out: dict = {}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        shape, kind, started = match.groups()
        sizes = [_array_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(shape)]
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += (max(sizes, default=0) if started else sum(sizes))
    return {k: out[k] for k in KINDS if k in out}


def _array_bytes(dtype: str, dims: str) -> int:
    bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
    return math.prod(int(d) for d in dims.split(",") if d) * max(bits // 8, 1)


def _run_summary(cfg, algorithm, run: build_lib.AbstractRun) -> dict:
    b = cfg.batching
    tokens = run.batch[next(k for k in run.batch if k.endswith("input_ids"))].shape
    return {"algorithm": algorithm.name, "model": cfg.model, "dtype": cfg.dtype,
            "lora_rank": cfg.lora.rank, "quantize": cfg.quantize, "remat": cfg.remat,
            "batch_size": b.batch_size, "grad_accum": b.grad_accum,
            "sequence": int(tokens[-1]), "attention": run.attention}


def compile_step(run: build_lib.AbstractRun):
    """XLA's compiled step of ``run``, under its mesh. JAX's persistent compilation cache (when
    one is set) cannot load an executable for another platform than this process's: it says so
    in a warning and compiles; that warning is not shown."""
    with warnings.catch_warnings(), jax.set_mesh(run.mesh):
        warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
        return run.step.lower(run.state, run.frozen, run.batch).compile()


def plan(cfg, algorithm, topology: Topology, echo=print) -> Plan:
    """Compile the step of the run ``cfg`` of ``algorithm`` for ``topology`` (nothing runs,
    nothing is allocated) and report it (``Plan``). Built, compiled and estimated as on the
    topology's chip, not on this host: the vocabulary chunks of its memory
    (``model.assume_device_memory``)."""
    with model.assume_device_memory(topology.memory_bytes):
        return _planned(cfg, algorithm, topology, echo)


def _planned(cfg, algorithm, topology: Topology, echo) -> Plan:
    from nnx_posttrain.train import flops as flops_lib, memory

    run = build_lib.build(cfg, algorithm, topology, echo)
    echo(f"compiling the {algorithm.name} step for {topology.name} "
         f"({len(topology.devices)} x {topology.kind}) ...")
    start = time.perf_counter()
    try:
        compiled, refused = compile_step(run), None
    except jax.errors.JaxRuntimeError as exc:
        refused = device_memory.refused_figures(exc)
        if refused is None:
            raise
        compiled = None
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis() if compiled is not None else None
    if stats is None and refused is None:
        raise errors.ConfigError(f"plan: XLA gives no memory analysis on {topology.platform}")
    state, frozen = run.state, run.frozen
    inputs = {"trainable weights": _device_bytes(state["params"]),
              "optimizer state, step, RNG": _device_bytes(
                  {k: v for k, v in state.items() if k != "params"}),
              "frozen weights": _device_bytes(frozen["model"]),
              "reference copy": _device_bytes(frozen["reference"]),
              "batch": _device_bytes(run.batch)}
    if refused is None:
        parts = {"inputs": int(stats.argument_size_in_bytes),
                 "XLA temporaries": int(stats.temp_size_in_bytes),
                 "outputs not in place": max(int(stats.output_size_in_bytes)
                                             - int(stats.alias_size_in_bytes), 0),
                 "generated code": int(stats.generated_code_size_in_bytes)}
        flops = flops_lib.step_flops(compiled)
    else:  # the compiler's own figures, from its refusal: its total, less the inputs
        parts = {"inputs": sum(inputs.values()),
                 "XLA temporaries": max(refused[0] - sum(inputs.values()), 0),
                 "outputs not in place": 0, "generated code": 0}
        topology = dataclasses.replace(topology, memory_bytes=refused[1])
        flops = None
    estimate = memory.estimate(run.cfg, run.lm.module, state["params"],
                               algorithm.sequences_per_example, frozen["reference"] is not None,
                               dict(run.mesh.shape))
    out = Plan(_run_summary(run.cfg, algorithm, run), topology.name, topology.kind,
               len(topology.devices), topology.slices, dict(run.mesh.shape),
               topology.memory_bytes, parts, inputs,
               flops,
               collectives(compiled.as_text()) if compiled is not None else {}, seconds,
               estimate, [], "" if refused is None else
               f"the TPU compiler refused it: it needs {refused[0] / GiB:.2f} GiB (inputs and "
               f"temporaries) of the {refused[1] / GiB:.2f} GiB per device it can use")
    width = max((np.dtype(x.dtype).itemsize for x in jax.tree.leaves(frozen["model"])), default=4)
    out.fixes = fixes_lib.estimate(out, run.cfg, run.lm.module, state["params"],
                                   algorithm.sequences_per_example, width)
    return out
