"""The scaling page's table of plans: real model shapes on TPU slices, each row the run's own
training step compiled for the topology on this CPU host (``nnx-posttrain plan``), no TPU used.

    python -m tools.plan_table                                  # docs/scaling.md's table
    python -m tools.plan_table --rows gemma_2b/sft/lora/v5e-16 --record none   # one row, a check
    python -m tools.plan_table --rows gemma4_26b_a4b/sft/lora/v5e-16 --update  # one row, added

Each row is a model shape (``tools.make_preset --like NAME --config-only``: the published
config, no weights), an algorithm (SFT or DPO), LoRA rank 8 on every linear projection (``all-linear``)
or full fine-tuning, and a topology, with the settings of a run on a user's data (TRL's: 1,024-token
sequences, 4 micro-batches accumulated, ``--remat blocks``, ``--dtype auto``) and one sequence (SFT)
or pair (DPO) per device in each micro-batch (so 4 x devices per step), the weights sharded over
every device (``--mesh.data 1 --mesh.fsdp -1``), on data whose every sequence fills the 1,024
tokens (the largest step). Columns: whether it fits the chip's HBM, per device GiB (the step's
inputs, XLA's temporaries, the total), XLA's FLOPs per device and step and the time they take at
the chip's peak bf16 rate, the bytes of the program's all-gathers and all-reduces, the compile
time here, and the cheapest change estimated to fit where it does not. Rows are compiled one at
a time in their own process; a row whose plan is already in ``--out`` is reused.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from tools import ToolError, exit_status, results

MODELS = ("gemma_2b", "gemma2_9b", "llama3_8b", "gemma4_26b_a4b", "qwen3_5_35b_a3b")
ROWS = [  # model / algorithm / lora or full / topology
    "gemma_2b/sft/lora/v5e-16", "gemma_2b/sft/full/v5e-16", "gemma_2b/dpo/lora/v5e-16",
    "gemma_2b/dpo/full/v5e-16",
    "gemma2_9b/sft/lora/v5e-16", "gemma2_9b/sft/full/v5e-16", "gemma2_9b/sft/full/v5e-64",
    "gemma2_9b/dpo/lora/v5e-16", "gemma2_9b/dpo/full/v5p-128", "gemma2_9b/sft/full/v5e-8",
    "llama3_8b/sft/lora/v5e-16", "llama3_8b/sft/full/v5e-64", "llama3_8b/dpo/lora/v5e-64",
    "llama3_8b/dpo/full/v5p-128",
    "gemma4_26b_a4b/sft/lora/v5e-16", "gemma4_26b_a4b/sft/full/v5p-128",
    "qwen3_5_35b_a3b/sft/lora/v5e-16", "qwen3_5_35b_a3b/sft/full/v5p-128",
]
# bf16 peak FLOP/s per chip, Cloud TPU's system-architecture pages (as plan.topology's HBM)
PEAK = {"v4": 275e12, "v5p": 459e12, "v5e": 197e12, "v6e": 918e12}
_WORDS = "the of and to in is that for it as with was on be by this are from at or an".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def write_data(out: Path) -> dict[str, Path]:
    """Chats and preference pairs long enough that every sequence is cut at 1,024 tokens."""
    rng, out = random.Random(0), Path(out)
    paths = {"sft": out / "long_chats.jsonl", "dpo": out / "long_pairs.jsonl"}
    with paths["sft"].open("w") as f:
        for _ in range(64):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": _text(rng, 200)},
                {"role": "assistant", "content": _text(rng, 1200)}]}) + "\n")
    with paths["dpo"].open("w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt": [{"role": "user", "content": _text(rng, 200)}],
                                "chosen": [{"role": "assistant", "content": _text(rng, 1200)}],
                                "rejected": [{"role": "assistant",
                                              "content": _text(rng, 1200)}]}) + "\n")
    return paths


def preset(name: str, out: Path) -> Path:
    path = out / name
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "tools.make_preset", "--like", name, "--out",
                        str(path), "--config-only"], check=True)
    return path


def devices(topology: str) -> int:
    kind, count = topology.split("-")
    return int(count) // 2 if kind in ("v4", "v5p") else int(count)


def row_command(row: str, out: Path, data: dict) -> list[str]:
    model, algorithm, tuning, topology = row.split("/")
    per_step = 4 * devices(topology)
    return ["nnx-posttrain", "plan", algorithm, "--model", str(out / model), "--data",
            str(data[algorithm]), "--init-from", "", "--batching.batch-size", str(per_step),
            "--batching.grad-accum", "4", "--mesh.data", "1", "--mesh.fsdp", "-1",
            *(["--lora.rank", "8", "--lora.targets", "all-linear"] if tuning == "lora" else []),
            "--topology", topology]


def plan_row(row: str, out: Path, data: dict, echo=print) -> dict:
    """The plan of ``row`` (its JSON), compiled in a process of its own unless already there."""
    target = out / (row.replace("/", "_") + ".json")
    cmd = row_command(row, out, data)
    if target.is_file():
        saved = json.loads(target.read_text())
        if saved.get("command") == cmd:
            return saved
    echo(f"{row}: {' '.join(cmd)}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nnx_posttrain.cli", *cmd[1:], "--json",
                           str(target)], capture_output=True, text=True)
    if not target.is_file():
        raise ToolError(f"{row}: the plan failed (exit {proc.returncode}):\n"
                        + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]))
    saved = {**json.loads(target.read_text()), "command": cmd,
             "wall_seconds": time.perf_counter() - start}
    target.write_text(json.dumps(saved, indent=1) + "\n")
    echo(f"  {'fits' if saved['fits'] else 'does not fit'}: "
         f"{saved['total_bytes'] / 2**30:.2f} GiB per device, compiled in "
         f"{saved['compile_seconds']:.0f} s")
    return saved


def table_row(row: str, plan: dict) -> list:
    topology = row.split("/")[3]
    gib = 2 ** 30
    peak = PEAK[topology.split("-")[0]]
    coll = plan["collectives"]
    fix = next((f["change"] for f in plan["fixes"] if f["fits"]), "none single") \
        if not plan["fits"] else ""
    return [*_key(row),
            " x ".join(f"{k} {v}" for k, v in plan["mesh"].items() if v > 1),
            "yes" if plan["fits"] else f"no ({fix})",
            f"{plan['parts']['inputs'] / gib:.2f}", f"{plan['parts']['XLA temporaries'] / gib:.2f}",
            f"{plan['total_bytes'] / gib:.2f} / {plan['memory_bytes'] / gib:.0f}",
            f"{plan['flops']:.2e}" if plan["flops"] else "(refused)",
            f"{plan['flops'] / peak:.2f}" if plan["flops"] else "",
            f"{coll.get('all-gather', {}).get('bytes', 0) / gib:.1f} / "
            f"{coll.get('all-reduce', {}).get('bytes', 0) / gib:.1f}",
            f"{plan['compile_seconds']:.0f}"]


def _order(line: list) -> int:
    """A table line's place: its row's in ``ROWS`` (rows no longer listed last)."""
    keys = [_key(row) for row in ROWS]
    return keys.index(tuple(line[:4])) if tuple(line[:4]) in keys else len(ROWS)


COMPILED = "Compiled at "


def merged(recorded: Path, new_rows: list[list], names: list[str]) -> tuple[list, list[str]]:
    """The recorded table's rows with ``new_rows`` (``names``) in their place (a row is its
    model, method, tuning and topology), in ``ROWS``' order; and the notes to keep: the
    recorded ones beyond the first, and which rows were compiled at which commit."""
    if not recorded.is_file():
        raise ToolError(f"--update: {recorded} does not exist; run without --update first")
    saved = json.loads(recorded.read_text())
    table = {tuple(r[:4]): r for r in saved["rows"]}
    table.update({tuple(r[:4]): r for r in new_rows})
    then = f"{saved['commit']} ({saved['date']})"
    earlier = {}  # when -> the rows compiled then
    for note in saved["notes"]:
        for part in note.removeprefix(COMPILED).split("; ") if note.startswith(COMPILED) else []:
            when, compiled = part.split(": ", 1)
            earlier[then if when == "this table's commit" else when] = compiled.split(", ")
    if not earlier:  # the table was compiled whole
        earlier = {then: [r for r in ROWS if _key(r) in table]}
    when_compiled = {when: [r for r in compiled if r not in names]
                     for when, compiled in earlier.items()}
    when_compiled = {k: v for k, v in when_compiled.items() if v}
    when_compiled["this table's commit"] = names
    notes = [n for n in saved["notes"][1:] if not n.startswith(COMPILED)]
    notes.append(COMPILED + "; ".join(f"{k}: {', '.join(v)}" for k, v in when_compiled.items()))
    return sorted(table.values(), key=_order), notes


def _key(row: str) -> tuple:
    model, algorithm, tuning, topology = row.split("/")
    return (model, algorithm.upper(), "LoRA r8" if tuning == "lora" else "full", topology)


COLUMNS = ["model", "method", "tuning", "topology", "mesh", "fits", "inputs GiB",
           "XLA temporaries GiB", "total / HBM GiB", "FLOPs / device / step", "s/step at peak",
           "all-gather / all-reduce GiB", "compile s"]


def main(argv=None) -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/nnx_posttrain_plans",
                        help="where the presets, data and each row's plan are kept")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--record", default="plan_table",
                        help="results/<name>.json to write ('none': do not record)")
    parser.add_argument("--update", action="store_true",
                        help="keep the recorded table's other rows: compile only --rows and put "
                             "them in its place (a row of the same model, method, tuning and "
                             "topology replaced), in ROWS' order")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if len(r.split("/")) != 4 or r.split("/")[0] not in MODELS]
    if unknown:
        raise ToolError(f"--rows: {unknown}: each is MODEL/sft|dpo/lora|full/TOPOLOGY with a "
                        f"model of {', '.join(MODELS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = write_data(out)
    for model in sorted({r.split("/")[0] for r in rows}):
        preset(model, out)
    table = [table_row(r, plan_row(r, out, data)) for r in rows]
    kept_notes = []
    if args.update:
        table, kept_notes = merged(results.RESULTS / f"{args.record}.json", table, rows)
    for line in table:
        print(" | ".join(line))
    if args.record != "none":
        path = results.record(
            args.record, "python -m tools.plan_table", COLUMNS, table,
            notes=["Each row's command: `nnx-posttrain plan ALGORITHM --model DIR --data FILE "
                   "--init-from '' --batching.batch-size 4xDEVICES --batching.grad-accum 4 "
                   "--mesh.data 1 --mesh.fsdp -1 [--lora.rank 8 --lora.targets all-linear] --topology "
                   "T` (DIR from `python -m tools.make_preset --like MODEL --config-only`). "
                   "s/step at peak: XLA's FLOPs over the chip's peak bf16 rate (a lower bound). "
                   "Collectives: bytes of each occurrence in the compiled program (the "
                   "gradient-accumulation loop's body counted once).", *kept_notes])
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
