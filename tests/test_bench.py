"""tools.bench's own logic at a trivial size (skipped without the bench extra)."""

import json

import numpy as np
import pytest

from tools import ToolError
from tools.bench import run as bench
from support import MICRO, train_run


def test_batches_are_the_same_on_both_sides_and_well_formed():
    spec = bench.spec_of("micro")
    a = bench.make_batches(spec, "dpo", 2, seed=3)
    b = bench.make_batches(spec, "dpo", 2, seed=3)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    batch = a[0]
    p, t = spec["prompt"], spec["seq"]
    assert batch["chosen_input_ids"].shape == (spec["batch"], t)
    np.testing.assert_array_equal(batch["chosen_input_ids"][:, :p], batch["rejected_input_ids"][:, :p])
    assert batch["chosen_loss_mask"][:, :p].sum() == 0 and batch["chosen_loss_mask"][:, p:].all()
    assert batch["chosen_input_ids"].min() >= 4 and batch["chosen_input_ids"].max() < spec["vocab"]
    sft = bench.make_batches(spec, "sft", 1)[0]
    assert sft["loss_mask"][:, 0].sum() == 0 and sft["loss_mask"][:, 1:].all()
    assert bench.tokens_per_step(spec, "dpo") == 2 * bench.tokens_per_step(spec, "sft")


def test_summary_and_table():
    s = bench.summarize([5.0, 1.0, 0.2, 0.1, 0.3], warmup=1)
    assert s["ms_per_step"] == pytest.approx(200.0) and s["compile_s"] == pytest.approx(4.8)
    assert "page_faults_per_step" not in s
    # page faults per step: the median over the measured steps, the first 1 + warmup left out
    s = bench.summarize([5.0, 1.0, 0.2, 0.1, 0.3], warmup=1, faults=[90000, 500, 12, 7, 3000])
    assert s["page_faults_per_step"] == 12
    rows = [dict(size="micro", case="sft", side="ours", ms_per_step=10.0, tokens_per_s=100.0,
                 peak_rss_mb=1.0, compile_s=1.0),
            dict(size="micro", case="sft", side="trl", ms_per_step=40.0, tokens_per_s=25.0,
                 peak_rss_mb=2.0, compile_s=0.1)]
    text = bench.table(bench.median_over_repeats(rows))
    assert "| micro | sft | 10.0 | 40.0 | n/a | 4.00x (TRL) |" in text
    # with Tunix: the ratio is to the faster of the two peers
    rows.append(dict(size="micro", case="sft", side="tunix", ms_per_step=25.0, tokens_per_s=40.0,
                     peak_rss_mb=1.5, compile_s=0.2))
    text = bench.table(bench.median_over_repeats(rows))
    assert "| micro | sft | 10.0 | 40.0 | 25.0 | 2.50x (Tunix) |" in text
    # --cpu-devices 1,2: our second device count is a row of its own, against the same peers
    rows.append(dict(size="micro", case="sft", side="ours_cpu2", ms_per_step=5.0,
                     tokens_per_s=200.0, peak_rss_mb=1.2, compile_s=1.5))
    lines = bench.table(bench.median_over_repeats(rows)).splitlines()
    assert lines[2].startswith("| micro | sft | 10.0 | 40.0 | 25.0 | 2.50x (Tunix) |")
    assert lines[3].startswith("| micro | sft, 2 CPU devices | 5.0 | 40.0 | 25.0 | 5.00x (Tunix) | 200 |")


def test_packed_batches_mark_each_example_and_its_first_token():
    spec = bench.spec_of("micro")
    batch = bench.make_batches(spec, "sft_packed", 1)[0]
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    assert seg.shape == (spec["batch"], spec["seq"]) and set(np.unique(seg)) == set(range(1, bench.PACK + 1))
    first = np.concatenate([[True], seg[0, 1:] != seg[0, :-1]])
    assert mask[0, first].sum() == 0 and mask[0, ~first].all()
    # packed rows: attention FLOPs within each example only
    assert bench.model_flops(spec, "sft_packed") < bench.model_flops(spec, "sft")


def test_tunix_side_is_skipped_with_a_note_without_its_python(tmp_path):
    python, note = bench.tunix_python(None)
    assert python is None and "--tunix-python" in note
    python, note = bench.tunix_python(str(tmp_path / "nope" / "python"))
    assert python is None and "does not exist" in note


def test_host_allocator_option_takes_a_mode_or_glibc_tunables():
    import argparse

    for value in ("auto", "tuned", "heap", "default", "glibc.malloc.mmap_max=0"):
        assert bench.host_allocator_option(value) == value
    with pytest.raises(argparse.ArgumentTypeError, match="GLIBC_TUNABLES string.*'huge'"):
        bench.host_allocator_option("huge")

    def ours(value):
        return bench.ours_allocator(argparse.Namespace(host_allocator=value))

    # the library's settings apply in our worker's process, as a run applies them
    for value in ("auto", "heap", "default"):
        assert ours(value) == (["--host-allocator", value], None)
    # huge pages and other glibc tunables are environment settings, read when a process starts
    assert ours("tuned") == (["--host-allocator", "default"], bench.HUGE_PAGES)
    assert ours("glibc.malloc.mmap_max=0") == (["--host-allocator", "default"],
                                               "glibc.malloc.mmap_max=0")


@pytest.mark.slow
def test_glibc_tunables_reach_our_worker_and_faults_are_counted():
    """``--host-allocator glibc...``: our measured process runs with exactly that string (its
    result line says so) and reports its page faults per step."""
    tunables = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=536870912"
    args = ["--spec", json.dumps(bench.spec_of("micro")), "--case", "sft", "--steps", "2",
            "--warmup", "0", "--host-allocator", "heap"]
    r = bench._run_worker("tools.bench.ours", args, 600, tunables=tunables)
    assert "error" not in r, r
    assert r["host_allocator"] == f"host allocator: GLIBC_TUNABLES={tunables} (the user's)"
    assert r["page_faults_per_step"] >= 0


@pytest.mark.slow
def test_end_to_end_micro(tmp_path, optimized):
    pytest.importorskip("trl")
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    # SFT on both sides (each side's DPO case is its loss on the same harness: test_trl_parity)
    results = bench.main(["--sizes", "micro", "--cases", "sft", "--steps", "2", "--warmup", "0",
                          "--json", str(out)])
    assert out.exists()
    by = {(r["case"], r["side"]): r for r in results}
    for side in ("ours", "trl"):
        r = by[("sft", side)]
        assert "error" not in r, r
        assert r["ms_per_step"] > 0 and r["peak_rss_mb"] > 0 and r["steps_measured"] == 2
        assert r["page_faults_per_step"] >= 0
    # the matmul bound: model FLOPs at this machine's best matmul
    assert 0 < by[("sft", "ours")]["bound_ms"] < by[("sft", "ours")]["ms_per_step"]
    # ours ran with every block from the heap, as a training run on a model this small does
    assert by[("sft", "ours")]["host_allocator"] == (
        "host allocator: every block from the heap, kept between steps")


@pytest.mark.slow
def test_profile_breakdown_attributes_the_step_to_model_components():
    from tools.bench import ours as bench_ours

    result = bench_ours.measure(bench.spec_of("micro"), "sft", steps=1, warmup=0, dtype="float32",
                                seed=0, logprob_chunk=8, flags=[], profile_steps=2)
    profile = result["profile"]
    parts = profile["by_component_ms"]
    assert profile["ops_ms_per_step"] > 0
    assert sum(parts.values()) == pytest.approx(profile["ops_ms_per_step"])
    for part in ("attention fwd", "attention bwd", "ffw fwd", "ffw bwd", "token_embedding bwd"):
        assert parts.get(part, 0) > 0, parts
    assert parts.get("other fwd", 0) + parts.get("other bwd", 0) < 0.5 * profile["ops_ms_per_step"]


TUNIX_PYTHON = "/work/venvs/tunix/bin/python"


@pytest.mark.slow
def test_tunix_side_end_to_end_micro(tmp_path):
    """Tunix's trainers on the same weights: its step-0 SFT loss equals ours (skipped where no
    Tunix environment exists)."""
    import os

    if not os.path.exists(TUNIX_PYTHON):
        pytest.skip(f"no Tunix environment at {TUNIX_PYTHON}")
    results = bench.main(["--sizes", "micro", "--cases", "sft,dpo", "--steps", "2", "--warmup",
                          "1", "--sides", "ours,tunix", "--tunix-python", TUNIX_PYTHON])
    by = {(r["case"], r["side"]): r for r in results}
    for case in ("sft", "dpo"):
        r = by[(case, "tunix")]
        assert "error" not in r, r
        assert r["same_weights"] and r["params"] == by[(case, "ours")]["params"]
        assert r["loss_first"] == pytest.approx(by[(case, "ours")]["loss_first"], rel=1e-5)


def test_a_partial_tpu_battery_keeps_the_earlier_rows_it_does_not_measure(tmp_path, monkeypatch):
    """record_tpu --keep-earlier: the rows DIR measures are replaced, the others kept from the
    previous record and named with the commit that measured them."""
    import json

    from tools import results
    from tools.bench import record_tpu

    previous = json.loads((results.RESULTS / "bench_tpu.json").read_text())
    runs = previous["data"]["runs"]
    one = next(r for run in runs for r in run["results"] if r["size"] == "tiny")
    battery = tmp_path / "battery"
    battery.mkdir()
    (battery / "bench_tiny.json").write_text(json.dumps(
        {"argv": ["--sizes", "tiny"], "results": [dict(r, ms_per_step=r["ms_per_step"] * 2)
                                                  for run in runs for r in run["results"]
                                                  if (r["size"], r["case"]) == ("tiny", one["case"])]}))
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench_tpu.json").write_text(json.dumps(dict(previous, commit="abc1234")))
    record_tpu.main([str(battery), "--keep-earlier"])
    new = json.loads((tmp_path / "results" / "bench_tpu.json").read_text())
    pairs = [(row[0], row[1]) for row in new["rows"]]
    assert sorted(pairs) == sorted((row[0], row[1]) for row in previous["rows"])
    # one note per commit the kept rows were measured at (the record's own: abc1234)
    kept = " ".join(n for n in new["notes"] if n.startswith("Rows "))
    assert "abc1234" in kept and f"tiny {one['case']}" not in kept and "gemma_1b sft" in kept


def test_compile_pairs_are_recorded_cold_against_warm(tmp_path, monkeypatch):
    """tpu.sh compile's pairs of runs: one row per step, cold and warm compile and their ratio;
    an empty result (a run that failed) is refused by name."""
    import json

    from tools import results
    from tools.bench import record_tpu

    battery = tmp_path / "battery"
    battery.mkdir()
    for when, seconds in (("cold", 27.66), ("warm", 5.75)):
        (battery / f"compile_gemma_1b--sft_{when}.json").write_text(json.dumps(
            {"compile_s": seconds, "ms_per_step": 206.7, "device_kind": "TPU v5 lite"}))
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    record_tpu.main([str(battery)])
    table = json.loads((tmp_path / "results" / "bench_compile_tpu.json").read_text())
    assert table["rows"] == [["gemma_1b", "sft", "27.7", "5.8", "0.21", "206.7"]]
    (battery / "compile_gemma_2b--dpo_lora_cold.json").write_text("")
    with pytest.raises(ToolError, match="compile_gemma_2b--dpo_lora_cold.json: empty"):
        record_tpu.main([str(battery)])


@pytest.mark.slow
def test_loop_timeline_times_each_steps_pieces_and_restores_the_loop(tmp_path):
    """The timeline's records: one per step, the held save handed over in the step after a
    save, the pieces inside the step's wall time; the loop's functions are its own again after."""
    from nnx_posttrain.train import loop
    from tools.bench.loop_timeline import timed_loop

    before = (loop.compile_step, loop.Steps.one_step, loop.shard_batch)
    with timed_loop([]) as records:
        train_run("sft", *MICRO, "--steps", "4", "--log-every", "1", "--checkpoint.every", "2",
                  "--eval.every", "0", "--run-dir", tmp_path / "r")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert (loop.compile_step, loop.Steps.one_step, loop.shard_batch) == before
    assert "save_hook" in records[1] and records[2]["write_held"] > 0
    for r in records:
        assert 0 < r["dispatch"] <= r["wall_s"] and r["log_hook"] <= r["wall_s"]
        assert all(0 <= start <= r["wall_s"] for _, start, _ in r["at"])


def test_headline_reads_seconds_per_step_and_a_saves_cost_from_log_windows():
    """One step a log: the step after each save against the median of the others. Ten steps a
    log (the default run's): each window's seconds per step, and a save's cost in steps is the
    window's time beyond its steps at the median pace."""
    from tools.bench.headline import after_saves, step_seconds

    def log(step, tokens, seconds_since):  # num_tokens cumulative, the window's throughput
        return {"split": "train", "step": step, "num_tokens": tokens,
                "tokens_per_second": (tokens - log.last) / seconds_since if seconds_since else 0}

    records, tokens = [], 0
    for step in range(1, 8):  # one step a log, 100 tokens a step, 1 s a step, 1.5 s after saves
        log.last, tokens = tokens, tokens + 100
        records.append(log(step, tokens, None if step == 1 else 1.5 if step in (4, 7) else 1.0))
    read = after_saves(step_seconds(records), every=3)
    assert read["median_s"] == 1.0 and read["after_save_ratio"] == {4: 1.5, 7: 1.5}
    assert read["save_cost_steps"] == {4: 0.5, 7: 0.5}
    records, tokens = [{"split": "train", "step": 1, "num_tokens": 100}], 100
    for step in (10, 20, 30, 40):  # windows of 9 and 10 steps; a save at 20: window 30 + 2 s
        log.last, tokens = tokens, tokens + 100 * (step - records[-1]["step"])
        records.append(log(step, tokens, (step - records[-1]["step"]) + 2.0 * (step == 30)))
    read = after_saves(step_seconds(records), every=20)
    assert read["median_s"] == pytest.approx(1.0) and set(read["after_save_s"]) == {30}
    assert read["save_cost_steps"][30] == pytest.approx(2.0)


def test_replay_records_an_earlier_runs_measurements(tmp_path, monkeypatch):
    """``--replay FILE --record NAME``: the table of an earlier run's ``--json`` measurements
    (nothing measured), recorded under that run's command, the DPO rows' notes included."""
    from tools import results as readme

    monkeypatch.setattr(readme, "RESULTS", tmp_path / "results")
    measured = []
    for case, ms in (("sft", 100.0), ("dpo", 200.0)):
        for side, factor in (("ours", 1.0), ("trl", 1.5)):
            measured.append({"size": "tiny", "case": case, "side": side, "repeat": 0,
                             "ms_per_step": ms * factor, "cpu_ms_per_step": ms * factor,
                             "peak_rss_mb": 600.0, "compile_s": 5.0,
                             **({"forward_tokens": 1536} if (side, case) == ("ours", "dpo") else {})})
    earlier = tmp_path / "earlier.json"
    argv = ["--sizes", "tiny", "--cases", "sft,dpo", "--sides", "ours,trl", "--record", "x"]
    earlier.write_text(json.dumps({"argv": argv, "results": measured,
                                   "matmul_peak": {"tiny": {"peak_gflops": 100.0}}}))
    bench.main(["--replay", str(earlier), "--record", "replayed"])
    table = json.loads((tmp_path / "results" / "replayed.json").read_text())
    assert table["command"] == "python -m tools.bench " + " ".join(argv)
    assert [row[:4] for row in table["rows"]] == [["tiny", "sft", "100.0", "150.0"],
                                                  ["tiny", "dpo", "200.0", "300.0"]]
    assert any("1,536 tokens through the model" in note for note in table["notes"])


def test_replay_of_a_file_that_is_not_a_benchmarks_json_names_it(tmp_path):
    bad = tmp_path / "other.json"
    bad.write_text('{"rows": []}')
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(ToolError, match=f"^--replay {path}: not a --json file"):
            bench.main(["--replay", str(path)])
