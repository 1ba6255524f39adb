"""Per-device memory of the training state of gemma_2b / gemma_7b under each mesh.

    python -m tools.bench.memory_table [--devices 8] [--lora-rank 8] [--record]

Shapes are KerasHub's GemmaBackbone variables (names and layouts checked against a real backbone
built from the same formula, ``check``), the published configs of gemma_2b_en / gemma_7b_en;
shardings are ``nnx_posttrain.sharding``'s rules. Counted: weights in float32 (``--dtype
float32`` or ``bfloat16``: bf16 compute, f32 master weights), float32 gradients (the step
accumulates in f32), AdamW's two float32 moments. Activations are not counted (they depend on
batch, length and ``--remat``).
"""

from __future__ import annotations

import argparse
import math
import sys

from nnx_posttrain import sharding

# KerasHub GemmaBackbone arguments of the presets (intermediate_dim is twice each MLP
# projection's width: KerasHub's ffw_gating / ffw_gating_2 kernels are [hidden, intermediate_dim / 2])
CONFIGS = {
    "gemma_2b": dict(vocabulary_size=256000, num_layers=18, num_query_heads=8,
                     num_key_value_heads=1, hidden_dim=2048, intermediate_dim=32768, head_dim=256),
    "gemma_7b": dict(vocabulary_size=256000, num_layers=28, num_query_heads=16,
                     num_key_value_heads=16, hidden_dim=3072, intermediate_dim=49152, head_dim=256),
}
MESHES = {
    8: [{"data": 8}, {"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2},
        {"fsdp": 2, "tensor": 4}],
    32: [{"data": 4, "fsdp": 8}, {"fsdp": 32}, {"fsdp": 16, "tensor": 2}, {"data": 4, "fsdp": 4, "tensor": 2}],
}


def gemma_shapes(vocabulary_size, num_layers, num_query_heads, num_key_value_heads, hidden_dim,
                 intermediate_dim, head_dim, lora_rank=0, lora_targets=("query", "key", "value",
                                                                     "attention_output")):
    """{Keras path: shape} of a GemmaBackbone's trainable variables, and of LoRA factors."""
    ffw = intermediate_dim // 2
    out = {"token_embedding/embeddings": (vocabulary_size, hidden_dim),
           "final_normalization/scale": (hidden_dim,)}
    for i in range(num_layers):
        b = f"decoder_block_{i}"
        kernels = {
            f"{b}/attention/query": (num_query_heads, hidden_dim, head_dim),
            f"{b}/attention/key": (num_key_value_heads, hidden_dim, head_dim),
            f"{b}/attention/value": (num_key_value_heads, hidden_dim, head_dim),
            f"{b}/attention/attention_output": (num_query_heads, head_dim, hidden_dim),
            f"{b}/ffw_gating": (hidden_dim, ffw),
            f"{b}/ffw_gating_2": (hidden_dim, ffw),
            f"{b}/ffw_linear": (ffw, hidden_dim),
        }
        out[f"{b}/pre_attention_norm/scale"] = (hidden_dim,)
        out[f"{b}/pre_ffw_norm/scale"] = (hidden_dim,)
        for layer, shape in kernels.items():
            out[f"{layer}/kernel"] = shape
            if lora_rank and layer.rsplit("/", 1)[1] in lora_targets:
                out[f"{layer}/lora_kernel_a"] = (*shape[:-1], lora_rank)
                out[f"{layer}/lora_kernel_b"] = (lora_rank, shape[-1])
    return out


def check() -> None:
    """The formula gives exactly the variables of a real (tiny) KerasHub GemmaBackbone."""
    from nnx_posttrain import model, tasks

    tasks.register()  # the built-in models

    tiny = dict(model.TINY["gemma_tiny"], vocabulary_size=314)
    lm = model.load("gemma_tiny")
    model.enable_lora(lm.module, 4, None, "attention")
    real = {p: tuple(v.shape) for p, v in model.named_variables(model.split(lm.module)[1]).items()}
    real.update({p: tuple(v.shape) for p, v in model.named_variables(model.split(lm.module)[2]).items()})
    assert real == gemma_shapes(**tiny, lora_rank=4), "formula differs from KerasHub's variables"


def per_device(shapes: dict, mesh: dict, bytes_per_value: int, only=None) -> int:
    total = 0
    for path, shape in shapes.items():
        if only is not None and not only(path):
            continue
        spec = sharding.spec_for(path, shape, mesh)
        total += math.prod(sharding.shard_shape(shape, spec, mesh)) * bytes_per_value
    return total


def table(devices: int, lora_rank: int) -> str:
    gib = 2 ** 30
    lines = []
    for name, cfg in CONFIGS.items():
        full = gemma_shapes(**cfg)
        lora = gemma_shapes(**cfg, lora_rank=lora_rank)
        n = sum(math.prod(s) for s in full.values())
        lines.append(f"\n{name}: {n / 1e9:.2f} B parameters; GiB per device (weights f32 + grads f32 "
                     f"+ AdamW 2 x f32 = 16 B/param for full fine-tuning; LoRA r={lora_rank} on q,k,v,o: "
                     "frozen weights + adapters' 16 B/param)")
        lines.append("| mesh | weights | grads | AdamW | full FT total | LoRA total (f32 base) | LoRA total (bf16 base) |")
        lines.append("|---|---|---|---|---|---|---|")
        for mesh in MESHES[devices]:
            w = per_device(full, mesh, 4)
            is_lora = lambda p: "lora_kernel" in p  # noqa: E731
            adapters = per_device(lora, mesh, 16, only=is_lora)
            name_mesh = " x ".join(f"{k}={v}" for k, v in mesh.items())
            lines.append(
                f"| {name_mesh} | {w / gib:.2f} | {w / gib:.2f} | {2 * w / gib:.2f} | {4 * w / gib:.2f} "
                f"| {(w + adapters) / gib:.2f} | {(w / 2 + adapters) / gib:.2f} |")
    return "\n".join(lines)


def rows(devices: int, lora_rank: int) -> list[list[str]]:
    """One row per (model, mesh): GiB per device for full fine-tuning and for LoRA on a float32
    or a bfloat16 frozen base."""
    gib, out = 2 ** 30, []
    for name, cfg in CONFIGS.items():
        full = gemma_shapes(**cfg)
        lora = gemma_shapes(**cfg, lora_rank=lora_rank)
        n = sum(math.prod(s) for s in full.values())
        for mesh in MESHES[devices]:
            w = per_device(full, mesh, 4)
            adapters = per_device(lora, mesh, 16, only=lambda p: "lora_kernel" in p)
            out.append([f"{name} ({n / 1e9:.2f} B)", " x ".join(f"{k}={v}" for k, v in mesh.items()),
                        f"{4 * w / gib:.2f}", f"{(w + adapters) / gib:.2f}",
                        f"{(w / 2 + adapters) / gib:.2f}"])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, choices=sorted(MESHES))
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--check", action="store_true", help="verify the shapes on a real tiny backbone")
    parser.add_argument("--record", action="store_true", help="write results/memory_table.json")
    args = parser.parse_args(argv)
    if args.check:
        check()
        print("shapes match KerasHub's GemmaBackbone (gemma_tiny with LoRA)")
    print(table(args.devices, args.lora_rank))
    if args.record:
        from tools import results

        command = "python -m tools.bench.memory_table" + " ".join(
            [""] + [a for a in (argv if argv is not None else sys.argv[1:])])
        print(results.record(
            "memory_table", command.strip(),
            ["model", f"mesh ({args.devices} devices)", "full fine-tuning GiB",
             f"LoRA r{args.lora_rank} (f32 base) GiB", f"LoRA r{args.lora_rank} (bf16 base) GiB"],
            rows(args.devices, args.lora_rank),
            notes=["Per device, from the real variable shapes and the sharding rules: float32 "
                   "weights + float32 gradients + AdamW's two float32 moments (16 bytes per trained "
                   "parameter); LoRA on q, k, v, o with a frozen base; activations not counted."]))


if __name__ == "__main__":
    main()
