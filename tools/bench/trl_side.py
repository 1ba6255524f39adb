"""TRL's side of ``tools.bench``: one measurement of SFTTrainer / DPOTrainer, in its own process.

    python -m tools.bench.trl_side --spec JSON --case sft|dpo|dpo_precompute --hf-dir DIR [--steps N]

Loads the Hugging Face checkpoint that ``tools.bench.ours --export`` wrote (the same weights as
ours), trains on the same random token ids (pre-tokenized datasets: TRL's tokenisation is not
timed, nor is ours), and times each optimizer step between the ``on_step_begin`` and
``on_step_end`` callbacks: forward, backward, gradient clipping and the AdamW step of TRL's own
``training_step``, with the batch already collated.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tools.bench.run import (LEARNING_RATE, emit, make_batches, minor_faults, peak_rss_mb, rss_now_mb,
                         summarize, tokens_per_step)


def _datasets(spec: dict, kind: str, n_batches: int, seed: int):
    """The benchmark's batches as a TRL dataset, one row per example, in batch order."""
    import numpy as np
    from datasets import Dataset

    batches = make_batches(spec, kind, n_batches, seed)
    rows = {}
    p = spec["prompt"]
    for b in batches:
        if kind == "sft":
            rows.setdefault("input_ids", []).extend(b["input_ids"].tolist())
        elif kind == "sft_packed":  # the packed examples, one dataset row each (TRL packs them)
            for ids, seg in zip(b["input_ids"], b["segment_ids"]):
                for i in np.unique(seg):
                    rows.setdefault("input_ids", []).append(ids[seg == i].tolist())
        else:
            rows.setdefault("prompt_ids", []).extend(b["chosen_input_ids"][:, :p].tolist())
            rows.setdefault("chosen_ids", []).extend(b["chosen_input_ids"][:, p:].tolist())
            rows.setdefault("rejected_ids", []).extend(b["rejected_input_ids"][:, p:].tolist())
    return Dataset.from_dict(rows)


def measure(spec: dict, case: str, hf_dir: str, steps: int, warmup: int, device: str, dtype: str,
            seed: int) -> dict:
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, GemmaForCausalLM, TrainerCallback

    rss_imports = rss_now_mb()
    torch.manual_seed(seed)
    total = 1 + warmup + steps
    use_cpu = device == "cpu"
    bf16 = dtype == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    load = dict(dtype=torch.float32)
    model = GemmaForCausalLM.from_pretrained(hf_dir, **load)
    times: list[float] = []
    cpu: list[float] = []
    faults: list[int] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not use_cpu:
                torch.cuda.synchronize()
            self.t0, self.c0, self.f0 = time.perf_counter(), time.process_time(), minor_faults()

        def on_step_end(self, args, state, control, **kw):
            if not use_cpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            cpu.append(time.process_time() - self.c0)
            faults.append(minor_faults() - self.f0)

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"), per_device_train_batch_size=spec["batch"],
        max_steps=total, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", gradient_checkpointing=False,
        bf16=bf16, fp16=False, use_cpu=use_cpu, logging_strategy="no", save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, seed=seed, dataloader_num_workers=0,
        max_length=spec["seq"], remove_unused_columns=True,
    )
    kind = {"sft": "sft", "sft_packed": "sft_packed"}.get(case, "dpo")
    dataset = _datasets(spec, kind, total, seed)
    precompute_s = None
    if kind == "sft_packed":  # best-fit decreasing packing, padding-free rows (position_ids)
        args = trl.SFTConfig(**common, packing=True, packing_strategy="bfd", padding_free=True)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset,
                                 processing_class=tokenizer, callbacks=[Timer()])
    elif kind == "sft":
        args = trl.SFTConfig(**common, packing=False, padding_free=False)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset,
                                 processing_class=tokenizer, callbacks=[Timer()])
    else:
        precompute = case == "dpo_precompute"
        args = trl.DPOConfig(**common, beta=0.1, loss_type=["sigmoid"],
                             precompute_ref_log_probs=precompute)
        ref_model = None if precompute else GemmaForCausalLM.from_pretrained(hf_dir, **load)

        class PreTokenizedDPO(trl.DPOTrainer):
            """The dataset already holds prompt_ids / chosen_ids / rejected_ids."""

            def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
                return dataset

        t0 = time.perf_counter()
        trainer = PreTokenizedDPO(model=model, ref_model=ref_model, args=args,
                                  train_dataset=dataset, processing_class=tokenizer,
                                  callbacks=[Timer()])
        if precompute:
            precompute_s = time.perf_counter() - t0  # includes the trainer's construction
    rss_before = rss_now_mb()
    train_out = trainer.train()
    if len(times) != total:
        raise RuntimeError(f"timed {len(times)} steps, expected {total}")
    out = summarize(times, warmup, cpu, faults)
    out.update(
        tokens_per_s=tokens_per_step(spec, case) / (out["ms_per_step"] / 1000),
        peak_rss_mb=peak_rss_mb(), rss_after_imports_mb=rss_imports,
        rss_before_steps_mb=rss_before, precompute_s=precompute_s,
        params=sum(p.numel() for p in model.parameters()), loss_train=float(train_out.training_loss),
        device=device, backend_version=(f"torch {torch.__version__}, transformers "
                                        f"{transformers.__version__}, trl {trl.__version__}"),
        torch_threads=torch.get_num_threads(),
        attn_implementation=model.config._attn_implementation, times_s=times,
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True)
    p.add_argument("--case", default="sft")
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    emit(measure(json.loads(args.spec), args.case, args.hf_dir, args.steps, args.warmup,
                 args.device, args.dtype, args.seed))


if __name__ == "__main__":
    main()
