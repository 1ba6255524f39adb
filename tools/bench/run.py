"""Benchmark our training step against the PyTorch stack (TRL) and the JAX peer (Tunix), same
model, weights, data and batch.

    pip install -e ".[bench]"                    # CPU torch 2.13, transformers, trl
    python -m venv /work/venvs/tunix && /work/venvs/tunix/bin/pip install -e ".[bench-tunix]"
    python -m tools.bench --tunix-python /work/venvs/tunix/bin/python    # tiny and medium, a table
    python -m tools.bench --sizes tiny --steps 10 --json runs/bench.json --record bench
    python -m tools.bench --sizes long_2k,long_8k --cases sft_packed --sides ours,trl
    python -m tools.bench --device gpu --sizes medium,gemma_2b --dtype bfloat16   # see tools/bench/gpu.sh
    python -m tools.bench --parity               # TRL parity: tokenisation, logits and DPO metrics

Every measurement runs in its own subprocess (``tools.bench.ours`` for our JAX step,
``tools.bench.trl_side`` for TRL's trainers, ``tools.bench.tunix_side`` for Tunix's, with the Tunix
environment's own interpreter, ``--tunix-python``; without it that side is skipped with a note),
so each peak resident memory is that side's own. Every side builds the same Gemma architecture
with the same weights (ours exported to Hugging Face safetensors with KerasHub's exporter, which
TRL and Tunix load), trains on the same random token ids with the same batch, sequence lengths and
AdamW (constant learning rate, clipping at 1.0, float32, no gradient checkpointing). Cases:

- ``sft``: our ``SFT`` step vs TRL's ``SFTTrainer`` vs Tunix's ``PeftTrainer`` (loss on every token);
- ``dpo``: our ``DPO`` with ``--algo.reference copy`` vs ``DPOTrainer`` (TRL's, Tunix's) with a
  reference model: full fine-tuning, a reference forward every step on every side;
- ``dpo_precompute``: reference log-probs computed before training, ours and TRL
  (``precompute_ref_log_probs=True``); the precomputation is reported, not timed per step;
- ``dpo_lora``: ours only, LoRA rank 8 on attention with the reference as the LoRA base view;
- ``sft_packed``: rows of 8 packed examples (ours: ``segment_ids``; TRL: ``packing=True``, best-fit
  decreasing, padding-free), for the long-context sizes ``long_2k`` / ``long_8k``.

Ours is timed around the jitted step (as ``train.run`` builds it: donated state, pinned output
shardings, ``--attention auto``; in a process with the host allocator a training command of ours
has for a model of the size, ``nnx_posttrain.train.host_memory``, as is the matmul peak's; the peers
keep their defaults; ``--host-allocator tuned|heap|default`` forces one, and a
``GLIBC_TUNABLES`` string such as ``glibc.malloc.mmap_max=0`` runs ours with that instead) with
``jax.block_until_ready``; TRL's between ``on_step_begin`` and
``on_step_end`` (forward, backward, clipping, optimizer step; the batch is already collated);
Tunix's over its own loop (see ``tools.bench.tunix_side``). Reported: median ms/step over the measured
steps, the median process CPU time per step (all threads: less sensitive to other processes on a
shared machine), tokens/s (sequences x length processed by the policy per step / median), peak RSS
of the process, RSS once imports are done, compile time (first step minus the median), and the
matmul bound: the step's model FLOPs divided by the best float32 matmul throughput this machine
reaches on the size's own large shapes (measured first, in its own process), the time of a step
whose every FLOP ran as fast as the best matmul: what no implementation of the step can beat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import ToolError, exit_status

# Gemma architectures (KerasHub GemmaBackbone arguments; intermediate_dim is KerasHub's, twice the
# Hugging Face intermediate_size). batch: examples (SFT) or pairs (DPO) per step.
SIZES = {
    "micro": dict(vocab=64, hidden_dim=32, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                  head_dim=16, intermediate_dim=64, seq=16, prompt=8, batch=2),
    "tiny": dict(vocab=512, hidden_dim=128, num_layers=4, num_query_heads=4, num_key_value_heads=1,
                 head_dim=32, intermediate_dim=512, seq=128, prompt=64, batch=8),
    "medium": dict(vocab=32000, hidden_dim=512, num_layers=8, num_query_heads=8,
                   num_key_value_heads=1, head_dim=64, intermediate_dim=2048, seq=256, prompt=128,
                   batch=4),
    # long context (python -m tools.bench --sizes long_2k,long_8k --cases sft_packed): the tiny
    # model, one row of 2,048 / 8,192 tokens packing 8 examples
    "long_2k": dict(vocab=512, hidden_dim=128, num_layers=4, num_query_heads=4,
                    num_key_value_heads=1, head_dim=32, intermediate_dim=512, seq=2048, prompt=1024,
                    batch=1),
    "long_8k": dict(vocab=512, hidden_dim=128, num_layers=4, num_query_heads=4,
                    num_key_value_heads=1, head_dim=32, intermediate_dim=512, seq=8192, prompt=4096,
                    batch=1),
    # accelerators only: a ~1 B full fine-tune (gemma_2b's dimensions at 4 layers, 2,048-token
    # rows) and gemma_2b itself (its LoRA cases: the headline command's model)
    "gemma_1b": dict(vocab=256000, hidden_dim=2048, num_layers=4, num_query_heads=8,
                     num_key_value_heads=1, head_dim=256, intermediate_dim=32768, seq=2048,
                     prompt=1024, batch=2),
    "gemma_2b": dict(vocab=256000, hidden_dim=2048, num_layers=18, num_query_heads=8,
                     num_key_value_heads=1, head_dim=256, intermediate_dim=32768, seq=1024,
                     prompt=512, batch=4),
}
CASES = ("sft", "dpo", "dpo_precompute", "sft_lora", "dpo_lora", "sft_packed")
TRL_CASES = ("sft", "dpo", "dpo_precompute", "sft_packed")
TUNIX_CASES = ("sft", "dpo", "sft_lora", "dpo_lora")  # Tunix's PeftTrainer does not pack rows
LORA_RANK = 8  # the LoRA cases: rank 8 (alpha 16) on the attention projections, every side
# bf16 peak TFLOP/s of a chip (Cloud TPU's system-architecture pages), by JAX's device_kind
PEAK_TFLOPS = {"TPU v4": 275.0, "TPU v5": 459.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0,
               "TPU v6 lite": 918.0}
SIDES = ("ours", "trl", "tunix")
PACK = 8  # examples per row of the sft_packed case
BACKBONE_KEYS = ("hidden_dim", "num_layers", "num_query_heads", "num_key_value_heads", "head_dim",
                 "intermediate_dim")
LEARNING_RATE = 1e-5


def spec_of(size: str, batch: int | None = None, seq: int | None = None) -> dict:
    spec = dict(SIZES[size], name=size)
    if batch:
        spec["batch"] = batch
    if seq:
        spec["prompt"] = max(1, spec["prompt"] * seq // spec["seq"])
        spec["seq"] = seq
    return spec


def make_batches(spec: dict, kind: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` batches of random token ids (numpy), the same on every side. ``kind`` 'sft': rows of
    ``seq`` tokens, loss on every predicted token; 'sft_packed': rows of ``PACK`` examples of
    ``seq / PACK`` tokens (``segment_ids`` 1..PACK), loss on every token but each example's first;
    'dpo': a shared prompt of ``prompt`` tokens and two different completions filling ``seq``,
    loss on the completions. Ids avoid 0-3 (pad, eos, bos, unk)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    b, t, p, v = spec["batch"], spec["seq"], spec["prompt"], spec["vocab"]
    out = []
    for _ in range(n):
        if kind == "sft":
            ids = rng.randint(4, v, size=(b, t)).astype(np.int32)
            mask = np.ones((b, t), np.float32)
            mask[:, 0] = 0  # position 0 has no prediction
            out.append({"input_ids": ids, "attention_mask": np.ones((b, t), np.int32),
                        "loss_mask": mask})
        elif kind == "sft_packed":
            ids = rng.randint(4, v, size=(b, t)).astype(np.int32)
            seg = np.repeat(np.arange(1, PACK + 1), -(-t // PACK))[:t][None].repeat(b, 0)
            mask = np.ones((b, t), np.float32)
            mask[:, 1:][seg[:, 1:] != seg[:, :-1]] = 0  # each example's first token
            mask[:, 0] = 0
            out.append({"input_ids": ids, "attention_mask": np.ones((b, t), np.int32),
                        "loss_mask": mask, "segment_ids": seg.astype(np.int32)})
        else:
            prompt = rng.randint(4, v, size=(b, p)).astype(np.int32)
            batch = {}
            for name in ("chosen", "rejected"):
                completion = rng.randint(4, v, size=(b, t - p)).astype(np.int32)
                mask = np.zeros((b, t), np.float32)
                mask[:, p:] = 1
                batch[f"{name}_input_ids"] = np.concatenate([prompt, completion], axis=1)
                batch[f"{name}_attention_mask"] = np.ones((b, t), np.int32)
                batch[f"{name}_loss_mask"] = mask
            out.append(batch)
    return out


def tokens_per_step(spec: dict, case: str) -> int:
    rows = spec["batch"] * (1 if case.startswith("sft") else 2)  # DPO: chosen and rejected
    return rows * spec["seq"]


def model_flops(spec: dict, case: str, tokens: int | None = None) -> float:
    """Model FLOPs of one step (PaLM's convention: 6 per parameter and token for forward and
    backward, the attention scores' 12 * layers * seq * heads * head_dim per token; the embedding
    lookup not counted; a reference forward adds 2 per parameter and token). The LM head counts
    only at the positions that carry loss: every token for SFT, the completions for DPO (both
    TRL's fused LM head and ours skip the prompt positions). ``tokens``: the tokens the side's
    forward actually runs where that is not every row's (ours with each DPO prompt once,
    ``algorithms.shared_prompt``: batch x the shared row's length), each counted at ``seq`` keys."""
    d, layers, heads, kv, hd = (spec[k] for k in ("hidden_dim", "num_layers", "num_query_heads",
                                                   "num_key_value_heads", "head_dim"))
    ff = spec["intermediate_dim"] // 2  # KerasHub's intermediate_dim is twice each MLP branch
    per_layer = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ff
    rows = tokens_per_step(spec, case)
    tokens = tokens or rows
    sft = case.startswith("sft")
    head_tokens = rows if sft else rows // spec["seq"] * (spec["seq"] - spec["prompt"])
    # packed rows: each example attends within itself only
    seen = spec["seq"] / PACK if case == "sft_packed" else spec["seq"]
    attention = 12 * layers * seen * heads * hd * tokens
    per_param = 6 + (2 if case == "dpo" else 0)
    if case.endswith("_lora"):  # LoRA: no weight gradients of the frozen base (4 instead of 6),
        per_param = 4 + (2 if case == "dpo_lora" else 0)  # DPO's reference: the base's forward
    return per_param * (layers * per_layer * tokens + spec["vocab"] * d * head_tokens) + attention


def rss_now_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def device_memory_peak() -> dict:
    """The accelerator's memory high-water mark of this process and its capacity (GiB), where
    the device reports them (not the CPU)."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    out = {"device_kind": device.device_kind}
    if stats and "peak_bytes_in_use" in stats:
        out.update(hbm_peak_gib=stats["peak_bytes_in_use"] / 2**30,
                   hbm_limit_gib=stats.get("bytes_limit", 0) / 2**30)
    return out


def minor_faults() -> int:
    """The process's minor page faults so far (memory the kernel mapped in on first touch)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def summarize(times: list[float], warmup: int, cpu_times: list[float] | None = None,
              faults: list[int] | None = None) -> dict:
    """median ms of the steps after the first ``1 + warmup``; compile = first step - median.
    ``cpu_times`` (process CPU seconds per step, all threads) gives ``cpu_ms_per_step``: less
    sensitive than wall time to other processes on a shared machine. ``faults`` (minor page
    faults per step, ``minor_faults`` differences) gives ``page_faults_per_step``: the host
    allocator's work (a step whose buffers are mapped in afresh every step pays for each 4 KB
    page, see ``nnx_posttrain.train.host_memory``)."""
    import statistics

    measured = times[1 + warmup:]
    med = statistics.median(measured)
    out = {"ms_per_step": 1000 * med, "compile_s": max(times[0] - med, 0.0),
           "first_step_s": times[0], "steps_measured": len(measured),
           "ms_min": 1000 * min(measured), "ms_max": 1000 * max(measured)}
    if cpu_times:
        out["cpu_ms_per_step"] = 1000 * statistics.median(cpu_times[1 + warmup:])
    if faults:
        out["page_faults_per_step"] = statistics.median(faults[1 + warmup:])
    return out


def emit(result: dict) -> None:
    """Workers print their result as one line the driver reads."""
    print("BENCH_RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- the driver


ROOT = Path(__file__).resolve().parents[2]


def _run_worker(module: str, args: list[str], timeout: float, python: str | None = None,
                tunables: str | None = None) -> dict:
    """Run ``python -m module args`` (this interpreter by default) from the repository root and
    read its ``BENCH_RESULT`` line. ``tunables``: a ``GLIBC_TUNABLES`` it starts with (glibc reads
    them only at start-up; None: the environment's)."""
    cmd = [python or sys.executable, "-m", module, *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{module} ran past --timeout {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            result = json.loads(line[len("BENCH_RESULT "):])
            result["process_wall_s"] = wall
            return result
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"error": f"{module} exited {proc.returncode} without a result", "log_tail": tail}


HUGE_PAGES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
              "glibc.malloc.trim_threshold=1073741824")  # an environment setting (docs: Scaling)


def ours_allocator(args) -> tuple[list[str], str | None]:
    """(our worker's ``--host-allocator`` arguments, the ``GLIBC_TUNABLES`` it starts with) for
    ``--host-allocator``: ``auto`` / ``heap`` / ``default``, the library's option, applied in the
    worker as a run applies it; ``tuned``, glibc's huge pages; or a ``GLIBC_TUNABLES`` string."""
    choice = args.host_allocator
    if choice in ("auto", "heap", "default"):
        return ["--host-allocator", choice], None
    return ["--host-allocator", "default"], HUGE_PAGES if choice == "tuned" else choice


def host_allocator_option(value: str) -> str:
    """``--host-allocator``: auto, tuned, heap, default, or a ``GLIBC_TUNABLES`` string."""
    if value in ("auto", "tuned", "heap", "default") or value.startswith("glibc."):
        return value
    raise argparse.ArgumentTypeError(
        "expected auto, tuned, heap, default or a GLIBC_TUNABLES string "
        f"(glibc.malloc.NAME=VALUE:...), got {value!r}")


def matmul_peak(spec: dict, args) -> dict:
    option, tunables = ours_allocator(args)
    return _run_worker("tools.bench.ours", ["--matmul-peak", "--spec", json.dumps(spec), "--device",
                                            args.device, "--dtype", args.dtype, *option],
                       args.timeout, tunables=tunables)


def export_weights(spec: dict, out_dir: str, seed: int, timeout: float = 900) -> dict:
    return _run_worker("tools.bench.ours", ["--export", out_dir, "--spec", json.dumps(spec),
                                            "--seed", str(seed)], timeout)


def measure(side: str, spec: dict, case: str, args, hf_dir: str, cpu_devices: int = 1) -> dict:
    common = ["--spec", json.dumps(spec), "--case", case, "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--device", args.device, "--dtype", args.dtype,
              "--seed", str(args.seed)]
    if side == "ours":
        extra = ["--attention", args.attention, "--cpu-devices", str(cpu_devices),
                 "--checkpoint-probe", str(args.checkpoint_probe)]
        if args.logprob_chunk is not None:
            extra += ["--logprob-chunk", str(args.logprob_chunk)]
        if args.ours_flags:
            extra += ["--flags", args.ours_flags]
        option, tunables = ours_allocator(args)
        return _run_worker("tools.bench.ours", common + extra + option, args.timeout,
                           tunables=tunables)
    if side == "tunix":
        return _run_worker("tools.bench.tunix_side", common + (["--hf-dir", hf_dir] if hf_dir else []),
                           args.timeout, python=args.tunix_python)
    return _run_worker("tools.bench.trl_side", common + ["--hf-dir", hf_dir], args.timeout)


def tunix_python(path: str | None) -> tuple[str | None, str]:
    """(interpreter, note): the Tunix environment's Python, or None and why the side is skipped."""
    if not path:
        return None, ("Tunix side skipped: no --tunix-python (e.g. /work/venvs/tunix/bin/python, "
                      "a venv with pip install -e '.[bench-tunix]')")
    if not Path(path).exists():
        return None, f"Tunix side skipped: --tunix-python {path} does not exist"
    probe = subprocess.run([path, "-c", "import tunix, jax, flax; print(jax.__version__, "
                                        "flax.__version__)"], capture_output=True, text=True)
    if probe.returncode:
        return None, f"Tunix side skipped: {path} cannot import tunix ({probe.stderr.strip()[-200:]})"
    return path, f"Tunix side: {path} (jax, flax {probe.stdout.strip()})"


def _fmt(x, spec="{:.1f}"):
    return "n/a" if x is None else spec.format(x)


COLUMNS = ["size", "case", "ours ms/step", "TRL ms/step", "Tunix ms/step",
           "speed-up vs the faster peer", "ours tokens/s", "ours % of matmul bound",
           "matmul bound ms", "ours peak RSS MB", "TRL peak RSS MB", "Tunix peak RSS MB",
           "ours compile s"]


def by_case(results: list[dict]) -> dict:
    """{(size, case): {side: measurement}} (one measurement per side: ``median_over_repeats``)."""
    out = {}
    for r in results:
        out.setdefault((r["size"], r["case"]), {})[r["side"]] = r
    return out


def faster_peer(sides: dict) -> str | None:
    """The peer (TRL or Tunix) with the lowest ms/step among those that ran; None if neither did."""
    ran = [s for s in SIDES[1:] if "ms_per_step" in sides.get(s, {})]
    return min(ran, key=lambda s: sides[s]["ms_per_step"]) if ran else None


def rows_of(results: list[dict]) -> list[list[str]]:
    """One row per (size, case): every side's ms/step and peak RSS, ours against the faster of the
    peers that ran (``dpo_lora``: against their full ``dpo``); then one row per other CPU device
    count of ours (``--cpu-devices``), against the same peers."""
    rows = by_case(results)
    out = []
    for (size, case), sides in rows.items():
        trl, tunix = (sides.get(s, {}) for s in SIDES[1:])
        theirs = case == "dpo_lora" and faster_peer(sides) is None  # no peer ran it: their dpo
        peers = rows.get((size, "dpo"), {}) if theirs else sides
        faster = faster_peer(peers)
        label = case + (" (vs their dpo)" if theirs else "")
        counts = sorted(int(s[len("ours_cpu"):]) for s in sides if s.startswith("ours_cpu"))
        variants = [("ours", label)] + [(f"ours_cpu{n}", f"{label}, {n} CPU devices") for n in counts]
        for side, name in variants:
            ours = sides.get(side, {})
            ratio = (peers[faster]["ms_per_step"] / ours["ms_per_step"]
                     if faster and "ms_per_step" in ours else None)
            bound = (100 * ours["bound_ms"] / ours["ms_per_step"]
                     if "bound_ms" in ours and "ms_per_step" in ours else None)
            out.append([
                size, name, _fmt(ours.get("ms_per_step")), _fmt(trl.get("ms_per_step")),
                _fmt(tunix.get("ms_per_step")),
                "n/a" if ratio is None else f"{ratio:.2f}x ({'TRL' if faster == 'trl' else 'Tunix'})",
                _fmt(ours.get("tokens_per_s"), "{:,.0f}"), _fmt(bound, "{:.0f}%"),
                _fmt(ours.get("bound_ms")), _fmt(ours.get("peak_rss_mb"), "{:,.0f}"),
                _fmt(trl.get("peak_rss_mb"), "{:,.0f}"), _fmt(tunix.get("peak_rss_mb"), "{:,.0f}"),
                _fmt(ours.get("compile_s"), "{:.2f}"),
            ])
    return out


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def table(results: list[dict]) -> str:
    """Markdown: one row per (size, case), every side side by side."""
    return markdown(COLUMNS, rows_of(results))


SAME_WEIGHTS_MAX = 0.2e9  # parameters: beyond, the export costs more than it shows


def same_weights(spec: dict, choice: str) -> bool:
    """Whether the peers load ours' weights (``--same-weights``)."""
    if choice != "auto":
        return choice == "yes"
    d = spec["hidden_dim"]
    per_layer = d * (spec["num_query_heads"] + spec["num_key_value_heads"]) * spec["head_dim"] * 2 \
        + 3 * d * spec["intermediate_dim"] // 2
    return spec["vocab"] * d + spec["num_layers"] * per_layer <= SAME_WEIGHTS_MAX


ACCELERATOR_COLUMNS = ["size", "case", "tokens / step", "ours ms/step", "Tunix ms/step",
                       "speed-up vs Tunix", "ours tokens/s", "ours MFU", "Tunix MFU",
                       "ours HBM buffers peak GiB", "Tunix HBM buffers peak GiB",
                       "ours XLA temporaries GiB", "ours compile s", "Tunix compile s"]


def accelerator_rows(results: list[dict]) -> list[list[str]]:
    """One row per (size, case) on an accelerator: ours and Tunix, model FLOPs utilisation
    against the chip's bf16 peak, the device memory high-water mark, compile times."""
    out = []
    for (size, case), sides in by_case(results).items():
        ours, tunix = sides.get("ours", {}), sides.get("tunix", {})
        ratio = (tunix["ms_per_step"] / ours["ms_per_step"]
                 if "ms_per_step" in ours and "ms_per_step" in tunix else None)
        pct = lambda r: _fmt(100 * r["mfu"], "{:.1f}%") if "mfu" in r else _fail(r)  # noqa: E731
        tokens = ours.get("tokens_per_step", tunix.get("tokens_per_step"))
        out.append([size, case, _fmt(tokens, "{:,}"),
                    _fmt(ours.get("ms_per_step")), _fmt(tunix.get("ms_per_step")) if tunix else "n/a",
                    "n/a" if ratio is None else f"{ratio:.2f}x", _fmt(ours.get("tokens_per_s"), "{:,.0f}"),
                    pct(ours), pct(tunix) if tunix else "n/a",
                    _fmt(ours.get("hbm_peak_gib"), "{:.2f}"), _fmt(tunix.get("hbm_peak_gib"), "{:.2f}"),
                    _fmt(ours.get("xla_temp_gib"), "{:.2f}"),
                    _fmt(ours.get("compile_s"), "{:.1f}"), _fmt(tunix.get("compile_s"), "{:.1f}")])
    return out


def _fail(result: dict) -> str:
    """What a side that did not measure reports: out of memory, or failed."""
    if not result:
        return "n/a"
    text = result.get("error", "") + result.get("log_tail", "")
    return "out of memory" if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text else "failed"


def accelerator_notes(results: list[dict], args) -> list[str]:
    """What the accelerator table's figures are."""
    kinds = sorted({r["device_kind"] for r in results if r.get("device_kind")})
    chip = args.peak_tflops or next((PEAK_TFLOPS[k] for k in kinds if k in PEAK_TFLOPS), None)
    notes = [f"Device: {', '.join(kinds) or args.device}; weights in {args.dtype} on every side "
             "(Tunix: bfloat16 weights, computation and AdamW moments, as its trainers run a "
             "bfloat16 checkpoint; ours: --dtype " + args.dtype + "). MFU: model FLOPs "
             "(6 per parameter and token, 4 under LoRA, + 2 for DPO's reference forward, + "
             "attention; the pairs' rows on both sides) per second over the chip's peak"
             + (f" ({chip:.0f} TFLOP/s bf16)" if chip else "") + ". HBM peak: the process's "
             "memory_stats() high-water mark of its buffers (weights, optimizer state, batches, "
             "outputs); a TPU reserves a program's temporaries apart (XLA's figure for ours: "
             "its temporaries column). Compile: " + (
                 "ours, lowering and compiling the step; Tunix, its first step minus the median."
                 if any("xla_temp_gib" in r for r in results) else
                 "the first step minus the median, on both sides.")]
    for r in results:
        probe = r.get("checkpoint_probe")
        if probe:
            after = probe["after_save_ms"]
            notes.append(
                f"ours, {r['size']} {r['case']}: after an asynchronous checkpoint (the save call "
                f"blocked {probe['save_call_ms']:.0f} ms), the next steps took "
                + ", ".join(f"{a:.0f}" for a in after) + f" ms against the median "
                f"{probe['median_ms']:.0f} ms ({after[0] / probe['median_ms']:.2f}x for the first)")
    for r in results:
        if r.get("side") == "tunix" and r.get("same_weights") is False:
            notes.append(f"{r['size']}: random weights on both sides ({r.get('weights_note')})")
            break
    return notes


def measure_all(args, argv, sizes, cases, sides, cpu_devices) -> tuple[list[dict], dict]:
    """Every (size, case, side) measured, each side in its own process, in alternating order
    over the repeats; the machine's matmul peak per size on a CPU: (results, peaks)."""
    results, peaks = [], {}
    allowed = {"ours": CASES, "trl": TRL_CASES, "tunix": TUNIX_CASES}
    with tempfile.TemporaryDirectory(prefix="nnx_bench_") as tmp:
        for size in sizes:
            spec = spec_of(size, args.batch, args.seq)
            hf_dir = str(Path(tmp) / size)
            if args.device == "cpu":  # an accelerator's peak is its chip's (PEAK_TFLOPS)
                peaks[size] = matmul_peak(spec, args)
                print(f"{size:8s} matmul peak {peaks[size].get('peak_gflops', 0):.1f} GFLOP/s "
                      f"{peaks[size].get('matmul_gflops', peaks[size])}", flush=True)
            if not same_weights(spec, args.same_weights):
                hf_dir = None
            elif "trl" in sides or "tunix" in sides:  # the same weights on every side
                exported = export_weights(spec, hf_dir, args.seed)
                if "error" in exported:
                    raise ToolError(f"export failed: {exported}")
            for case in cases:
                order = [(s, n) for s in SIDES if s in sides and case in allowed[s]
                         for n in (cpu_devices if s == "ours" else [1])]
                for rep in range(args.repeats):
                    for side, n in (order if rep % 2 == 0 else order[::-1]):
                        r = measure(side, spec, case, args, hf_dir, n)
                        side = side if n == 1 else f"{side}_cpu{n}"
                        r.update(size=size, case=case, side=side, repeat=rep)
                        results.append(r)
                        if args.json:  # each measurement kept as it comes (a run cut short)
                            write_json(args.json, argv, peaks, results)
                        msg = (f"{r['ms_per_step']:.1f} ms/step (CPU {r.get('cpu_ms_per_step', 0):.1f} ms), "
                               f"peak RSS {r['peak_rss_mb']:.0f} MB"
                               if "ms_per_step" in r else r.get("error", "?") + "\n" + r.get("log_tail", ""))
                        print(f"{size:8s} {case:15s} {side:9s} {msg}", flush=True)
    return results, peaks


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,medium", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--cases", default="sft,dpo,dpo_precompute,dpo_lora",
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="comma-separated, of ours, trl, tunix (tunix needs --tunix-python)")
    parser.add_argument("--tunix-python", default=None,
                        help="the Python of an environment with Tunix (pip install -e "
                             "'.[bench-tunix]' in its own venv); without it the Tunix side is "
                             "skipped with a note")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (median)")
    parser.add_argument("--warmup", type=int, default=2, help="steps after the first not measured")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each case this many times, alternating the sides' order")
    parser.add_argument("--batch", type=int, default=None, help="override the size's batch")
    parser.add_argument("--seq", type=int, default=None, help="override the size's sequence length")
    parser.add_argument("--device", choices=("cpu", "gpu", "tpu"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "bfloat16-params"),
                        default="float32",
                        help="ours: the --dtype of a run (bfloat16: float32 weights, bfloat16 "
                             "computation; bfloat16-params: bfloat16 weights); the peers: "
                             "bfloat16 weights for either bfloat16")
    parser.add_argument("--same-weights", choices=("auto", "yes", "no"), default="auto",
                        help="export ours to safetensors for the peers to load (auto: up to "
                             f"{SAME_WEIGHTS_MAX / 1e9:.1f} B parameters; larger sizes: random "
                             "weights on every side, which a step's speed does not depend on)")
    parser.add_argument("--logprob-chunk", type=int, default=None,
                        help="our --logprob-chunk (default: the library's)")
    parser.add_argument("--attention", default="auto", help="our --attention (model.set_attention)")
    parser.add_argument("--cpu-devices", default="1",
                        help="our --mesh.cpu-devices, comma-separated: the host CPU as this many "
                             "devices, the batch split over them; each count > 1 adds a row")
    parser.add_argument("--host-allocator", type=host_allocator_option, default="auto",
                        help="ours and the matmul peak with our --host-allocator (auto, heap, "
                             "default: train.host_memory, in process), glibc's huge pages "
                             "(tuned), or this GLIBC_TUNABLES string (e.g. "
                             "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824)")
    parser.add_argument("--ours-flags", default="", help="variants of our step (see tools.bench.ours)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak (e.g. 989 for an H100/H200 in dense bfloat16): "
                             "report model FLOPs utilisation (a TPU's is known: PEAK_TFLOPS)")
    parser.add_argument("--checkpoint-probe", type=int, default=0, metavar="N",
                        help="ours: after measuring, save the state as a run does and time N "
                             "more steps (the step after an asynchronous checkpoint)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--replay", default=None, metavar="FILE",
                        help="measure nothing: the measurements of an earlier run's --json FILE "
                             "(its command's options), tabulated and recorded as that run's")
    parser.add_argument("--record", default=None, metavar="NAME",
                        help="write the table to results/NAME.json for the README "
                             "(tools.results.record)")
    parser.add_argument("--note", action="append", default=[],
                        help="a note recorded under the table (with --record)")
    parser.add_argument("--parity", action="store_true", help="run the TRL parity check instead")
    args = parser.parse_args(argv)
    replayed = None
    if args.replay:  # the earlier run's options, this call's --record / --json
        replayed = read_replay(args.replay)
        record, out = args.record, args.json
        args = parser.parse_args(replayed["argv"])
        args.record, args.json, argv = record, out, replayed["argv"]
    if args.parity:
        from tools.bench import trl_parity

        return trl_parity.main([])
    if args.device == "tpu" and args.sides == ",".join(SIDES):
        args.sides = "ours,tunix"  # TRL runs PyTorch: no TPU
    sizes = [s for s in args.sizes.split(",") if s]
    cases = [c for c in args.cases.split(",") if c]
    sides = [s for s in args.sides.split(",") if s]
    for name, allowed in ((sizes, SIZES), (cases, CASES), (sides, SIDES)):
        bad = [x for x in name if x not in allowed]
        if bad:
            raise ToolError(f"unknown {bad}; expected {', '.join(allowed)}")
    command = "python -m tools.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# {command}", flush=True)
    notes = list(args.note)
    load_start = os.getloadavg()[0]
    if "tunix" in sides and replayed is None:  # a replay measures no side
        args.tunix_python, note = tunix_python(args.tunix_python)
        print(note, flush=True)
        if args.tunix_python is None:
            sides.remove("tunix")
            notes.append(note)
    cpu_devices = sorted({int(n) for n in args.cpu_devices.split(",") if n})
    if not cpu_devices or cpu_devices[0] < 1:
        raise ToolError(f"--cpu-devices: counts >= 1, got {args.cpu_devices!r}")
    if replayed is None:
        results, peaks = measure_all(args, argv, sizes, cases, sides, cpu_devices)
    else:
        results, peaks = replayed["results"], replayed["matmul_peak"]
        notes.append(f"Recorded from the run's measurements (--replay), {len(results)} of them.")
    for r in results:
        if "ms_per_step" in r:
            spec = spec_of(r["size"], args.batch, args.seq)
            # MFU counts the pairs' rows on every side (each prompt once is ours to save)
            flops = model_flops(spec, r["case"])
            r["tokens_per_step"] = tokens_per_step(spec, r["case"])
            r["model_tflops_per_s"] = flops / (r["ms_per_step"] / 1000) / 1e12
            peak = peaks.get(r["size"], {}).get("peak_gflops")
            if peak:  # every model FLOP at the best matmul speed of this machine
                r["bound_ms"] = model_flops(spec, r["case"], r.get("forward_tokens")) / (
                    peak * 1e9) * 1000
            chip = args.peak_tflops or PEAK_TFLOPS.get(r.get("device_kind", ""))
            if chip and args.device != "cpu":
                r["mfu"] = r["model_tflops_per_s"] / chip
                print(f"{r['size']:8s} {r['case']:15s} {r['side']:5s} "
                      f"{r['model_tflops_per_s']:.1f} TFLOP/s, MFU {100 * r['mfu']:.1f}%")
    merged = median_over_repeats(results)
    columns, rows = (COLUMNS, rows_of(merged)) if args.device == "cpu" else (
        ACCELERATOR_COLUMNS, accelerator_rows(merged))
    print()
    print(markdown(columns, rows))
    raw = write_json(args.json, argv, peaks, results)
    if args.record:
        from tools import results as readme

        load_end = os.getloadavg()[0]
        notes.append("Machine load: not known (--replay)." if replayed else
                     f"Machine load (1-minute load average, {os.cpu_count()} cores) at the start "
                     f"{load_start:.1f}, at the end {load_end:.1f}: " + (
                         "above the core count, other processes shared the CPU and wall times "
                         "are inflated (CPU times less so)." if max(load_start, load_end) >
                         os.cpu_count() else "within the core count (the benchmark's own "
                         "processes count in it)."))
        for r in merged:
            if "attention" in r and r["side"] == "ours":
                notes.append(f"ours, {r['size']} {r['case']}: {r['attention']}")
                break
        allocators = {}
        for r in merged:
            if "host_allocator" in r and r["side"] == "ours":
                allocators.setdefault(r["host_allocator"], []).append(r["size"])
        for line, sizes in allocators.items():
            notes.append(f"ours, {', '.join(dict.fromkeys(sizes))}: {line}")
        for r in (r for r in merged if r["side"] == "ours"):
            pair_rows = tokens_per_step(spec_of(r["size"], args.batch, args.seq), r["case"])
            if r.get("forward_tokens", pair_rows) < pair_rows:
                notes.append(f"ours, {r['size']} {r['case']}: each prompt once "
                             f"(algorithms.shared_prompt), {r['forward_tokens']:,} tokens through "
                             f"the model per step instead of {pair_rows:,}; tokens/s counts the pairs' "
                             "rows, the matmul bound the tokens run")
        for n in (n for n in cpu_devices if n > 1):
            notes.append(f"ours, rows '{n} CPU devices': --mesh.cpu-devices {n} (the host CPU as "
                         f"{n} XLA devices, each batch split over them); the peers' columns "
                         "repeat their measurement of the case")
        if args.device != "cpu":
            notes = accelerator_notes(merged, args) + notes[len(args.note):]
        path = readme.record(args.record, command, columns, rows, notes, raw)
        print(f"recorded {path}")
    return merged


def read_replay(path: str) -> dict:
    """An earlier run's ``--json`` file (``write_json``'s), for ``--replay``."""
    try:
        raw = json.loads(Path(path).read_text())
        if not all(k in raw for k in ("argv", "matmul_peak", "results")):
            raise ValueError("it lacks argv, matmul_peak or results")
    except (OSError, ValueError) as e:
        raise ToolError(f"--replay {path}: not a --json file of python -m tools.bench ({e})")
    return raw


def write_json(path: str | None, argv, peaks: dict, results: list[dict]) -> dict:
    """The raw measurements (and to ``path``, when given: rewritten after each measurement)."""
    raw = {"argv": argv if argv is not None else sys.argv[1:], "matmul_peak": peaks,
           "results": results}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(raw, indent=1))
    return raw


def median_over_repeats(results: list[dict]) -> list[dict]:
    import statistics

    groups = {}
    for r in results:
        groups.setdefault((r["size"], r["case"], r["side"]), []).append(r)
    out = []
    for (size, case, side), rs in groups.items():
        ok = [r for r in rs if "ms_per_step" in r]
        if not ok:
            out.append(rs[0])
            continue
        m = dict(ok[0])
        for k in ("ms_per_step", "cpu_ms_per_step", "tokens_per_s", "peak_rss_mb", "compile_s"):
            if all(k in r for r in ok):
                m[k] = statistics.median(r[k] for r in ok)
        out.append(m)
    return out


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
