"""Where a run's metrics and completions go (metrics_log.py, --report-to): metrics.jsonl and
TensorBoard by default, W&B when asked (offline here); logged completions of every evaluation
and of online rollouts (completions.jsonl, TensorBoard text), held-out reward of online methods."""

import glob
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnx_posttrain  # noqa: F401
from nnx_posttrain import metrics_log, progress
from support import MICRO, ROOT, records, train_run


def tensorboard_events(run_dir) -> list:
    """Every tensorboardX event of a run (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in glob.glob(str(Path(run_dir) / "tb" / "events.out.tfevents.*")):
        raw = Path(path).read_bytes()
        pos = 0
        while pos + 12 <= len(raw):
            (length,) = struct.unpack("<Q", raw[pos:pos + 8])
            out.append(event_pb2.Event.FromString(raw[pos + 12:pos + 12 + length]))
            pos += 12 + length + 4
    return out


def _text_tags(run_dir) -> dict:
    """{(tag, step): text} of the text summaries (tensorboardX appends /text_summary to a tag)."""
    return {(v.tag.removesuffix("/text_summary"), e.step): v.tensor.string_val[0].decode()
            for e in tensorboard_events(run_dir) for v in e.summary.value if v.tensor.string_val}


@pytest.mark.slow
def test_sft_eval_logs_its_completions(tmp_path):
    run_dir = tmp_path / "sft"
    train_run("sft", *MICRO, "--run-dir", run_dir, "--steps", "2", "--batching.batch-size", "4",
              "--eval.batches", "1", "--eval.exact-match", "6", "--eval.every", "0", recipe=False)
    rows = metrics_log.read_completions(run_dir)
    assert [r["step"] for r in rows] == [0] * 6 + [2] * 6  # every eval, every held-out prompt
    for row in rows:
        assert row["split"] == "eval"
        assert set(row) >= {"prompt", "completion", "reference", "score"}
        assert row["prompt"].startswith("<start_of_turn>user") and row["reference"].isdigit()
        assert row["score"] == float(row["completion"].strip() == row["reference"].strip())
    evals = records(run_dir, "eval")
    for ev in evals:  # the logged scores are the exact-match metric
        scores = [r["score"] for r in rows if r["step"] == ev["step"]]
        assert ev["exact_match"] == pytest.approx(np.mean(scores))
    text = _text_tags(run_dir)
    assert set(text) == {("eval/completions", 0), ("eval/completions", 2)}
    assert text[("eval/completions", 2)].startswith("| prompt | reference | completion | score |")


@pytest.mark.slow
def test_online_rollouts_are_logged_and_eval_reports_the_held_out_reward(tmp_path):
    from nnx_posttrain import data

    files = []
    for split, n in (("train", 16), ("eval", 6)):
        src = data.source("builtin", split, builtin="prompt_only")
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps({k: v for k, v in src[i].items()
                                            if not k.startswith("_")}) + "\n" for i in range(n)))
        files.append(str(path))
    run_dir = tmp_path / "grpo"
    train_run("grpo", *MICRO, "--init-from", "", "--run-dir", run_dir, "--data", files[0],
              "--eval-data", files[1], "--steps", "2", "--batching.batch-size", "8",
              "--algo.num-generations", "4", "--algo.max-completion-length", "4",
              "--algo.rewards", "exact_match,length", "--algo.log-completions", "3",
              "--eval.exact-match", "6", "--eval.every", "0", "--log-every", "1",
              "--checkpoint.every", "0")
    rows = metrics_log.read_completions(run_dir)
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 1, 1, 2, 2, 2]  # a sample of each logged step
    for row in train:
        assert set(row) >= {"prompt", "completion", "reward", "rewards/exact_match",
                            "rewards/length", "advantage"}
        assert row["reward"] == pytest.approx(row["rewards/exact_match"] + row["rewards/length"])
        assert row["rewards/length"] == pytest.approx(-len(row["completion"]) / 100)
    evals = records(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 2]
    for ev in evals:  # held-out reward = the reward functions on the greedy answers
        held = [r for r in rows if r["split"] == "eval" and r["step"] == ev["step"]]
        assert len(held) == 6
        assert ev["reward"] == pytest.approx(np.mean([r["reward"] for r in held]), abs=1e-6)
        assert ev["rewards/exact_match/mean"] == pytest.approx(
            np.mean([r["rewards/exact_match"] for r in held]), abs=1e-6)
        assert "exact_match" in ev and "rewards/length/mean" in ev
    tags = {tag for tag, _ in _text_tags(run_dir)}
    assert tags == {"train/completions", "eval/completions"}


def test_jsonl_writer_cuts_completions_on_resume(tmp_path):
    log = metrics_log.MetricsLog(tmp_path, echo=None, report_to="jsonl")
    for step in (1, 2, 3):
        log.log(step, "train", {"loss": 1.0 / step})
        log.completions(step, "train", [{"prompt": "p", "completion": f"c{step}", "reward": 0.5}])
    log.close()
    log = metrics_log.MetricsLog(tmp_path, keep_until=2, echo=None, report_to="jsonl")
    log.completions(3, "train", [{"prompt": "p", "completion": "again", "reward": np.float32(1)}])
    log.close()
    assert [r["step"] for r in metrics_log.read(tmp_path)] == [1, 2]
    rows = metrics_log.read_completions(tmp_path)
    assert [(r["step"], r["completion"]) for r in rows] == [(1, "c1"), (2, "c2"), (3, "again")]
    assert not (tmp_path / "tb").exists()  # tensorboard not asked for
    # a fresh run (keep_until -1) in the same directory starts both files anew
    metrics_log.MetricsLog(tmp_path, keep_until=-1, echo=None, report_to="jsonl").close()
    assert metrics_log.read_completions(tmp_path) == [] and metrics_log.read(tmp_path) == []


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    return env


def test_wandb_is_imported_only_when_asked(tmp_path):
    code = ("import sys; from pathlib import Path; from nnx_posttrain.metrics_log import MetricsLog;"
            f"log = MetricsLog(Path({str(tmp_path)!r})); log.log(1, 'train', {{'loss': 1.0}}); "
            "log.close(); assert 'wandb' not in sys.modules, 'wandb imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "tb").is_dir()


@pytest.mark.slow
def test_report_to_wandb_offline(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "wb"
    cmd = [sys.executable, "-m", "experiments.sft", *MICRO, "--run-dir", str(run_dir),
           "--steps", "2", "--batching.batch-size", "4", "--eval.batches", "1",
           "--eval.exact-match", "4", "--eval.every", "0", "--log-every", "1",
           "--report-to", "jsonl,wandb"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(WANDB_MODE="offline", WANDB_SILENT="true",
                                                 WANDB_PROJECT="nnx-test"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (run_dir / "tb").exists() and len(records(run_dir)) == 2
    (offline_run,) = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    (log_file,) = glob.glob(f"{offline_run}/run-*.wandb")
    raw = Path(log_file).read_bytes()
    for key in (b"train/loss", b"train/learning_rate", b"eval/exact_match", b"algo_name"):
        assert key in raw, key  # the metrics and the run's config went to the W&B run
    assert glob.glob(f"{offline_run}/files/media/table/eval/completions_*.table.json")
    run_id = (run_dir / "wandb" / "run_id").read_text()
    assert offline_run.endswith(run_id)


class _Stream:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        if self.tty is None:
            raise ValueError("I/O operation on closed file")
        return self.tty


def test_progress_bars_redraw_rarely_where_they_go_to_a_file():
    from tqdm.notebook import tqdm_notebook

    assert progress.interval(_Stream(True)) == progress.TERMINAL_INTERVAL == 0.1
    assert progress.interval(_Stream(False)) == progress.LOGGED_INTERVAL == 30.0
    assert progress.interval(_Stream(None)) == progress.LOGGED_INTERVAL  # a closed stream
    assert progress.interval(object()) == progress.LOGGED_INTERVAL  # no isatty at all
    # a notebook's bar is a widget updated in place, whatever sys.stderr says
    assert progress.interval(_Stream(False), tqdm_notebook) == progress.TERMINAL_INTERVAL
    import io

    from tqdm.auto import tqdm

    out = io.StringIO()  # not a terminal
    with progress.bar(total=3, file=out, desc="steps") as bar:
        assert bar.mininterval == progress.LOGGED_INTERVAL
        bar.update(1)
        bar.refresh()
        tqdm.write("[eval step 1] loss 1.0", file=out)  # as the loop's messages
        bar.update(2)
    # one line per redraw, the message on a line of its own: no carriage return, no blanks
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and lines[-1] == "", lines
    assert lines[0].startswith("steps:   0%") and lines[1].startswith("steps:  33%"), lines
    assert "[eval step 1] loss 1.0" in lines and lines[-2].startswith("steps: 100%"), lines
    assert all(line == line.strip() and line for line in lines[:-1]), lines


@pytest.mark.slow
def test_a_run_logged_to_a_file_has_its_evaluations_on_their_own_lines(tmp_path):
    """The loop's bar (stderr) and its evaluation lines (stdout) in one file, as ``> log 2>&1``:
    no line holds both."""
    log = tmp_path / "log"
    with log.open("w") as f:
        subprocess.run([sys.executable, "-m", "experiments.sft", "--model", "gemma_micro",
                        "--steps", "4", "--eval.every", "2", "--eval.batches", "1",
                        "--eval.exact-match", "0", "--run-dir", str(tmp_path / "run")],
                       stdout=f, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    text = log.read_text()
    assert "\r" not in text, text
    evals = [line for line in text.splitlines() if "[eval step" in line]
    assert len(evals) == 3 and all(line.startswith("[eval step") for line in evals), text
    assert any(line.startswith("sft: 100%") for line in text.splitlines()), text


def test_num_tokens_counts_every_attention_mask_and_goes_on_from_a_checkpoint():
    from nnx_posttrain.train.hooks import Throughput

    pair = {"chosen_attention_mask": np.ones((2, 5)), "rejected_attention_mask": np.ones((2, 3)),
            "loss_mask": np.ones((2, 5))}  # DPO's two sides; the loss mask is not a token count
    fresh, resumed, unknown = Throughput(), Throughput(seen=100), Throughput(seen=None)
    for t in (fresh, resumed, unknown):
        t.count(pair)
        t.count({"attention_mask": np.array([[1, 1, 0], [1, 0, 0]])})
    assert fresh.read()["num_tokens"] == 19 and resumed.read()["num_tokens"] == 119
    assert "num_tokens" not in unknown.read()  # a checkpoint from before the count: left out
    assert fresh.read()["num_tokens"] == 19  # cumulative: a later log keeps the total


def test_a_log_record_averages_the_steps_since_the_last_log_as_trl():
    from nnx_posttrain.train.step import interval_means

    nan = float("nan")
    steps = [
        {"loss": 1.0, "rewards/rejected": nan, "grad_norm": 5.0, "learning_rate": 0.1, "nonfinite": 0},
        {"loss": 2.5, "rewards/rejected": 3.0, "grad_norm": 6.0, "learning_rate": 0.2, "nonfinite": 0},
        {"loss": nan, "rewards/rejected": nan, "grad_norm": nan, "learning_rate": 0.3, "nonfinite": 1},
    ]
    out = interval_means(steps)
    # the mean over the steps that measured it (KTO's uncounted class, a skipped step: not)
    assert out["loss"] == 1.75 and out["rewards/rejected"] == 3.0
    assert out["learning_rate"] == 0.3 and out["nonfinite"] == 1  # the logged step's own
    assert math.isnan(out["grad_norm"])
    assert interval_means(steps[:1]) == {k: v for k, v in steps[0].items() if k != "rewards/rejected"}
    only_bad = interval_means(steps[2:])  # nothing finite to average: the values as they are
    assert math.isnan(only_bad["loss"]) and math.isnan(only_bad["rewards/rejected"])


@pytest.mark.slow
def test_logged_sft_metrics_are_the_means_of_their_steps(tmp_path):
    def run(name, every):
        args = [*MICRO, "--run-dir", str(tmp_path / name), "--steps", "6", "--log-every", every,
                "--eval.every", "0", "--eval.exact-match", "0", "--eval.batches", "1",
                "--batching.batch-size", "4", "--checkpoint.every", "0"]
        train_run("sft", *args)
        return {r["step"]: r for r in records(tmp_path / name)}

    each, every3 = run("each", "1"), run("every3", "3")
    assert sorted(every3) == [3, 6]
    for end in (3, 6):
        for key in ("loss", "mean_token_accuracy"):
            assert every3[end][key] == math.fsum(each[s][key] for s in range(end - 2, end + 1)) / 3
        for key in ("grad_norm", "learning_rate", "num_tokens"):
            assert every3[end][key] == each[end][key]
