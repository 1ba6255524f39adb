"""``nnx-posttrain compare`` and ``sweep``: fake run directories, plus one real two-point sweep."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from nnx_posttrain import cli, compare, errors
from nnx_posttrain.cli import sweep
from support import MICRO, cli_error

ROOT = Path(__file__).resolve().parents[1]


def _config(**over):
    cfg = {"model": "gemma_micro", "steps": 20, "seed": 0, "run_dir": "x", "algo": {},
           "optim": {"learning_rate": 1e-3, "schedule": "cosine"}, "lora": {"rank": 0}}
    for key, value in over.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def make_run(path: Path, records: list[dict], config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config if config is not None else _config()))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(eval_losses, eval_em, train_losses, every=10):
    out = []
    for i, loss in enumerate(train_losses):
        out.append({"step": (i + 1) * every // 2, "split": "train", "loss": loss, "grad_norm": 1.0})
    for i, (loss, em) in enumerate(zip(eval_losses, eval_em)):
        out.append({"step": i * every, "split": "eval", "loss": loss, "exact_match": em,
                    "perplexity": math.exp(loss) if isinstance(loss, float) else loss})
    return out


@pytest.fixture
def two_runs(tmp_path):
    a = make_run(tmp_path / "runs" / "a", _records([3.0, 1.0, 2.0], [0.1, 0.5, 0.3], [4.0, 3.0, 2.5, 2.0]))
    b = make_run(tmp_path / "runs" / "b", _records([3.0, "nan", 0.5], [0.0, 0.2, 0.2], [4.0, "nan"]),
                 _config(optim={"learning_rate": 3e-3}, seed=1, run_dir="y"))
    return a, b


# ---- compare ----

def test_summarize_final_best_and_min_max_rule(two_runs):
    a, b = compare.load_runs(two_runs)
    assert compare.summarize(a, "loss") == {"final": 2.0, "final_step": 20, "best": 1.0, "best_step": 10}
    assert compare.summarize(a, "exact_match") == {"final": 0.3, "final_step": 20, "best": 0.5, "best_step": 10}
    assert compare.summarize(a, "perplexity")["best_step"] == 10  # 'perplexity' -> min
    # NaN ("nan" strings in the log) is ignored for the best but shown as the final when last.
    s = compare.summarize(b, "loss")
    assert (s["best"], s["best_step"], s["final"]) == (0.5, 20, 0.5)
    assert compare.summarize(b, "exact_match")["best_step"] == 10  # ties: earliest step
    assert math.isnan(compare.summarize(b, "loss", split="train")["final"])
    assert compare.summarize(a, "no_such_metric") is None


@pytest.mark.parametrize("name,lower", [("loss", True), ("nll_loss", True), ("perplexity", True),
                                        ("kl", True), ("exact_match", False),
                                        ("rewards/accuracies", False), ("rewards/chosen", False),
                                        ("rewards/rejected", True), ("logps/rejected", True)])
def test_lower_is_better(name, lower):
    assert compare.lower_is_better(name) is lower


def test_summary_table_markdown(two_runs):
    runs = compare.load_runs(two_runs)
    table = compare.summary_table(runs, ["loss", "exact_match"])
    lines = table.splitlines()
    assert lines[0] == ("| run | loss final | loss best (min) @ step | exact_match final | "
                        "exact_match best (max) @ step |")
    assert lines[2] == "| a | 2.0000 | 1.0000 @ 10 | 0.3000 | 0.5000 @ 10 |"
    assert lines[3] == "| b | 0.5000 | 0.5000 @ 20 | 0.2000 | 0.2000 @ 10 |"
    # Default: every eval metric.
    assert "perplexity final" in compare.summary_table(runs)


def test_config_diff_only_differing_keys(two_runs, tmp_path):
    runs = compare.load_runs(two_runs)
    diff = compare.config_diff(runs)
    assert diff == {"optim.learning_rate": [1e-3, 3e-3], "seed": [0, 1]}  # run_dir left out
    table = compare.config_diff_table(runs)
    assert "| optim.learning_rate | 0.001 | 0.003 |" in table
    assert "model" not in table and "schedule" not in table
    # A key only one run has differs; identical configs have no differences.
    c = make_run(tmp_path / "c", [], _config(lora={"rank": 0, "alpha": 8}))
    assert compare.config_diff(compare.load_runs([two_runs[0], c]))["lora.alpha"] == ["-", 8]
    assert compare.config_diff(compare.load_runs([two_runs[0], two_runs[0]])) == {}
    # SFT's empty algo group against another algorithm's settings: only the settings, one by one;
    # what a resume was allowed to change is not a difference between runs
    sft_like = make_run(tmp_path / "sft", [], _config(algo={}, resume_changed=""))
    dpo_like = make_run(tmp_path / "dpo", [], _config(algo={"beta": 0.1},
                                                      resume_changed="optim.learning_rate"))
    assert compare.config_diff(compare.load_runs([sft_like, dpo_like])) == {"algo.beta": ["-", 0.1]}


def test_flatten():
    assert compare.flatten({"a": {"b": 1, "c": {"d": None}}, "e": {}, "f": [1]}) == {
        "a.b": 1, "a.c.d": None, "e": {}, "f": [1]}


def test_plots_written_and_cli_default_out(two_runs, capsys):
    assert cli.main(["compare", *map(str, two_runs), "--metrics", "loss,exact_match"]) == 0
    out_dir = two_runs[0].parent / "compare"  # common parent of the runs
    plots = [out_dir / "loss.png", out_dir / "exact_match.png"]
    assert sorted(out_dir.iterdir()) == sorted(plots)
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| a | 2.0000 | 1.0000 @ 10 |" in printed and str(out_dir / "loss.png") in printed
    assert "| seed | 0 | 1 |" in printed


def test_plot_metric_with_slash_and_explicit_out(two_runs, tmp_path):
    runs = compare.load_runs(two_runs)
    paths = compare.plot(runs, ["loss", "rewards/margins"], tmp_path / "pics")
    assert paths == [tmp_path / "pics" / "loss.png"]  # a metric no run logged gives no file


def test_same_basename_labels(tmp_path):
    a = make_run(tmp_path / "s1" / "run", _records([1.0], [0.1], [1.0]))
    b = make_run(tmp_path / "s2" / "run", _records([2.0], [0.2], [2.0]))
    assert [r.label for r in compare.load_runs([a, b])] == ["s1/run", "s2/run"]


def test_bad_run_dir_is_a_clear_error(tmp_path, two_runs, capsys):
    (tmp_path / "empty").mkdir()
    cli_error(capsys, ["compare", str(two_runs[0]), str(tmp_path / "empty")],
              match=r"error: .*empty.*metrics\.jsonl")
    with pytest.raises(errors.RunDirError, match="missing"):
        compare.load_run(tmp_path / "missing")


def test_compare_names_an_unknown_metric_and_reads_a_killed_runs_cut_last_line(tmp_path):
    run = make_run(tmp_path / "a", _records([1.0, 0.5], [0.1, 0.2], [1.2, 0.9]))
    with pytest.raises(errors.ConfigError, match=r"--metrics los: not logged by these runs; they log "
                                         r"exact_match, grad_norm, loss, perplexity"):
        compare.compare([run], metrics=["los"], out=tmp_path / "c", echo=lambda m: None)
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 30, "spl')
    result = compare.compare([run], metrics=["loss"], out=tmp_path / "c", echo=lambda m: None)
    assert "0.5" in result["summary"]  # the cut line left out, as a resume drops it
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:1] + ["{oops"] + lines[1:]) + "\n")
    with pytest.raises(errors.RunDirError, match=r"metrics.jsonl:2: not JSON"):
        compare.compare([run], out=tmp_path / "c", echo=lambda m: None)


# ---- sweep ----

def test_grid_expansion_and_names():
    grid = sweep.parse_grid(["algo.beta=2,2.5", "algo.gamma_beta_ratio=0.3,0.5", "seed=0"])
    assert grid == {"algo.beta": ["2", "2.5"], "algo.gamma_beta_ratio": ["0.3", "0.5"], "seed": ["0"]}
    points = sweep.expand(grid)
    assert len(points) == 4
    assert [sweep.point_name(p) for p in points] == [
        "algo.beta=2,algo.gamma_beta_ratio=0.3,seed=0",
        "algo.beta=2,algo.gamma_beta_ratio=0.5,seed=0",
        "algo.beta=2.5,algo.gamma_beta_ratio=0.3,seed=0",
        "algo.beta=2.5,algo.gamma_beta_ratio=0.5,seed=0",
    ]
    cmd = sweep.command("simpo", Path("out/n"), points[0], ["--steps", "5"])
    assert cmd[1:] == ["-m", "nnx_posttrain.cli", "simpo", "--run-dir", "out/n", "--algo.beta",
                       "2", "--algo.gamma-beta-ratio", "0.3", "--seed", "0", "--steps", "5"]


@pytest.mark.parametrize("spec,message", [
    (["algo.beta"], "expected KEY=V1,V2"),
    (["=1,2"], "expected KEY=V1,V2"),
    (["algo..beta=1"], "expected KEY=V1,V2"),
    (["algo.beta="], "empty value"),
    (["algo.beta=1,,2"], "empty value"),
    (["algo.beta=1,1"], "repeated value"),
    (["algo.beta=1", "algo.beta=2"], "given twice"),
    (["run_dir=a,b"], "run-dir"),
    ([], "at least one"),
])
def test_bad_grid_messages(spec, message):
    with pytest.raises(sweep.GridError, match=message):
        sweep.parse_grid(spec)


def test_bad_grid_exits_cleanly(tmp_path, capsys):
    cli_error(capsys, ["sweep", "simpo", "--grid", "algo.beta", "--out", str(tmp_path)],
              match="error: bad grid item 'algo.beta'")
    cli_error(capsys, ["sweep", "nope", "--grid", "a=1", "--out", str(tmp_path)],
              match="error: no algorithm 'nope'")


def test_is_complete(tmp_path):
    done = make_run(tmp_path / "done", [{"step": 10, "split": "train", "loss": 1.0},
                                        {"step": 20, "split": "train", "loss": 1.0},
                                        {"step": 20, "split": "eval", "loss": 1.0}])
    half = make_run(tmp_path / "half", [{"step": 10, "split": "train", "loss": 1.0},
                                        {"step": 10, "split": "eval", "loss": 1.0}])
    assert sweep.is_complete(done)
    assert not sweep.is_complete(half)
    assert not sweep.is_complete(tmp_path / "absent")
    (half / "metrics.jsonl").write_text((half / "metrics.jsonl").read_text() + '{"step": 20, "spl')
    assert not sweep.is_complete(half)  # a cut last line is ignored, not fatal


def test_sweep_skips_complete_and_reruns_incomplete(tmp_path, monkeypatch):
    out = tmp_path / "sw"
    make_run(out / "seed=0", [{"step": 20, "split": "train", "loss": 1.0},
                              {"step": 20, "split": "eval", "loss": 1.0}])
    make_run(out / "seed=1", [{"step": 10, "split": "train", "loss": 1.0}])
    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 20, "split": "train", "loss": 0.5}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    state = sweep.sweep("sft", ["seed=0,1"], out, ["--steps", "20"], echo=lambda m: None)
    assert len(calls) == 1 and calls[0][-4:] == ["--seed", "1", "--steps", "20"]
    assert [p["status"] for p in state["points"]] == ["skipped (complete)", "done"]
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["grid"] == {"seed": ["0", "1"]}
    assert saved["points"][1]["run_dir"] == str(out / "seed=1")
    assert [p["status"] for p in saved["points"]] == ["skipped (complete)", "done"]
    assert (out / "compare" / "loss.png").stat().st_size > 0


def test_sweep_failed_point_is_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 2))
    cli_error(capsys, ["sweep", "sft", "--grid", "seed=0", "--out", str(tmp_path)],
              match="error: 1 of 1 sweep points did not complete")
    assert json.loads((tmp_path / "sweep.json").read_text())["points"][0]["status"] == "failed (exit 2)"


def test_sweep_refuses_a_bad_point_before_running_any(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd: calls.append(cmd))
    with pytest.raises(errors.ConfigError, match=r"sweep point optim.learning_rate=abc: sft "
                                                 r"refuses its options .*nothing was run"):
        sweep.sweep("sft", ["optim.learning_rate=1e-3,abc"], tmp_path, echo=print)
    assert calls == [] and "could not convert string to float: 'abc'" in capsys.readouterr().err
    with pytest.raises(errors.ConfigError, match="sweep point optim.lr=1e-3"):
        sweep.sweep("experiments.sft", ["optim.lr=1e-3"], tmp_path, echo=print)
    assert calls == []


def test_a_complete_point_whose_command_changed_is_run_again(tmp_path, monkeypatch, capsys):
    """A rerun with other options is not skipped as complete: the point's experiment judges it
    (its resume refuses a new seed, continues with more steps), and sweep.json says what ran."""
    out = tmp_path / "sw"
    make_run(out / "seed=0", [{"step": 20, "split": "train", "loss": 1.0}])
    calls = []
    monkeypatch.setattr(sweep.subprocess, "run",
                        lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1))
    sweep.sweep("sft", ["seed=0"], out, ["--steps", "20"], compare=False, echo=lambda m: None)
    assert calls == []  # complete, same command: skipped
    cli_error(capsys, ["sweep", "sft", "--grid", "seed=0", "--out", str(out), "--no-compare", "--",
                       "--steps", "20", "--optim.learning-rate", "1e-2"],
              match="1 of 1 sweep points did not complete")
    assert len(calls) == 1 and calls[0][-2:] == ["--optim.learning-rate", "1e-2"]
    point = json.loads((out / "sweep.json").read_text())["points"][0]
    assert point["status"] == "failed (exit 1)" and point["command"][-1] == "1e-2"


def test_ctrl_c_stops_the_whole_sweep(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(sweep.subprocess, "run",
                        lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 130))
    assert cli.main(["sweep", "sft", "--grid", "seed=0,1", "--out", str(tmp_path)]) == 130
    assert len(calls) == 1
    assert "interrupted at point 1/2 (seed=0)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["status"] for p in saved["points"]] == ["interrupted", "pending"]


@pytest.mark.slow
def test_real_sweep_end_to_end_and_resume(tmp_path, capsys, monkeypatch):
    """The sweep command (here, in this process) runs each point as a training process."""
    from support import command_output

    out = tmp_path / "sweep"
    argv = ["sweep", "sft", "--grid", "optim.learning_rate=1e-3,3e-3", "--out", str(out), "--",
            *MICRO, "--steps", "3", "--eval.every", "0", "--eval.exact-match", "0",
            "--eval.batches", "1", "--batching.batch-size", "4", "--checkpoint.every", "0"]
    code, first, err = command_output(capsys, monkeypatch, argv)
    assert code == 0, err[-3000:]
    names = ["optim.learning_rate=1e-3", "optim.learning_rate=3e-3"]
    for name in names:
        assert sweep.is_complete(out / name)
        assert json.loads((out / name / "config.json").read_text())["optim"]["learning_rate"] in (1e-3, 3e-3)
    state = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in state["points"]] == ["done", "done"]
    assert "| optim.learning_rate | 0.001 | 0.003 |" in first

    code, second, err = command_output(capsys, monkeypatch, argv)
    assert code == 0, err[-3000:]
    assert second.count("complete, skipped") == 2  # no training process started
    assert "loading model" not in second
    state = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in state["points"]] == ["skipped (complete)"] * 2
    assert (out / "compare" / "loss.png").stat().st_size > 0
    assert "loss final" in (out / "compare" / "summary.md").read_text()


def test_boolean_grid_values_become_tyro_flags():
    cmd = sweep.command("sft", Path("r"), {"batching.packing": "false",
                                                        "batching.shuffle": "true"}, [])
    assert cmd[-2:] == ["--batching.no-packing", "--batching.shuffle"]


# ----------------------------------------------------------------------------- tools.bench.targets


def test_bench_targets_read_the_recorded_benchmarks(tmp_path, monkeypatch, capsys):
    """Each target row is computed from the results files, met or not by its threshold; a matmul
    share over 100% (peak and step under different loads) is 'unknown', not a pass."""
    from tools import results as readme
    from tools.bench import targets as bench_targets

    def side(size, case, side, ms, cpu, rss, bound=1.0):
        return dict(size=size, case=case, side=side, ms_per_step=ms, cpu_ms_per_step=cpu,
                    peak_rss_mb=rss, bound_ms=bound, repeat=0)

    def write(name, data, rows=(), notes=()):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"name": name, "commit": "abc", "date": "2026-12-01", "rows": list(rows),
             "notes": list(notes), "data": data}))

    write("bench", {"results": [
        side("tiny", "sft", "ours", 50, 50, 660), side("tiny", "sft", "trl", 70, 60, 600),
        side("tiny", "sft", "tunix", 65, 65, 700),
        side("medium", "dpo", "ours", 100, 100, 1, bound=80), side("medium", "dpo", "trl", 110, 110, 1),
        side("medium", "sft", "ours", 100, 100, 1, bound=120), side("medium", "sft", "tunix", 90, 90, 1)]})
    write("bench_long", {"results": [
        side("long_2k", "sft_packed", "ours", 10, 10, 1000), side("long_2k", "sft_packed", "trl", 30, 30, 700),
        side("long_8k", "sft_packed", "ours", 50, 50, 5000), side("long_8k", "sft_packed", "trl", 55, 55, 2000)]})
    write("bench_rollout", {"seconds": {"sampler": 1.0, "tunix": 1.5}}, rows=[["m", "64"]])
    monkeypatch.setattr(readme, "RESULTS", tmp_path)
    assert bench_targets.main([]) == 0
    out = json.loads((tmp_path / "bench_targets.json").read_text())
    got = {r[0]: (r[1], r[2]) for r in out["rows"]}
    assert got[">= 1.2x the faster peer, tiny sft"] == ("1.30x tunix (50.0 vs 65.0 ms); CPU time 1.20x", "yes")
    assert got["peak RSS <= 1.1x TRL's, tiny sft"][1] == "yes"  # 660 / 600 = 1.10
    assert got[">= 1.2x the faster peer, medium dpo"][1] == "no"  # 1.10x
    assert got[">= 75% of the matmul bound, medium dpo"] == ("80% (80 of 100 ms)", "yes")
    assert got[">= 75% of the matmul bound, medium sft"][1] == "unknown"  # 120%
    assert got["long context: peak RSS not growing with T^2 (2,048 -> 8,192 tokens: <= 4x)"][1] == "no"
    assert got[">= 1.2x TRL, long_8k sft_packed"][1] == "no"
    assert got[">= 1.2x Tunix, GRPO rollout sampling (batch 64)"] == ("1.50x (1.000 vs 1.500 s)", "yes")
    (tmp_path / "bench.json").unlink()
    assert bench_targets.main(["--record", "none"]) == 2
    assert "no results/bench.json" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_run_says_where_a_runs_step_spends_its_time(tmp_path):
    """tools.bench.profile_run traces a run's own steps (a fresh process: XLA:CPU records its
    operations in the trace only when asked at start) and breaks the step down by operation."""
    import os
    import sys

    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.profile_run", "sft", *MICRO, "--data", "builtin",
         "--steps", "2", "--eval.every", "0", "--eval.exact-match", "0",
         "--batching.batch-size", "4", "--run-dir", str(tmp_path / "run"), "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ops_ms_per_step"] > 0
    # the step program's own operations only: no compilation among them, the model's parts named
    assert not any("Compile" in k or "compile" in k for k in result["by_kind_ms"])
    assert any(k.startswith(("attention", "ffw")) for k in result["by_component_ms"])


def test_plan_table_update_keeps_the_other_rows_and_says_when_each_was_compiled(tmp_path):
    """``tools.plan_table --update``: the new row takes its place among the recorded ones (ROWS'
    order), the recorded notes stay, and a note says which rows were compiled at which commit;
    a second update moves its row from the first update's commit to its own."""
    from tools import plan_table

    def line(row, value):
        model, algorithm, tuning, topology = plan_table._key(row)
        return [model, algorithm, tuning, topology, "fsdp 16", value]

    recorded = tmp_path / "plan_table.json"
    rows = plan_table.ROWS
    recorded.write_text(json.dumps({
        "commit": "aaa", "date": "2026-12-05", "rows": [line(rows[0], "old"), line(rows[5], "old")],
        "notes": ["how", "(a) a footnote"]}))
    table, notes = plan_table.merged(recorded, [line(rows[-1], "new"), line(rows[0], "new")],
                                     [rows[-1], rows[0]])
    assert [r[5] for r in table] == ["new", "old", "new"] and table[-1][0] == rows[-1].split("/")[0]
    assert notes == ["(a) a footnote", f"Compiled at aaa (2026-12-05): {rows[5]}; "
                     f"this table's commit: {rows[-1]}, {rows[0]}"]
    recorded.write_text(json.dumps({"commit": "bbb", "date": "2026-12-06", "rows": table,
                                    "notes": ["how", *notes]}))
    _, notes = plan_table.merged(recorded, [line(rows[5], "newer")], [rows[5]])
    assert notes[-1] == (f"Compiled at bbb (2026-12-06): {rows[-1]}, {rows[0]}; "
                         f"this table's commit: {rows[5]}")


def test_suite_compile_records_a_tests_jax_seconds_and_ranks_files_by_compiling(tmp_path,
                                                                                 monkeypatch):
    """The plugin's line for a test holds what JAX reported in it (a jit of a new function:
    trace, lower and compile all above zero); the summary ranks files by compile seconds."""
    import jax
    import jax.numpy as jnp

    from tools import suite_compile

    out = tmp_path / "suite_compile.jsonl"
    monkeypatch.setenv("SUITE_COMPILE_OUT", str(out))
    suite_compile.pytest_configure(None)
    x = jax.device_put(jnp.arange(5.0))
    try:
        suite_compile.pytest_runtest_protocol(None, None)
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 7.0)(x).block_until_ready()
        suite_compile.pytest_runtest_logfinish("tests/test_a.py::test_jit", None)
    finally:
        suite_compile.pytest_unconfigure(None)
    line = json.loads(out.read_text())
    assert line["test"] == "tests/test_a.py::test_jit"
    assert all(line[k] > 0 for k in ("trace", "lower", "compile")) and line["wall"] > 0
    assert line["programs"] == 1  # the jitted function: one program
    with out.open("a") as more:
        more.write(json.dumps({"test": "tests/test_b.py::t", "wall": 9.0, "trace": 0.0,
                               "lower": 0.0, "compile": 8.0}) + "\n")
    table = suite_compile.summary(out).splitlines()
    assert table[0].startswith("2 tests: wall ")
    files = table[table.index("file | wall | trace | lower | compile") + 1:][:2]
    assert [f.split(" | ")[0] for f in files] == ["tests/test_b.py", "tests/test_a.py"]
