"""Parity with TRL: the same weights and plain-text preference data give the same token ids,
logits and DPO metrics in our code and in TRL's DPOTrainer.

    pip install -e ".[bench]"
    python -m tools.bench.trl_parity            # (also: python -m tools.bench --parity)

What is compared, on the built-in ``gemma_tiny`` (its own SentencePiece tokenizer, vocabulary 315):

1. weights and logits: our backbone is exported with KerasHub's ``export_to_transformers`` and
   loaded as ``transformers.GemmaForCausalLM``; float32 logits of random ids must agree;
2. tokenisation: for plain-text (non-chat) preference records, with an explicit and an implicit
   prompt, our ``data.TokenizePreference`` must give the same prompt / chosen / rejected token ids
   as TRL's ``DPOTrainer`` dataset preparation (BOS + prompt; completion + EOS) with the exported
   Hugging Face tokenizer;
3. DPO metrics at step 0: a policy (the reference with small random perturbations, so that rewards
   are not all zero) and the reference, the same two sets of weights on both sides; our
   ``DPO.loss`` vs TRL's ``compute_loss`` on the same batch: ``loss``, ``rewards/chosen``,
   ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``,
   ``logps/rejected``.

Prints a report and returns it as a dict; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tools import ToolError, exit_status

RECORDS = [
    {"prompt": "What is 12 + 30?", "chosen": " 42", "rejected": " 43"},
    {"prompt": "Question: 7 + 8 =", "chosen": " 15", "rejected": " 16 or so"},
    {"prompt": "Add 25 and 17. The answer is", "chosen": " 42.", "rejected": " 32."},
    # implicit prompt: the common start of chosen and rejected
    {"chosen": "The sum of 3 and 4 is 7.", "rejected": "The sum of 3 and 4 is 8."},
]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")
BETA = 0.1
MAX_LENGTH = 48


def _ours_dpo_batch(lm, records):
    import numpy as np

    from nnx_posttrain import data

    transform = data.TokenizePreference(lm.tokenizer, lm.chat_format, MAX_LENGTH)
    examples = [transform(dict(r, _where=f"record {i}")) for i, r in enumerate(records)]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0] if k != "truncated"}


def _split_ids(batch, side, i):
    """(prompt ids, completion ids) of row ``i`` of our ``side`` ('chosen' / 'rejected')."""
    ids = batch[f"{side}_input_ids"][i]
    att = batch[f"{side}_attention_mask"][i] > 0
    loss = batch[f"{side}_loss_mask"][i] > 0
    return ids[att & ~loss].tolist(), ids[att & loss].tolist()


def check(tol_logits: float = 1e-4, tol_metrics: float = 1e-4, echo=print) -> dict:
    import nnx_posttrain  # noqa: F401
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, GemmaForCausalLM

    from nnx_posttrain import model, tasks

    tasks.register()  # the built-in models
    from nnx_posttrain.algorithms.preference import DPO, DPOConfig

    report = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "trl": trl.__version__, "jax": jax.__version__}}
    ok = True
    tmp = Path(tempfile.mkdtemp(prefix="trl_parity_"))

    # 1. the same weights on both sides; logits
    reference = model.load("gemma_tiny", seed=0)
    policy = model.load("gemma_tiny", seed=0)
    rng = np.random.RandomState(1)
    for v in policy.module.trainable_variables:
        v.assign(np.asarray(v.value) + rng.normal(0, 0.02, v.shape).astype(np.float32))
    reference.task.export_to_transformers(str(tmp / "reference"))
    policy.task.export_to_transformers(str(tmp / "policy"))
    hf_ref = GemmaForCausalLM.from_pretrained(tmp / "reference", dtype=torch.float32).eval()
    hf_pol = GemmaForCausalLM.from_pretrained(tmp / "policy", dtype=torch.float32).eval()
    ids = np.random.RandomState(0).randint(0, reference.tokenizer.vocab_size, (2, 32)).astype(np.int32)
    diffs = []
    for ours, theirs in ((reference, hf_ref), (policy, hf_pol)):
        a = np.asarray(model.full_logits(ours.module, jnp.asarray(ids), jnp.ones_like(ids)))
        with torch.no_grad():
            b = theirs(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
        diffs.append(float(np.max(np.abs(a - b))))
    report["logits_max_abs_diff"] = max(diffs)
    report["logits_scale"] = float(np.max(np.abs(a)))
    if max(diffs) > tol_logits:
        ok = False
    echo(f"logits: max |ours - HF| = {max(diffs):.2e} (logits up to {report['logits_scale']:.2f}; "
         f"tolerance {tol_logits:g})")

    # 2. tokenisation: our transform vs TRL's dataset preparation
    tokenizer = AutoTokenizer.from_pretrained(tmp / "reference")
    args = trl.DPOConfig(output_dir=str(tmp / "trl"), beta=BETA, loss_type=["sigmoid"],
                         per_device_train_batch_size=len(RECORDS), max_length=MAX_LENGTH,
                         report_to=[], use_cpu=True, bf16=False, logging_strategy="no", save_strategy="no",
                         disable_tqdm=True)
    explicit = [dict(r) for r in RECORDS if "prompt" in r]
    implicit = [dict(r) for r in RECORDS if "prompt" not in r]  # a dataset has a prompt column or not
    trainer = trl.DPOTrainer(model=hf_pol, ref_model=hf_ref, args=args,
                             train_dataset=Dataset.from_list(explicit), processing_class=tokenizer)
    prepared = list(trainer.train_dataset)
    if implicit:
        prepared += list(trainer._prepare_dataset(Dataset.from_list(implicit), tokenizer, args,
                                                  "implicit"))
    order = [r for r in RECORDS if "prompt" in r] + [r for r in RECORDS if "prompt" not in r]
    batch = _ours_dpo_batch(policy, order)
    token_mismatches = []
    for i in range(len(RECORDS)):
        row = prepared[i]
        for side in ("chosen", "rejected"):
            prompt, completion = _split_ids(batch, side, i)
            theirs_prompt, theirs_completion = row["prompt_ids"], row[f"{side}_ids"]
            if prompt != theirs_prompt or completion != theirs_completion:
                token_mismatches.append({"record": i, "side": side,
                                         "ours": [prompt, completion],
                                         "trl": [theirs_prompt, theirs_completion]})
    report["token_mismatches"] = token_mismatches
    if token_mismatches:
        ok = False
    echo(f"tokenisation: {len(RECORDS)} records x chosen/rejected, "
         f"{len(token_mismatches)} mismatches" + "".join(f"\n  {m}" for m in token_mismatches))

    # 3. DPO metrics on the same batch, policy vs reference, step 0
    algorithm = DPO(DPOConfig(beta=BETA, reference="copy"))
    algorithm.setup(policy.module)
    total, weight, sums = algorithm.loss(policy.module, {k: jnp.asarray(v) for k, v in batch.items()},
                                         reference.module)
    ours = {"loss": float(total / weight)}
    ours.update({k: float(s / c) for k, (s, c) in sums.items() if k in METRICS})
    hf_pol.eval()
    inputs = trainer.data_collator([prepared[i] for i in range(len(RECORDS))])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs)
    theirs = {"loss": float(loss)}
    theirs.update({k: float(v[-1]) for k, v in trainer._metrics["eval"].items() if k in METRICS})
    # per-row sequence log-probs of policy and reference, both sides (for diagnosis)
    from nnx_posttrain.algorithms.preference import pair_logps

    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    per_row = {"ours_policy": pair_logps(policy.module, jb, 128),
               "ours_reference": pair_logps(reference.module, jb, 128)}
    per_row = {k: {s: np.asarray(v[s]).tolist() for s in ("chosen", "rejected")}
               for k, v in per_row.items()}
    with torch.no_grad():
        ref_c, ref_r = trainer.compute_ref_log_probs(trainer.ref_model, inputs)
        pol_c, pol_r = trainer.compute_ref_log_probs(trainer.model, inputs)
    per_row["trl_policy"] = {"chosen": pol_c.tolist(), "rejected": pol_r.tolist()}
    per_row["trl_reference"] = {"chosen": ref_c.tolist(), "rejected": ref_r.tolist()}
    report["sequence_logps"] = per_row
    for k, v in per_row.items():
        echo(f"  {k:15s} chosen {np.round(v['chosen'], 4).tolist()} rejected "
             f"{np.round(v['rejected'], 4).tolist()}")
    rows = {}
    for name in METRICS:
        a, b = ours.get(name), theirs.get(name)
        diff = None if a is None or b is None else abs(a - b)
        rel = None if diff is None else diff / max(abs(b), 1e-6)
        rows[name] = {"ours": a, "trl": b, "abs_diff": diff, "rel_diff": rel}
        bad = diff is None or (diff > tol_metrics and rel > tol_metrics)
        ok &= not bad
        echo(f"  {name:20s} ours {a!s:>22} TRL {b!s:>22} |diff| {diff if diff is None else f'{diff:.2e}'}"
             + ("   <-- MISMATCH" if bad else ""))
    report["metrics"] = rows
    report["ok"] = bool(ok)
    echo("parity: " + ("OK" if ok else "MISMATCH"))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    report = check()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if not report["ok"]:
        raise ToolError("the losses differ from TRL's (parity: MISMATCH above)")
    return report


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
