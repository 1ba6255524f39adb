"""What would make a plan fit, estimated from the compiled plan and the loop's memory model
(``train.memory.estimate``) without compiling again: each change's per-device total is the plan's
own, with

- XLA's temporaries scaled by the estimate's activations and vocabulary projection after the
  change over before (a smaller micro-batch, ``--remat blocks``, a shorter ``--batching.max-length``);
- the inputs' weights, optimizer state and reference copy divided by the wider FSDP axis (the
  data axis folded into it), or the frozen weights that int8 converts in 8 bits (``--quantize
  int8``, LoRA; ``model.quantize.quantized_share``);
- the decoder blocks unrolled (``--scan-layers off``, where they run as one scan): the stacked
  copy of their weights less.

The estimates rank the changes; the plan of the changed run is the measurement.
"""

from __future__ import annotations

import dataclasses

from nnx_posttrain import sharding
from nnx_posttrain.model.quantize import quantized_share
from nnx_posttrain.train import memory


def _active(parts: dict) -> int:
    return parts.get("activations", 0) + parts.get("vocabulary projection", 0)


def candidates(cfg, mesh_shape: dict) -> list[tuple[str, object, dict]]:
    """(the change as options, the changed config, the changed mesh shape), cheapest first."""
    b, out = cfg.batching, []
    if cfg.lora.rank and cfg.quantize == "none":
        out.append(("--quantize int8", dataclasses.replace(cfg, quantize="int8"), mesh_shape))
    micro = b.batch_size // b.grad_accum
    shards = sharding.batch_divisor(mesh_shape)
    if micro % (2 * shards) == 0 and b.batch_size % (2 * b.grad_accum) == 0:
        out.append((f"--batching.grad-accum {2 * b.grad_accum}",
                    dataclasses.replace(cfg, batching=dataclasses.replace(
                        b, grad_accum=2 * b.grad_accum)), mesh_shape))
    if cfg.remat != "blocks":
        out.append(("--remat blocks", dataclasses.replace(cfg, remat="blocks"), mesh_shape))
    if mesh_shape.get("data", 1) > 1:
        wider = dict(mesh_shape, data=1, fsdp=mesh_shape["data"] * mesh_shape.get("fsdp", 1))
        out.append(("--mesh.data 1 --mesh.fsdp -1", cfg, wider))
    if b.max_length > 1:
        out.append((f"--batching.max-length {b.max_length // 2}", dataclasses.replace(
            cfg, batching=dataclasses.replace(b, max_length=b.max_length // 2)), mesh_shape))
    return out


def estimate(plan, cfg, backbone, params, sequences_per_example: int,
             frozen_width: int) -> list[dict]:
    """[{"change", "estimated_total_bytes", "fits"}] for each of ``candidates``, in their order
    (``fits`` None where the device's memory is unknown); ``frozen_width``: the bytes of a
    frozen weight now."""
    reference = plan.inputs["reference copy"] > 0
    parts = memory.estimate(cfg, backbone, params, sequences_per_example, reference, plan.mesh)
    before, out = _active(parts), []
    if parts.get("stacked blocks"):  # the blocks as one scan: their stacked copy, cheapest first
        total = plan.total_bytes - parts["stacked blocks"]
        out.append({"change": "--scan-layers off", "estimated_total_bytes": total,
                    "fits": None if plan.memory_bytes is None else total <= plan.memory_bytes})
    for change, new_cfg, mesh in candidates(cfg, plan.mesh):
        after = _active(memory.estimate(new_cfg, backbone, params, sequences_per_example,
                                        reference, mesh))
        total = plan.total_bytes + int(plan.parts["XLA temporaries"] * (after / max(before, 1) - 1))
        if mesh is not plan.mesh:  # the weights and their state over a wider fsdp axis
            sharded = sum(plan.inputs[k] for k in ("trainable weights", "optimizer state, step, RNG",
                                                   "frozen weights", "reference copy"))
            total -= int(sharded * (1 - plan.mesh.get("fsdp", 1) / mesh["fsdp"]))
        if new_cfg.quantize != cfg.quantize:  # 16-bit (or 32-bit) frozen weights -> 8 bits,
            # those int8 converts (Gemma 4 keeps its MLP's kernels: 44% of E4B's base)
            total -= int(plan.inputs["frozen weights"] * quantized_share(backbone)
                         * (1 - 1 / frozen_width))
        fits = None if plan.memory_bytes is None else total <= plan.memory_bytes
        out.append({"change": change, "estimated_total_bytes": total, "fits": fits})
    return out
