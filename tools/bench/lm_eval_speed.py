"""lm-evaluation-harness on our model against lm-eval's own ``hf`` backend on the same weights:
``python -m tools.bench.lm_eval_speed [--model gemma_tiny,DIR] [--docs 200] [--batch 16]``
(``DIR``: e.g. ``python -m tools.make_preset --like gemma_2b --scale 0.125 --out DIR``, Gemma's
256 k vocabulary at an eighth of the width).

Each model (random weights, seed 0; a built-in name or a KerasHub preset directory) is exported to
Hugging Face's format (float32) and both backends answer the same requests in one process: ``loglikelihood`` (three sums per problem of the
built-in task's held-out set, lm-eval's multiple-choice requests) and ``generate_until`` (the
same problems in the chat template, greedy, 8 new tokens), timed on a second pass over the same
requests (the first compiles our shapes). Per request type: requests per second of each, their
ratio, and the largest difference of a log-likelihood (the parity figure; tests
assert 1e-4). ``--record NAME`` writes results/NAME.json (``tools.results``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tools import exit_status, results


def request_sets(docs: int, chat):
    from lm_eval.api.instance import Instance

    from nnx_posttrain import data, tasks

    tasks.register()

    src = data.source("builtin", "eval", builtin="prompt_only")
    rows = [src[i] for i in range(min(docs, len(src)))]
    pairs = []
    for r in rows:
        right = int(r["answer"])
        for choice in (right, right - 10, right + 1):
            pairs.append((r["prompt"][0]["content"], f" {choice}"))
    prompts = [(chat(r["prompt"]), {"until": [], "max_gen_toks": 8, "do_sample": False})
               for r in rows]
    make = lambda kind, args: [Instance(request_type=kind, doc={}, arguments=a, idx=i)  # noqa
                               for i, a in enumerate(args)]
    return {"loglikelihood": make("loglikelihood", pairs),
            "generate_until": make("generate_until", prompts)}


def timed(fn, requests):
    fn(requests)  # warm-up: every shape compiled (ours), the caches filled (both)
    start = time.perf_counter()
    out = fn(requests)
    return out, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma_tiny")
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--record", default="none")
    args = parser.parse_args(argv)
    from lm_eval.models.huggingface import HFLM

    from nnx_posttrain import model, tasks
    from nnx_posttrain.export import hf as hf_export
    from nnx_posttrain.harness.lm import NNXLM

    tasks.register()

    rows, stats = [], {}
    for name in args.model.split(","):
        lm = model.load(name, seed=0)
        ours = NNXLM(lm, lm.module, name, batch_size=args.batch)
        with tempfile.TemporaryDirectory() as out:
            hf_export.export_model(lm.task, Path(out), "float32")
            theirs = HFLM(pretrained=out, device="cpu", batch_size=args.batch, dtype="float32")
            sets = request_sets(args.docs, lambda messages: ours.apply_chat_template(messages))
            for kind, requests in sets.items():
                measured = {b: timed(getattr(backend, kind), requests)
                            for b, backend in (("ours", ours), ("hf", theirs))}
                rates = {k: len(requests) / v[1] for k, v in measured.items()}
                diff = (max(abs(a[0] - b[0]) for a, b in
                            zip(measured["ours"][0], measured["hf"][0]))
                        if kind == "loglikelihood" else None)
                stats[f"{Path(name).name}/{kind}"] = {
                    "requests": len(requests), **{f"{k}_per_s": v for k, v in rates.items()},
                    "max_abs_loglik_diff": diff}
                rows.append([Path(name).name, kind, str(len(requests)), f"{rates['ours']:.1f}",
                             f"{rates['hf']:.1f}", f"{rates['ours'] / rates['hf']:.2f}x",
                             f"{diff:.1e}" if diff is not None else "n/a"])
    columns = ["model", "requests", "count", "ours (requests/s)", "lm-eval hf backend (requests/s)",
               "ours / hf", "largest |log-likelihood difference|"]
    notes = [f"Random weights (seed 0), float32, batch {args.batch}, exported to Hugging Face's "
             "format for the hf backend (PyTorch on the CPU); timed on a second pass over the same "
             "requests (the first compiles our shapes and fills both backends' caches)."]
    line = "python -m tools.bench.lm_eval_speed " + " ".join(
        argv if argv is not None else sys.argv[1:])
    results.publish(args.record, line.strip(), columns, rows, notes, data={"stats": stats})
    return stats


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
