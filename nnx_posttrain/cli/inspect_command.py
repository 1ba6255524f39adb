"""``nnx-posttrain inspect RUN_DIR [--step N] [--html FILE]``: what a run's checkpoint holds.

Prints the run's model and algorithm, the checkpoint read, its parameters by top-level layer,
the LoRA adapters' update norms (``||B A|| * alpha / rank`` per adapted layer) where it has
LoRA, and the last logged train and eval metrics; ``--html`` writes the NNX state as a
treescope page (collapsible tree, array summaries). The notebook ``tools/inspect_run.ipynb``
goes further (curves, a policy against its reference).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nnx_posttrain import inspection, metrics_log, model, runs


def report(run_dir, step: int | None = None) -> list[str]:
    """The lines ``inspect`` prints for ``run_dir``'s checkpoint ``step`` (default: latest)."""
    loaded = runs.load(run_dir, step, echo=lambda _: None)
    cfg = loaded.config
    lines = [f"{run_dir}: {cfg.get('algo_name', '?').removesuffix('Config')} on {cfg['model']} "
             f"({model.resolve_dtype(cfg['model'], cfg['dtype'], bool(cfg['lora']['rank']))}), "
             f"checkpoint {loaded.step} of {cfg.get('steps')} steps",
             "parameters:"]
    counts = inspection.param_counts(loaded.module)
    width = max(map(len, counts))
    lines += [f"  {name:<{width}}  {n:>14,}" for name, n in counts.items()]
    norms = inspection.lora_delta_norms(loaded.module)
    if norms:
        lines.append(f"LoRA update norms ({len(norms)} layers, rank {cfg['lora']['rank']}):")
        lines += [f"  {name}  {value:.4g}" for name, value in norms.items()]
    records = metrics_log.read(run_dir) if (Path(run_dir) / "metrics.jsonl").exists() else []
    for split in ("train", "eval"):
        last = next((r for r in reversed(records) if r["split"] == split
                     and not r.get("eval_only")), None)
        if last:
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in last.items() if k not in ("step", "split"))
            lines.append(f"last {split} record (step {last['step']}): {shown}")
    return lines


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--html", default=None, help="write the NNX state as a treescope page")
    args = parser.parse_args(argv)
    print("\n".join(report(args.run_dir, args.step)))
    if args.html:
        loaded = runs.load(args.run_dir, args.step, echo=lambda _: None)
        Path(args.html).write_text(inspection.show_state(loaded.module))
        print(f"state: {args.html}")
    return 0
