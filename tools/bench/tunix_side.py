"""Tunix's side of ``tools.bench``: one measurement of its PeftTrainer / DPOTrainer, in its own
process and its own environment (Tunix is not a dependency of the library):

    python -m venv /work/venvs/tunix && /work/venvs/tunix/bin/pip install -e ".[bench-tunix]"
    /work/venvs/tunix/bin/python -m tools.bench.tunix_side --spec JSON --case sft|dpo --hf-dir DIR

``tools.bench --tunix-python /work/venvs/tunix/bin/python`` starts it. The model is
``tunix.models.gemma``'s ``Gemma`` with the spec's dimensions (Tunix's ``hidden_dim`` is each MLP
branch's width: KerasHub's ``intermediate_dim / 2``), its weights read by Tunix's own safetensors
loader from the checkpoint ``tools.bench.ours --export`` wrote (the same weights as ours and TRL's;
where the loader fails, a random initialisation, and the result says ``same_weights: false``).
SFT: ``PeftTrainer`` with its default loss (next-token cross-entropy over the input mask);
DPO: ``DPOTrainer`` with a reference model (its log-probs computed every step, in the trainer's
``_prepare_inputs``), sigmoid loss, beta 0.1. Optimizer: ``optax.chain(clip_by_global_norm(1.0),
adamw(lr, weight_decay=0))``, no remat. ``--dtype bfloat16`` (or ``bfloat16-params``): the weights
in bfloat16, as Tunix's trainers run a checkpoint it loads in bfloat16 (its loader's ``dtype``;
the computation follows the weights' dtype, AdamW's moments too). The LoRA cases (``sft_lora``,
``dpo_lora``) put rank-8 adapters (alpha 16) on the attention projections with qwix, as Tunix's
command line does (``qwix.LoraProvider`` + ``apply_lora_to_model``); ``PeftTrainer`` then trains
only them, and DPO's reference is the base model without them. Without ``--hf-dir`` (the large
sizes, whose weight export costs more than it shows) the weights are random, initialised on the
device.

Timing is over the trainer's own loop: a ``DataHooks`` object hands the loop its batches and, when
the loop asks for the next one, waits for the model's weights (the previous step's result) and
records the time. A step is the interval between two asks: Tunix's input preparation (the
reference forward for DPO), the jitted step, its metric buffering and bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tools import ToolError, exit_status
from tools.bench.run import (LEARNING_RATE, device_memory_peak, emit, make_batches, minor_faults, peak_rss_mb, rss_now_mb,
                         summarize, tokens_per_step)


def tunix_config(spec: dict):
    """``tunix.models.gemma.model.ModelConfig`` of a benchmark spec (Gemma 1: no soft caps, no
    post norms, global attention in every layer)."""
    from tunix.models.gemma import model as gemma

    return gemma.ModelConfig(
        num_layers=spec["num_layers"], num_embed=spec["vocab"], embed_dim=spec["hidden_dim"],
        hidden_dim=spec["intermediate_dim"] // 2, num_heads=spec["num_query_heads"],
        head_dim=spec["head_dim"], num_kv_heads=spec["num_key_value_heads"],
        final_logit_softcap=None, use_post_attn_norm=False, use_post_ffw_norm=False,
        attention_types=[gemma.AttentionType.GLOBAL] * spec["num_layers"])


def build_model(spec: dict, hf_dir: str | None, seed: int, dtype: str = "float32"):
    """(model, same_weights, note): the exported weights through Tunix's loader, else random;
    in ``dtype`` (float32, or bfloat16 for the bfloat16 names)."""
    import jax.numpy as jnp
    from tunix.models.gemma import model as gemma
    from tunix.models.gemma import params_safetensors

    config = tunix_config(spec)
    dtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
    if hf_dir:
        try:
            with tempfile.TemporaryDirectory(prefix="tunix_gemma1_") as tmp:
                model = params_safetensors.create_model_from_safe_tensors(
                    _gemma1_names(hf_dir, tmp), config, mesh=None, dtype=dtype)
            return model, True, ("weights from the exported safetensors (Tunix's loader; "
                                 "post_attention_layernorm renamed pre_feedforward_layernorm)")
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            note = f"Tunix's loader failed ({type(e).__name__}: {e}); random weights"
    else:
        note = "no checkpoint given; random weights"
    return _random_model(gemma, config, seed, dtype), False, note


def _random_model(gemma, config, seed: int, dtype):
    """Tunix's Gemma with random weights in ``dtype``, initialised and cast in one jitted
    program (a bfloat16 model never holds its float32 initialisation whole)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def create():
        model = gemma.Gemma(config, rngs=nnx.Rngs(params=seed))
        state = nnx.state(model)
        nnx.update(model, jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state))
        return model

    return create()


LORA_MODULES = ".*q_einsum|.*kv_einsum|.*qkv_einsum|.*attn_vec_einsum"  # Gemma's attention


def with_lora(model):
    """The model with qwix's LoRA on its attention projections (Tunix's command line's way)."""
    import qwix

    from tools.bench.run import LORA_RANK

    provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=LORA_RANK, alpha=2.0 * LORA_RANK)
    return qwix.apply_lora_to_model(model, provider, **model.get_model_input())


def _gemma1_names(hf_dir: str, out_dir: str) -> str:
    """A copy of a Gemma 1 checkpoint under the names Tunix's (Gemma 2) safetensors mapping
    expects: Gemma 1's ``post_attention_layernorm`` is the norm before the MLP, which Tunix maps
    from ``pre_feedforward_layernorm`` (it reads ``post_attention_layernorm`` as Gemma 2's norm
    after attention, which Gemma 1 has not)."""
    import safetensors.numpy

    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            tensors.update(safetensors.numpy.load_file(os.path.join(hf_dir, name)))
    renamed = {k.replace("post_attention_layernorm", "pre_feedforward_layernorm"): v
               for k, v in tensors.items()}
    safetensors.numpy.save_file(renamed, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def count_params(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


class _Feed:
    """DataHooks for the trainer's loop: the batches in order, and a timestamp (after the previous
    step's weights are ready) each time the loop asks for the next."""

    def __init__(self, batches):
        from tunix.sft import hooks

        self.batches = list(batches)
        self.stamps: list[float] = []
        self.cpu: list[float] = []  # process CPU seconds (less sensitive to a shared machine)
        self.faults: list[int] = []  # the process's minor page faults so far
        outer = self

        class Feed(hooks.DataHooks):
            def load_next_train_batch(self, trainer):
                import jax
                from flax import nnx

                jax.block_until_ready(nnx.state(trainer.model))
                outer.stamps.append(time.perf_counter())
                outer.cpu.append(time.process_time())
                outer.faults.append(minor_faults())
                i = len(outer.stamps) - 1
                return outer.batches[i] if i < len(outer.batches) else None

            def load_next_eval_batch(self, trainer):
                return None

        self.hooks = Feed()

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def cpu_times(self) -> list[float]:
        return [b - a for a, b in zip(self.cpu, self.cpu[1:])]

    def fault_counts(self) -> list[int]:
        return [b - a for a, b in zip(self.faults, self.faults[1:])]


def _sft_inputs(batches):
    from tunix.sft import peft_trainer

    return [peft_trainer.TrainingInput(input_tokens=b["input_ids"], input_mask=b["loss_mask"] > 0)
            for b in batches]


def _dpo_inputs(batches, prompt: int):
    from tunix.sft.dpo import dpo_trainer

    out = []
    for b in batches:
        ids_c, ids_r = b["chosen_input_ids"], b["rejected_input_ids"]
        out.append(dpo_trainer.TrainingInput(
            prompt_ids=ids_c[:, :prompt], prompt_mask=b["chosen_attention_mask"][:, :prompt],
            chosen_ids=ids_c[:, prompt:], chosen_mask=b["chosen_attention_mask"][:, prompt:],
            rejected_ids=ids_r[:, prompt:], rejected_mask=b["rejected_attention_mask"][:, prompt:]))
    return out


def measure(spec: dict, case: str, hf_dir: str | None, steps: int, warmup: int, seed: int,
            dtype: str = "float32") -> dict:
    import jax
    import optax
    import tunix
    from tunix.sft import peft_trainer, utils
    from tunix.sft.dpo import dpo_trainer

    if case not in ("sft", "dpo", "sft_lora", "dpo_lora"):
        raise ToolError(f"tools.bench.tunix_side: case {case!r} not measured "
                        "(sft, dpo, sft_lora, dpo_lora)")
    rss_imports = rss_now_mb()
    total = 1 + warmup + steps
    base, same_weights, note = build_model(spec, hf_dir, seed, dtype)
    model = with_lora(base) if case.endswith("_lora") else base
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
    common = dict(eval_every_n_steps=10**9, max_steps=total, pbar_description=None,
                  data_sharding_axis=("fsdp",))
    kind = "sft" if case.startswith("sft") else "dpo"
    host = make_batches(spec, kind, total, seed)
    if kind == "sft":
        trainer = peft_trainer.PeftTrainer(model, tx, peft_trainer.TrainingConfig(**common))

        def model_inputs(x):
            mask = x.input_tokens != 0  # every benchmark token is real (ids >= 4)
            return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
                    "positions": utils.build_positions_from_mask(mask),
                    "attention_mask": utils.make_causal_attn_mask(mask)}

        trainer = trainer.with_gen_model_input_fn(model_inputs)
        batches = _sft_inputs(host)
    else:
        reference = base if case == "dpo_lora" else build_model(spec, hf_dir, seed, dtype)[0]
        trainer = dpo_trainer.DPOTrainer(
            model, reference, tx,
            dpo_trainer.DPOTrainingConfig(**common, algorithm="dpo", beta=0.1))
        batches = _dpo_inputs(host, spec["prompt"])
    feed = _Feed(batches)
    trainer.with_data_hooks(feed.hooks)
    rss_before = rss_now_mb()
    trainer.train(train_ds=[])  # the batches come from the data hooks
    times = feed.times()
    if len(times) != total:
        raise RuntimeError(f"timed {len(times)} steps, expected {total}")
    try:  # the trainer's own metric history (informative: step 0's loss equals ours)
        history = trainer.metrics_logger._metrics[trainer.metrics_prefix]
        losses = [float(v) for v in next(iter(history.values()))["loss"]]
    except Exception:  # noqa: BLE001 - the loss history is informative only
        losses = []
    out = summarize(times, warmup, feed.cpu_times(), feed.fault_counts())
    out.update(
        tokens_per_s=tokens_per_step(spec, case) / (out["ms_per_step"] / 1000),
        peak_rss_mb=peak_rss_mb(), rss_after_imports_mb=rss_imports,
        rss_before_steps_mb=rss_before, params=count_params(model), same_weights=same_weights,
        weights_note=note, loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None, device=str(jax.devices()[0].platform),
        backend_version=f"tunix {getattr(tunix, '__version__', '0.1.7')}, jax {jax.__version__}",
        times_s=times, **device_memory_peak(),
    )
    return out


class _IdTokenizer:
    """Prompts as text of space-separated token ids, so that Tunix's string-in sampler sees
    exactly the benchmark's ids (its tokenizer adapter accepts any object with these methods)."""

    def __init__(self, bos: int = 2, eos: int = 1, pad: int = 0):
        self._ids = (bos, eos, pad)

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return self._ids[0]

    def eos_id(self):
        return self._ids[1]

    def pad_id(self):
        return self._ids[2]


def sample(spec: dict, hf_dir: str | None, prompts_file: str, new_tokens: int, repeats: int,
           temperature: float, dtype: str = "float32") -> dict:
    """Tunix's sampler (``tunix.generate.sampler.Sampler``, KV cache) on the prompts of
    ``tools.bench.sampler``: median seconds of a call after a warm-up call, and the tokens."""
    import statistics

    import jax
    import numpy as np
    from tunix.generate import sampler as tunix_sampler

    model, same_weights, note = build_model(spec, hf_dir, 0, dtype)
    prompts = np.load(prompts_file)
    width = prompts.shape[1]
    cache = tunix_sampler.CacheConfig(cache_size=width + new_tokens, num_layers=spec["num_layers"],
                                      num_kv_heads=spec["num_key_value_heads"],
                                      head_dim=spec["head_dim"])
    sampler = tunix_sampler.Sampler(model, _IdTokenizer(), cache)
    texts = [" ".join(map(str, row)) for row in prompts.tolist()]
    kwargs = dict(max_generation_steps=new_tokens, max_prompt_length=width, eos_tokens=[-1],
                  temperature=temperature, seed=0, pad_output=True)
    if temperature > 0:
        kwargs["top_p"] = 1.0  # Tunix samples only with top_p (else greedy)
    out = sampler(texts, **kwargs)  # warm-up: compilation
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = sampler(texts, **kwargs)
        jax.block_until_ready(out.tokens)
        seconds.append(time.perf_counter() - t0)
    tokens = np.asarray([np.asarray(t)[:new_tokens] for t in out.tokens])
    return {"seconds": statistics.median(seconds), "completion_ids": tokens.tolist(),
            "same_weights": same_weights, "weights_note": note, "peak_rss_mb": peak_rss_mb()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True)
    p.add_argument("--case", default="sft")
    p.add_argument("--hf-dir", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", default=None, metavar="PROMPTS.npy",
                   help="time Tunix's sampler on these prompts instead (tools.bench.sampler)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    if args.dtype not in ("float32", "bfloat16", "bfloat16-params"):
        raise ToolError(f"tools.bench.tunix_side: --dtype float32 or bfloat16, got {args.dtype}")
    os.environ.setdefault("JAX_PLATFORMS", "cuda" if args.device == "gpu" else args.device)
    if args.sample:
        emit(sample(json.loads(args.spec), args.hf_dir, args.sample, args.new_tokens, args.repeats,
                    args.temperature, args.dtype))
        return
    emit(measure(json.loads(args.spec), args.case, args.hf_dir, args.steps, args.warmup, args.seed,
                 args.dtype))


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
