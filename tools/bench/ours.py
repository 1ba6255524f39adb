"""Our side of ``tools.bench``: one measurement of the library's training step, in its own process.

    python -m tools.bench.ours --spec JSON --case sft|dpo|dpo_precompute|sft_lora|dpo_lora|simpo_lora [--steps N ...]
    python -m tools.bench.ours --export DIR --spec JSON        # the same weights as HF safetensors
    python -m tools.bench.ours --matmul-peak --spec JSON       # this machine's float32 matmul GFLOP/s

The step is ``train.make_train_step`` with the algorithm's loss, jitted as ``train.run`` does it
(state donated, output shardings pinned to the replicated sharding of a one-axis mesh).
``--flags`` (comma-separated) measures variants: ``no_donate``, ``precision=highest|high|default``
(jax_default_matmul_precision), ``split_pair`` (chosen and rejected in two forwards instead of one
concatenated forward), ``full_logits`` (log-probs from the [batch, length, vocab] logits at once,
every position, instead of the chunked, rematerialised computation at the scored positions), ``all_positions`` (the vocabulary projection on
every position, not only those that carry loss), ``remat`` (``--remat blocks``: each decoder block
recomputed in the backward pass), ``scan`` (``--scan-layers on``: the decoder blocks as one
``jax.lax.scan``; without it, unrolled), ``accum=N`` (the batch in N micro-batches, the training
loop's accumulation scan, ``--batching.grad-accum N``).

On an accelerator the result also holds the device's kind and its memory high-water mark
(``memory_stats()["peak_bytes_in_use"]``: the weights, optimizer state, batches and the step's
temporaries). ``--checkpoint-probe N`` then saves the state as a run does (the project's
``Checkpointer``, asynchronously) and times the N steps that follow, against the median.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tools import ToolError, exit_status
from tools.bench.run import (BACKBONE_KEYS, LEARNING_RATE, device_memory_peak, emit, make_batches, minor_faults, peak_rss_mb,
                         rss_now_mb, summarize, tokens_per_step)


def _setup_platform(device: str) -> None:
    if device == "gpu":
        os.environ.setdefault("JAX_PLATFORMS", "cuda")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        os.environ.setdefault("JAX_PLATFORMS", device)



def build_task(spec: dict, dtype: str = "float32", seed: int = 0):
    """A KerasHub GemmaCausalLM of the spec's dimensions (the built-in tokenizer as preprocessor:
    the benchmark feeds token ids), its backbone warmed up once as ``model.load`` does."""
    import nnx_posttrain  # noqa: F401  (backend)
    import keras
    import keras_hub

    from nnx_posttrain import model
    from nnx_posttrain.tasks import tokenizer as builtin_tokenizer

    keras.utils.set_random_seed(seed)
    tok = keras_hub.models.GemmaTokenizer(proto=builtin_tokenizer.builtin_proto())
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=spec["vocab"], dtype=model.DTYPES[dtype],
        **{k: spec[k] for k in BACKBONE_KEYS})
    task = keras_hub.models.GemmaCausalLM(
        backbone=backbone, preprocessor=keras_hub.models.GemmaCausalLMPreprocessor(tok))
    model.warm_up(backbone)
    return model.nnx_ready(task)


def export(spec: dict, out_dir: str, seed: int) -> dict:
    """The spec's model with seed ``seed`` as Hugging Face safetensors (KerasHub's exporter)."""
    import numpy as np

    task = build_task(spec, "float32", seed)
    task.export_to_transformers(out_dir)
    emb = np.asarray(task.backbone.token_embedding.embeddings.value)
    return {"dir": out_dir, "embedding_checksum": float(np.abs(emb).sum())}


def _apply_flags(flags: list[str], algorithm) -> None:
    """The variants, through the library's own options (no patching)."""
    import jax

    for flag in flags:
        if flag.startswith("precision="):
            jax.config.update("jax_default_matmul_precision", flag.split("=", 1)[1])
        elif flag == "split_pair":
            algorithm.pair_forward = "separate"  # chosen and rejected in two forwards
        elif flag == "concatenated_pair":
            algorithm.pair_forward = "concatenated"  # each prompt twice (no shared_prompt rows)
        elif flag == "full_logits":
            algorithm.logprob_chunk = 0  # --logprob-chunk 0: every position's logits at once
            algorithm.scored_positions_only = False
        elif flag == "all_positions":
            algorithm.scored_positions_only = False
        elif flag and flag not in ("no_donate", "remat", "scan") and not flag.startswith("accum="):
            raise ToolError(f"unknown flag {flag!r}")


def measure(spec: dict, case: str, steps: int, warmup: int, dtype: str, seed: int,
            logprob_chunk: int | None, flags: list[str], profile_steps: int = 0,
            attention: str = "auto", cpu_devices: int = 1, probe_steps: int = 0,
            trace_out: str | None = None) -> dict:
    import nnx_posttrain  # noqa: F401
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from nnx_posttrain import config as config_lib, model, sharding, train
    from nnx_posttrain.algorithms import SFT, SFTConfig
    from nnx_posttrain.algorithms.preference import DPO, DPOConfig, SimPO, SimPOConfig
    from nnx_posttrain.train import host_memory
    from nnx_posttrain.train import flops
    from nnx_posttrain.train.mesh import split_host_cpu

    mesh_config = config_lib.MeshConfig(cpu_devices=cpu_devices)
    split_host_cpu(cpu_devices)  # as train.run does (--mesh.cpu-devices), before JAX starts
    host_memory.release_after_compiles()  # as train.run does
    rss_imports = rss_now_mb()
    task = build_task(spec, dtype, seed)
    module = task.backbone
    attention_line = model.set_attention(module, attention)  # as train.run does (--attention)
    if case in ("sft", "sft_packed", "sft_lora"):
        algorithm = SFT(SFTConfig(), logprob_chunk)
    elif case == "simpo_lora":  # the README's headline: SimPO under LoRA, no reference
        algorithm = SimPO(SimPOConfig(), logprob_chunk)
    else:
        reference = {"dpo": "copy", "dpo_precompute": "precompute", "dpo_lora": "lora_base"}[case]
        algorithm = DPO(DPOConfig(reference=reference), logprob_chunk)
    _apply_flags(flags, algorithm)
    if case in ("sft_lora", "dpo_lora", "simpo_lora"):
        from tools.bench.run import LORA_RANK

        model.enable_lora(module, LORA_RANK, 2 * LORA_RANK, "attention")
    algorithm.setup(module)

    # the mesh, placement and output shardings exactly as train.run makes them (one device here)
    mesh = train.make_mesh(mesh_config)
    model.set_remat(module, "remat" in flags)  # the flag: --remat blocks; else none
    scan_line = model.set_scan(module, "on" if "scan" in flags else "off")  # --scan-layers
    accum = next((int(f.split("=", 1)[1]) for f in flags if f.startswith("accum=")), 1)
    graphdef, params, frozen_model = model.split(module)
    optim = config_lib.OptimConfig(learning_rate=LEARNING_RATE, schedule="constant",
                                   warmup_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0)
    total = 1 + warmup + steps
    tx, lr = train.optimizer(optim, total)
    frozen = train.place({"model": frozen_model, "reference": None}, mesh)
    if algorithm.reference_mode == "copy":
        frozen["reference"] = train.place(jax.tree.map(jnp.copy, params), mesh)
    state = train.place(train.init_state(params, tx, seed), mesh)

    kind = {"sft": "sft", "sft_packed": "sft_packed", "sft_lora": "sft"}.get(case, "dpo")
    host = [algorithm.prepare(b) for b in make_batches(spec, kind, min(total, 4), seed)]
    precompute_s = None
    if algorithm.reference_mode == "precompute":
        reference_fn = jax.jit(lambda p, b: algorithm.reference_logps(
            train.merge(graphdef, p, frozen)[0], b))
        t0 = time.perf_counter()
        for b in host:
            b.update(jax.device_get(reference_fn(state["params"], b)))
        precompute_s = time.perf_counter() - t0
    batches = [train.shard_batch(b, mesh, accum) for b in host]

    step_fn = jax.jit(
        train.make_train_step(graphdef, algorithm.loss, tx, lr),
        donate_argnums=() if "no_donate" in flags else (0,),
        out_shardings=(sharding.tree_shardings(state, mesh), NamedSharding(mesh, P())),
    )
    rss_before = rss_now_mb()
    t0 = time.perf_counter()
    traced = step_fn.trace(state, frozen, batches[0])
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()  # the steps call it (JAX's persistent cache: read back here)
    t3 = time.perf_counter()
    compile_s = t3 - t0
    phases = dict(trace_s=t1 - t0, lower_s=t2 - t1, xla_compile_s=t3 - t2)  # t0 is reused below
    program = compiled.memory_analysis()  # XLA's temporaries: a TPU reserves them apart
    times, cpu, faults, losses = [], [], [], []
    for i in range(total):
        t0, c0, f0 = time.perf_counter(), time.process_time(), minor_faults()
        state, metrics = compiled(state, frozen, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        faults.append(minor_faults() - f0)
        if i == 0:
            losses.append(float(metrics["loss"]))
    losses.append(float(metrics["loss"]))
    out = summarize(times, warmup, cpu, faults)
    out["compile_s"] = compile_s  # tracing, lowering and compiling, before the first step
    out.update(phases)
    if probe_steps:
        state, probe = checkpoint_probe(compiled, state, frozen, batches, probe_steps)
        out["checkpoint_probe"] = dict(probe, median_ms=out["ms_per_step"])
    out.update(
        tokens_per_s=tokens_per_step(spec, case) / (out["ms_per_step"] / 1000),
        # the tokens the forward runs: each DPO prompt once with shared rows (shared_prompt)
        forward_tokens=(int(host[0]["shared_input_ids"].size) if "shared_input_ids" in host[0]
                        else tokens_per_step(spec, case)),
        peak_rss_mb=peak_rss_mb(), rss_after_imports_mb=rss_imports,
        rss_before_steps_mb=rss_before, precompute_s=precompute_s,
        params=model.count_params(nnx_posttrain_params(graphdef, params, frozen_model)),
        trainable_params=model.count_params(params), loss_first=losses[0], loss_last=losses[-1],
        device=str(jax.devices()[0].platform), backend_version=f"jax {jax.__version__}",
        flags=flags, logprob_chunk=logprob_chunk, times_s=times, attention=attention_line,
        layer_scan=scan_line,
        host_allocator=ALLOCATOR["line"], cpu_devices=len(mesh.devices.flat),
        **device_memory_peak(),
        xla_temp_gib=None if program is None else program.temp_size_in_bytes / 2**30,
        step_flops=flops.step_flops(compiled),
    )
    if profile_steps:
        import tempfile

        from tools.bench import profile_breakdown

        hlo = compiled.as_text()

        def run_step():
            nonlocal state
            state, m = compiled(state, frozen, batches[0])
            return m

        with tempfile.TemporaryDirectory() as trace_dir:
            profile_breakdown.trace_steps(run_step, profile_steps, trace_dir)
            # an accelerator's trace also holds the host's threads: only the program's operations
            out["profile"] = profile_breakdown.breakdown(
                trace_dir, hlo, profile_steps, program_only=jax.devices()[0].platform != "cpu")
            if trace_out:  # the trace and the program, for a closer look elsewhere
                profile_breakdown.keep(trace_dir, hlo, trace_out)
    return out


def checkpoint_probe(step_fn, state, frozen, batches, steps: int):
    """Save ``state`` as a run does (``Checkpointer``, asynchronous), then time ``steps`` steps:
    (state, {"save_call_ms": the time the save call blocks, "after_save_ms": each step's,
    "finished_ms": when the save had finished, after the steps})."""
    import tempfile

    import jax

    from nnx_posttrain import checkpoint, config as config_lib

    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        saver = checkpoint.Checkpointer(tmp, config_lib.CheckpointConfig())
        t0 = time.perf_counter()
        saver.save(1, state, {}, {"bench": True})
        save_call = time.perf_counter() - t0
        after = []
        for i in range(steps):
            t1 = time.perf_counter()
            state, metrics = step_fn(state, frozen, batches[i % len(batches)])
            jax.block_until_ready((state, metrics))
            after.append(1000 * (time.perf_counter() - t1))
        saver.close()
        finished = time.perf_counter() - t0
    return state, {"save_call_ms": 1000 * save_call, "after_save_ms": after,
                   "finished_ms": 1000 * finished}


def nnx_posttrain_params(graphdef, params, frozen_model):
    """Every variable (trainable and frozen)."""
    return [params, frozen_model]


def matmul_peak(spec: dict, dtype: str = "float32", repeats: int = 10) -> dict:
    """The best matmul throughput of this device: on the size's own large shapes (the MLP and the
    vocabulary projection over one step's tokens) and on a large square one. Model FLOPs / the best
    = the time a step would take if every FLOP ran at the speed of the best matmul, a bound no
    implementation beats."""
    import nnx_posttrain  # noqa: F401
    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = "bfloat16" if dtype.startswith("bfloat16") else dtype
    tokens = spec["batch"] * spec["seq"]
    shapes = [(tokens, spec["hidden_dim"], spec["intermediate_dim"] // 2),
              (tokens, spec["hidden_dim"], spec["vocab"]), (2048, 2048, 2048)]
    out = {}
    for m, k, n in shapes:
        rng = np.random.default_rng(0)
        a = jnp.asarray(rng.standard_normal((m, k)), dtype)
        b = jnp.asarray(rng.standard_normal((k, n)), dtype)
        f = jax.jit(jnp.matmul)
        f(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / sorted(times)[len(times) // 2] / 1e9
    return {"matmul_gflops": out, "peak_gflops": max(out.values())}


ALLOCATOR = {"line": "host allocator: glibc defaults"}


def set_allocator(option: str, spec: dict) -> None:
    """The host allocator a run of this size has (``--host-allocator``), as ``train.prepare``
    sets it, in this process (a ``GLIBC_TUNABLES`` from the environment wins, as in a run)."""
    from nnx_posttrain.train import host_memory

    setting = host_memory.choose(option, spec["vocab"], spec["hidden_dim"])
    ALLOCATOR["line"] = host_memory.set_allocator(setting)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True)
    p.add_argument("--export", default=None)
    p.add_argument("--matmul-peak", action="store_true")
    p.add_argument("--case", default="sft")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprob-chunk", type=int, default=None, help="default: the library's")
    p.add_argument("--flags", default="")
    p.add_argument("--attention", default="auto", help="--attention of the run (model.set_attention)")
    p.add_argument("--cpu-devices", type=int, default=1,
                   help="--mesh.cpu-devices of the run: the host CPU as this many devices, the batch "
                        "split over them")
    p.add_argument("--host-allocator", default="auto", choices=("auto", "heap", "default"),
                   help="--host-allocator of the run (train.host_memory), applied in this process")
    p.add_argument("--checkpoint-probe", type=int, default=0, metavar="N",
                   help="after measuring, save the state as a run does and time N more steps")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after measuring, trace N steps and print where the time goes")
    p.add_argument("--trace-out", default=None, metavar="PREFIX",
                   help="with --profile: keep the trace as PREFIX.trace.json.gz and the compiled "
                        "program as PREFIX.hlo.txt")
    args = p.parse_args(argv)
    _setup_platform(args.device)
    spec = json.loads(args.spec)
    set_allocator(args.host_allocator, spec)
    if args.export:
        emit(export(spec, args.export, args.seed))
        return
    if args.matmul_peak:
        emit(matmul_peak(spec, args.dtype))
        return
    result = measure(spec, args.case, args.steps, args.warmup, args.dtype, args.seed,
                     args.logprob_chunk, [f for f in args.flags.split(",") if f], args.profile,
                     args.attention, args.cpu_devices, args.checkpoint_probe, args.trace_out)
    if "profile" in result:
        from tools.bench import profile_breakdown

        profile_breakdown.print_breakdown(result["profile"])
    emit(result)


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
