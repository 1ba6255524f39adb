"""Record the TPU battery's results (``tools/bench/tpu.sh``, run on the chip) as the docs' tables:

    python -m tools.bench.record_tpu DIR     # DIR: the battery's $OUT, brought back from the chip

``results/bench_tpu.json``: ours against Tunix per size and case (``tools.bench``'s accelerator
table: ms/step, MFU, HBM peak, compile), from every ``bench_*.json`` in DIR (and the log of a run
cut short before its JSON: its ms/step lines, MFU computed from them, the rest n/a); and
``results/bench_sampler_tpu.json``: decoding, from every ``sampler_*.json``;
``results/bench_compile_tpu.json``: each step's compile cold and warm (JAX's persistent cache),
from the ``compile_SIZE--CASE_{cold,warm}.json`` pairs; ``results/bench_headline_tpu.json``: the
README's SimPO command as a user runs it (``tpu.sh headline``), from every
``headline_LIKE[--CODE].json`` (CODE: which code it ran, when not this commit's);
``results/bench_save_cost_tpu.json``: what a checkpoint costs the steps around it
(``tools.bench.save_cost``), from ``save_cost.json``. Then ``python -m tools.results`` renders
them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import types
from pathlib import Path

from tools import ToolError, exit_status
from tools.bench import run as bench

SAMPLER_COLUMNS = ["model", "batch", "decoding", "new tokens", "ours s", "Tunix s",
                   "ours tokens/s", "Tunix tokens/s", "speed-up vs Tunix"]


def where(kinds: set[str]) -> str:
    return f"1 {', '.join(sorted(kinds)) or 'TPU'} chip, JAX 0.10.2 (the lent v5e machine)"


_LINE = re.compile(r"^(\S+)\s+(\S+)\s+(ours|tunix)\s+(?:([\d.]+) ms/step.*|(.*exited.*))$")


def from_log(path: Path) -> dict:
    """A run cut short before its JSON (an older driver wrote it only at the end): the
    per-measurement lines of its log, ms/step or the failure, and the command line."""
    text = path.read_text()
    argv = next((line[len("# python -m tools.bench "):].split() for line in text.splitlines()
                 if line.startswith("# python -m tools.bench ")), [])
    results = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            size, case, side, ms, failed = match.groups()
            r = {"size": size, "case": case, "side": side, "from_log": path.name}
            if ms:
                spec = bench.spec_of(size)
                r.update(ms_per_step=float(ms), device_kind="TPU v5 lite",
                         tokens_per_step=bench.tokens_per_step(spec, case),
                         tokens_per_s=bench.tokens_per_step(spec, case) / (float(ms) / 1000))
                r["mfu"] = (bench.model_flops(spec, case) / (float(ms) / 1000)
                            / (bench.PEAK_TFLOPS["TPU v5 lite"] * 1e12))
            else:
                r.update(error=failed, log_tail=text[text.find(line):][:4000])
            results.append(r)
    return {"argv": argv, "results": results, "from_log": path.name}


def earlier_runs(previous: dict, measured: set[tuple[str, str]]) -> tuple[list[dict], list[str]]:
    """The runs of the previous record ``previous`` (results/bench_tpu.json) cut to the (size,
    case) pairs not ``measured`` again, each result marked with the commit that measured it; and
    a note naming those rows and that commit."""
    commit = previous.get("commit", "?")
    kept, pairs = [], []
    for run in previous.get("data", {}).get("runs", []):
        results = [dict(r, commit=r.get("commit", commit)) for r in run["results"]
                   if (r["size"], r["case"]) not in measured]
        if results:
            kept.append(dict(run, results=results))
            pairs += [(r["size"], r["case"], r["commit"]) for r in results]
    by_commit: dict[str, list[str]] = {}
    for size, case, c in dict.fromkeys(pairs):
        by_commit.setdefault(c, []).append(f"{size} {case}")
    notes = [f"Rows {', '.join(rows)}: kept from an earlier battery at commit {c} (not measured "
             "again in this one)." for c, rows in by_commit.items()]
    return kept, notes


def training(files: list[Path], previous: dict | None = None) -> Path:
    """results/bench_tpu.json from the battery's ``files``; with ``previous`` (the earlier
    record) the rows these files do not measure kept from it, and said so."""
    runs = [json.loads(p.read_text()) if p.suffix == ".json" else from_log(p) for p in files]
    measured = {(r["size"], r["case"]) for run in runs for r in run["results"]}
    kept, kept_notes = earlier_runs(previous, measured) if previous else ([], [])
    runs += kept
    results = [r for run in runs for r in run["results"]]
    merged = bench.median_over_repeats(results)
    args = types.SimpleNamespace(peak_tflops=None, dtype="bfloat16-params", device="tpu")
    commands = ["python -m tools.bench " + " ".join(run["argv"]) for run in runs]
    from tools import results as readme

    return readme.record("bench_tpu", "; ".join(commands), bench.ACCELERATOR_COLUMNS,
                         bench.accelerator_rows(merged),
                         bench.accelerator_notes(merged, args) + kept_notes,
                         {"runs": runs}, where({r.get("device_kind", "") for r in merged} - {""}))


def sampling(files: list[Path]) -> Path:
    from tools import results as readme

    rows, raw = [], [json.loads(p.read_text()) for p in files]
    for m in sorted(raw, key=lambda m: (m["mode"], m["batch"])):
        ours, tunix = m["seconds"].get("sampler"), m["seconds"].get("tunix")
        tokens = m["batch"] * m["new_tokens"]
        rows.append([m["label"], str(m["batch"]), m["mode"], str(m["new_tokens"]),
                     f"{ours:.3f}", "n/a" if tunix is None else f"{tunix:.3f}",
                     f"{tokens / ours:,.0f}", "n/a" if tunix is None else f"{tokens / tunix:,.0f}",
                     "n/a" if tunix is None else f"{tunix / ours:.2f}x"])
    notes = ["Ours: nnx_posttrain.sampling.sampler (compiled loop, KV cache); Tunix: "
             "tunix.generate.sampler.Sampler (KV cache); both on random bfloat16 weights of the "
             "size, the same prompt ids (prompt "
             f"{raw[0]['prompt'] if raw else '?'} tokens, no stop token: every row decodes every "
             "new token); median seconds of a call after a warm-up call. Tunix's call includes "
             "its trivial tokenisation of the ids (its API takes text)."]
    commands = sorted({"python -m tools.bench.sampler " + " ".join(m["argv"]) for m in raw})
    return readme.record("bench_sampler_tpu", "; ".join(commands), SAMPLER_COLUMNS, rows, notes,
                         {"runs": raw}, where({m.get("device_kind", "") for m in raw} - {""}))


COMPILE_COLUMNS = ["size", "case", "cold s", "warm s (persistent cache)", "warm / cold",
                   "ms/step"]


def compiling(files: list[Path]) -> Path:
    """results/bench_compile_tpu.json from ``tpu.sh compile``'s pairs of runs."""
    from tools import results as readme

    pairs: dict[tuple[str, str], dict[str, dict]] = {}
    for p in files:
        size, case, when = re.fullmatch(r"compile_(.+)--(.+)_(cold|warm)\.json", p.name).groups()
        text = p.read_text().strip()
        if not text:
            raise ToolError(f"{p}: empty (the run failed before its result: see the machine's log)")
        pairs.setdefault((size, case), {})[when] = json.loads(text)
    rows = []
    for (size, case), runs in sorted(pairs.items()):
        cold, warm = runs.get("cold"), runs.get("warm")
        rows.append([size, case, f"{cold['compile_s']:.1f}" if cold else "n/a",
                     f"{warm['compile_s']:.1f}" if warm else "n/a",
                     f"{warm['compile_s'] / cold['compile_s']:.2f}" if cold and warm else "n/a",
                     f"{(warm or cold)['ms_per_step']:.1f}"])
    notes = ["Compile: lowering and compiling the step (tools.bench.ours' compile_s), each run in "
             "a fresh process; cold with an empty JAX_COMPILATION_CACHE_DIR, warm the same "
             "command again over that cache (as a resume or a second run of the same shapes "
             "reads its step: --compile-cache, on by default for runs)."]
    kinds = {r.get("device_kind", "") for runs in pairs.values() for r in runs.values()}
    return readme.record("bench_compile_tpu", "bash tools/bench/tpu.sh compile", COMPILE_COLUMNS,
                         rows, notes, {"runs": {f"{s}/{c}": r for (s, c), r in pairs.items()}},
                         where(kinds - {""}))


HEADLINE_COLUMNS = ["preset", "code", "run", "log every", "load s", "first step s",
                    "median step s", "steps after a save (x median)", "a save's cost (steps)",
                    "HBM peak GiB"]


def _listed(values: dict) -> str:
    return ", ".join(f"{x:.2f}" for x in values.values()) or "n/a"


def headline(files: list[Path]) -> Path:
    """results/bench_headline_tpu.json from ``tpu.sh headline``'s JSON files."""
    from tools import results as readme

    rows, data = [], {}
    for p in files:
        like, _, code = p.stem.removeprefix("headline_").partition("--")
        saved = data[p.stem] = json.loads(p.read_text())
        for when in ("cold", "warm"):
            r = saved.get(when)
            if r:
                every = re.search(r"--log-every (\d+)", saved["command"])
                costs = r.get("save_cost_steps") or {  # one step a log: the ratio's excess
                    s: x - 1 for s, x in r["after_save_ratio"].items()}
                rows.append([like, code or "this commit", when, every.group(1) if every else "1",
                             f"{r['load_s']:.1f}", f"{r['first_step_s']:.1f}",
                             f"{r['median_s']:.3f}", _listed(r["after_save_ratio"]),
                             _listed(costs),
                             f"{r['peak_gib']:.2f}" if r["peak_where"] == "device" else "n/a"])
    main_like = collections.Counter(d["like"] for d in data.values()).most_common(1)[0][0]
    first = next(d for d in data.values() if d["like"] == main_like)  # the rows' usual command
    notes = [f"`{first['command']}` (the user-data defaults: 16 pairs in 4 micro-batches; these "
             f"pairs are ~{first['cold']['tokens_per_step'] or 0:,.0f} tokens a step) run twice "
             "in fresh processes over one new compile cache: cold (empty), then warm (a second "
             "run directory beside the first reads its step back). First step: tracing, "
             "compiling (or reading back) and running it. Steps after a save: each step right "
             f"after a checkpoint (every {first['save_every']} steps unless the command says "
             "otherwise) over the median of the others; with a log every 10 steps (the default "
             "run's, the loop running ahead of the device), each window's seconds per step after "
             "a save over the median window's. A save's cost: the time of those steps beyond "
             "the median pace, in steps (the whole window's). HBM peak: what the run's last line reports (memory_stats()' high-water "
             "mark). Code 'loop timed': run under `tools.bench.loop_timeline` (`headline "
             "--timeline`: per-piece timers and a thread probing for stalls in the process)."]
    return readme.record("bench_headline_tpu", "bash tools/bench/tpu.sh headline",
                         HEADLINE_COLUMNS, rows, notes, data, where(set()))


SAVE_COST_COLUMNS = ["save", "loop's host work ms", "arrays", "median step ms",
                     "save call ms (median)", "step after a save ms", "x median"]
SAVE_MODES = {"call": "Orbax's call at once (before)",
              "held": "held until the next step is dispatched",
              "held+wait": "held, then waiting for Orbax's commit"}


def save_cost(files: list[Path]) -> Path:
    """results/bench_save_cost_tpu.json from ``tools.bench.save_cost``'s JSON files."""
    from tools import results as readme

    data = {p.stem: json.loads(p.read_text()) for p in files}
    rows = [[SAVE_MODES.get(r["mode"], r["mode"]), f"{r.get('host_ms', 0):.0f}", saved["arrays"],
             f"{r['median_step_ms']:.0f}",
             f"{sorted(r['save_call_ms'])[len(r['save_call_ms']) // 2]:.0f}",
             ", ".join(f"{x:.0f}" for x in r["after_save_ms"]),
             ", ".join(f"{x:.2f}" for x in r["after_save_x"])]
            for saved in data.values() for r in saved["runs"]]
    first = next(iter(data.values()))
    copy = first["copy"]
    notes = [f"A LoRA-like state ({first['arrays']} arrays: 18 layers x 4 projections x 2 rank-8 "
             "factors and their two AdamW moments, as the headline's gemma_2b LoRA run holds) "
             f"saved every 5 steps of a stand-in step of ~{first['stand_in_step_ms']:.0f} ms on "
             "the device (the state donated, its loss read every step, as a run logging every "
             "step does), with the loop's Python work between steps as given (in ~1 ms slices "
             "that release the interpreter). The device copy (jax.device_put, no program "
             f"compiled) took {copy['device_put']['median_ms']:.0f} ms of the host's time; a "
             f"jitted copy {copy['jit']['median_ms']:.0f} ms after its "
             f"{copy['jit']['first_ms'] / 1000:.1f} s compilation."]
    commands = sorted({f"python -m tools.bench.save_cost --steps {len(s['runs'][0]['after_save_ms']) * 5 + 1}"
                       f" --host-ms {s['runs'][0].get('host_ms', 0):g}" for s in data.values()})
    return readme.record("bench_save_cost_tpu", "; ".join(commands), SAVE_COST_COLUMNS, rows,
                         notes, data, where(set()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--keep-earlier", action="store_true",
                        help="keep the rows of results/bench_tpu.json that DIR does not measure "
                             "again (a partial battery), each noted with its commit")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        raise ToolError(f"{root} is not a directory")
    runs = sorted(root.glob("bench_*.json"))
    cut = [p for p in sorted(root.glob("bench_*.log")) if p.with_suffix(".json") not in runs]
    from tools import results as readme

    previous_path = readme.RESULTS / "bench_tpu.json"
    previous = (json.loads(previous_path.read_text())
                if args.keep_earlier and previous_path.exists() else None)
    for name, files, fn in (("training", runs + cut, lambda f: training(f, previous)),
                            ("sampling", sorted(root.glob("sampler_*.json")), sampling),
                            ("compiling", sorted(root.glob("compile_*.json")), compiling),
                            ("headline", sorted(root.glob("headline_*.json")), headline),
                            ("saving", sorted(root.glob("save_cost*.json")), save_cost)):
        if files:
            print(f"recorded {fn(files)} ({name}, {len(files)} files)")


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
