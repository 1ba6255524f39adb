"""Fault cases, tried as a new user would: each runs real commands on the micro model (a few
steps) and classifies what happened.

    ok         it did what it should (trained, resumed, fell back, skipped, warned)
    message    it refused, with a message and no traceback, as it should
    traceback  it ended in a Python traceback
    data loss  it lost or damaged data, or gave a silently wrong result (NaN checkpoints kept,
               config.json or metrics.jsonl overwritten, another run's state trained on)
    unclear    it ran on without saying what it should have said (a refusal expected)

    python tests/fault_cases.py --json out.json [--root DIR] [--only NAME]   # run the cases
    python tests/fault_cases.py --table [before.json] after.json             # results/fault_cases.json

``--root`` runs another checkout's code (e.g. the commit before a fix) with this file's cases.
Each case runs one to three processes of ~10 s: all of them take about 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # run as a script: tests/support.py
sys.path.insert(1, str(ROOT))  # and the repository (tools.results)
from support import FAST_STEPS as FAST, MICRO  # noqa: E402  (one copy of the micro settings)
from tools import ToolError, exit_status  # noqa: E402
CLASSES = ["ok", "message", "traceback", "data loss", "unclear"]


class Case:
    def __init__(self, root: Path, work: Path):
        self.root, self.work = root, work
        self.outs: list[subprocess.CompletedProcess] = []

    def run(self, algo, run_dir, *args, fast=True, timeout=900, env=None):
        cmd = [sys.executable, "-m", f"experiments.{algo}", *MICRO, "--run-dir", str(run_dir),
               *(FAST if fast else []), *args]
        if algo != "sft" and "--init-from" not in args:
            cmd += ["--init-from", ""]
        full_env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(self.root),
                                      **(env or {})}.items() if v is not None}
        try:
            out = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True,
                                 timeout=timeout, env=full_env)
        except subprocess.TimeoutExpired as exc:
            out = _timed_out(cmd, exc)
        self.outs.append(out)
        return out

    def start(self, algo, run_dir, *args):
        cmd = [sys.executable, "-m", f"experiments.{algo}", *MICRO, "--run-dir", str(run_dir),
               *FAST, *args]
        return subprocess.Popen(cmd, cwd=self.root, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(self.root)))

    def command(self, *args, timeout=900, env=None):
        """``nnx-posttrain ARGS`` (``python -m nnx_posttrain.cli``) in a process of its own."""
        try:
            out = subprocess.run([sys.executable, "-m", "nnx_posttrain.cli", *map(str, args)],
                                 cwd=self.root, capture_output=True, text=True, timeout=timeout,
                                 env={**os.environ, "PYTHONPATH": str(self.root), **(env or {})})
        except subprocess.TimeoutExpired as exc:
            out = _timed_out(args, exc)
        self.outs.append(out)
        return out

    def python(self, code: str, *args, env=None):
        out = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=self.root,
                             capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHONPATH": str(self.root), **(env or {})})
        self.outs.append(out)
        return out

    def file(self, name: str, lines) -> Path:
        path = self.work / name
        with path.open("wb") as f:
            for line in lines:
                f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
        return path


def _timed_out(cmd, exc: subprocess.TimeoutExpired) -> subprocess.CompletedProcess:
    """A process killed at its time limit, as a finished one of status 124 (its output as text:
    ``TimeoutExpired`` keeps bytes)."""
    def text(b):
        return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
    return subprocess.CompletedProcess(cmd, 124, text(exc.stdout), text(exc.stderr))


# ----------------------------------------------------------------------------- judging


def traceback(out) -> bool:
    return "Traceback (most recent call last)" in (out.stderr + out.stdout)


def refused(out, *words) -> str:
    """A refusal expected: 'message' (non-zero, no traceback; naming ``words`` if given)."""
    if traceback(out):
        return "traceback"
    if out.returncode == 0:
        return "unclear"
    text = out.stdout + out.stderr
    return "message" if all(w.lower() in text.lower() for w in words) else "unclear"


def works(out, ok: bool = True, *words) -> str:
    if traceback(out):
        return "traceback"
    text = out.stdout + out.stderr
    if out.returncode == 0 and ok and all(w.lower() in text.lower() for w in words):
        return "ok"
    return "unclear"


def metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def steps_of(run_dir) -> list[int]:
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def checkpoints_finite(case, run_dir) -> bool:
    code = (
        "import sys, numpy as np\n"
        "from nnx_posttrain import runs\n"
        f"d = {str(run_dir)!r}\n"
        "from pathlib import Path\n"
        "bad = []\n"
        "for s in sorted(int(p.name) for p in (Path(d)/'checkpoints').iterdir() if p.name.isdigit()):\n"
        "    r = runs.load(d, step=s)\n"
        "    if not all(np.isfinite(np.asarray(v)).all() for v in runs.param_leaves(r.state).values()):\n"
        "        bad.append(s)\n"
        "print('NONFINITE', bad)\n")
    out = case.python(code)
    return out.returncode == 0 and "NONFINITE []" in out.stdout


# ----------------------------------------------------------------------------- the cases

CASES = []


def case(category):
    def register(fn):
        CASES.append((fn.__name__, category, fn))
        return fn
    return register


def _option_case(name, args, words=(), algo="sft"):
    def fn(c):
        return refused(c.run(algo, c.work / "run", *args), *words)
    fn.__name__ = name
    CASES.append((name, "options", fn))


for _name, _args, _words in [
    ("lr_nan", ["--optim.learning-rate", "nan"], ["learning-rate"]),
    ("lr_inf", ["--optim.learning-rate", "inf"], ["learning-rate"]),
    ("lr_negative", ["--optim.learning-rate", "-1"], ["learning-rate"]),
    ("weight_decay_nan", ["--optim.weight-decay", "nan"], ["weight-decay"]),
    ("b1_nan", ["--optim.b1", "nan"], ["b1"]),
    ("b2_one", ["--optim.b2", "1.5"], ["b2"]),
    ("max_grad_norm_negative", ["--optim.max-grad-norm", "-1"], ["max-grad-norm"]),
    ("warmup_negative", ["--optim.warmup-steps", "-1"], ["warmup"]),
    ("min_lr_ratio_2", ["--optim.min-lr-ratio", "2"], ["min-lr-ratio"]),
    ("steps_negative", ["--steps", "-1"], ["--steps"]),
    ("batch_size_zero", ["--batching.batch-size", "0"], ["batch-size"]),
    ("batch_not_multiple", ["--batching.batch-size", "3", "--batching.grad-accum", "2"], ["grad-accum"]),
    ("max_length_one", ["--batching.max-length", "1"], ["max-length"]),
    ("max_length_huge", ["--batching.max-length", "2000000"], ["memory"]),
    ("logprob_chunk_negative", ["--logprob-chunk", "-1"], ["logprob-chunk"]),
    ("eval_batches_negative", ["--eval.batches", "-1"], ["eval.batches"]),
    ("eval_every_negative", ["--eval.every", "-1"], ["eval.every"]),
    ("exact_match_negative", ["--eval.exact-match", "-1"], ["exact-match"]),
    ("max_new_tokens_zero", ["--eval.max-new-tokens", "0"], ["max-new-tokens"]),
    ("checkpoint_every_negative", ["--checkpoint.every", "-1"], ["checkpoint.every"]),
    ("checkpoint_keep_zero", ["--checkpoint.keep", "0"], ["checkpoint.keep"]),
    ("keep_best_typo", ["--checkpoint.keep-best", "exact_mtch"], ["exact_mtch"]),
    ("keep_best_without_exact_match", ["--checkpoint.keep-best", "exact_match"], ["exact"]),
    ("log_every_zero", ["--log-every", "0"], ["log-every"]),
    ("lora_rank_negative", ["--lora.rank", "-1"], ["lora.rank"]),
    ("lora_targets_unknown", ["--lora.rank", "2", "--lora.targets", "nonsense"], ["nonsense"]),
    ("mesh_too_many_devices", ["--mesh.data", "3"], ["mesh"]),
    ("model_unknown", ["--model", "no_such_model"], ["no_such_model"]),
    ("dtype_invalid", ["--dtype", "float16"], ["dtype"]),
    ("option_unknown", ["--no-such-option", "1"], ["no-such-option"]),
    ("steps_not_a_number", ["--steps", "abc"], ["steps"]),
    ("resume_changed_unknown", ["--resume-changed", "nonsense"], ["nonsense"]),
]:
    _option_case(_name, _args, _words)
_option_case("dpo_beta_nan", ["--algo.beta", "nan"], ["beta"], algo="dpo")


@case("run dir")
def run_dir_is_a_file(c):
    path = c.work / "file"
    path.write_text("x")
    return refused(c.run("sft", path), str(path))


@case("run dir")
def run_dir_read_only(c):
    path = c.work / "ro"
    path.mkdir()
    locked = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    if not locked:
        path.chmod(0o555)
    try:
        return refused(c.run("sft", path), str(path))
    finally:
        if locked:
            subprocess.run(["chattr", "-i", str(path)])
        path.chmod(0o755)


@case("run dir")
def run_dir_new_parents(c):
    out = c.run("sft", c.work / "a" / "b" / "run")
    return works(out, (c.work / "a" / "b" / "run" / "checkpoints" / "4").is_dir())


@case("run dir")
def resume_flag_without_checkpoint(c):
    return refused(c.run("sft", c.work / "run", "--resume"), "no complete checkpoint")


@case("run dir")
def resume_flag_with_checkpoint(c):
    c.run("sft", c.work / "run")
    out = c.run("sft", c.work / "run", "--resume", "--steps", "6")
    return works(out, 6 in steps_of(c.work / "run"), "resumed")


# ----------------------------------------------------------------------------- data


def _pc(i):
    return {"prompt": f"What is {i} + 1?", "completion": str(i + 1)}


def _data_case(name, lines, words=(), extra=(), expect="refuse", algo="sft", silent="unclear"):
    """``silent``: the outcome when a refusal was expected and it trained (rc 0)."""
    def fn(c):
        path = c.file("data.jsonl", lines)
        out = c.run(algo, c.work / "run", "--data", str(path), *extra)
        if expect == "refuse":
            return silent if out.returncode == 0 else refused(out, *words)
        return works(out, (c.work / "run" / "checkpoints").is_dir(), *words)
    fn.__name__ = name
    CASES.append((name, "data", fn))


_GOOD = [_pc(i) for i in range(8)]
_data_case("data_malformed_json", [*_GOOD, b'{"prompt": "x", \n'], ["data.jsonl:9"])
_data_case("data_invalid_utf8", [*_GOOD, b'{"prompt": "\xff\xfe", "completion": "1"}\n'],
           ["data.jsonl:9", "utf-8"])
_data_case("data_invalid_utf8_skip_bad", [*_GOOD, b'{"prompt": "\xff\xfe", "completion": "1"}\n'],
           ["1 bad"], ["--batching.skip-bad"], expect="work")
_LONE_SURROGATE = b'{"prompt": "a \\ud800 b", "completion": "1"}\n'
_data_case("data_lone_surrogate", [*_GOOD, _LONE_SURROGATE], ["data.jsonl:9", "prompt", "UTF-8"])
_data_case("data_lone_surrogate_skip_bad", [*_GOOD, _LONE_SURROGATE], ["1 bad"],
           ["--batching.skip-bad"], expect="work")
_data_case("data_nested_200k_deep",
           [*_GOOD, b'{"prompt": "x", "meta": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"],
           ["data.jsonl:9", "nested"])
_data_case("data_record_over_16mb",
           [*_GOOD, b'{"prompt": "' + b"word " * 3_500_000 + b'", "completion": "1"}\n'],
           ["data.jsonl:9", "MAX_RECORD_BYTES"])
_data_case("data_missing_column", [*_GOOD, {"prompt": "x"}], ["data.jsonl:9"])
_data_case("data_wrong_type", [*_GOOD, {"prompt": "x", "completion": 3}], ["data.jsonl:9"])
_data_case("data_empty_completion", [*_GOOD, {"prompt": "x", "completion": ""}], ["data.jsonl:9"])
_data_case("data_blank_only", [b"\n", b"\n"], ["no records"])
_data_case("data_all_bad_skip_bad", [{"x": 1}, {"y": 2}], ["data.jsonl:1"],
           ["--batching.skip-bad"])
_data_case("data_no_loss_token", [{"prompt": "word " * 40, "completion": "1"}] * 8,
           ["max-length"], silent="data loss")  # trains on nothing: loss NaN
_data_case("dpo_no_loss_token", [{"prompt": "word " * 40, "chosen": "1", "rejected": "2"}] * 8,
           ["max-length"], algo="dpo", silent="data loss")
_data_case("dpo_chosen_equals_rejected",
           [{"prompt": f"q{i}", "chosen": "same", "rejected": "same"} for i in range(8)],
           ["chosen == rejected"], expect="work", algo="dpo")
_data_case("data_wrong_kind_for_dpo", _GOOD, ["preference"], algo="dpo")
_data_case("data_packing_with_dpo",
           [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(8)], ["packing"],
           ["--batching.packing"], algo="dpo")


@case("data")
def data_missing_file(c):
    return refused(c.run("sft", c.work / "run", "--data", str(c.work / "nope.jsonl")), "nope.jsonl")


@case("data")
def data_empty_file(c):
    path = c.file("empty.jsonl", [])
    return refused(c.run("sft", c.work / "run", "--data", str(path)), "no records")


@case("data")
def data_unsupported_suffix(c):
    path = c.work / "data.txt"
    path.write_text("hello\n")
    return refused(c.run("sft", c.work / "run", "--data", str(path)), "unsupported")


@case("data")
def data_directory_not_a_dataset(c):
    (c.work / "dir").mkdir()
    return refused(c.run("sft", c.work / "run", "--data", str(c.work / "dir")), "datasets")


@case("data")
def data_corrupt_parquet(c):
    path = c.work / "data.parquet"
    path.write_bytes(b"PAR1 not really")
    return refused(c.run("sft", c.work / "run", "--data", str(path)), "parquet")


@case("data")
def mixture_with_an_empty_part(c):
    a, b = c.file("a.jsonl", _GOOD), c.file("b.jsonl", [])
    return refused(c.run("sft", c.work / "run", "--data", f"{a}:0.5,{b}:0.5"), "b.jsonl")


@case("data")
def mixture_bad_weight(c):
    a = c.file("a.jsonl", _GOOD)
    return refused(c.run("sft", c.work / "run", "--data", f"{a}:x"), "weight")


@case("data")
def mixture_zero_weight(c):
    a, b = c.file("a.jsonl", _GOOD), c.file("b.jsonl", _GOOD)
    return refused(c.run("sft", c.work / "run", "--data", f"{a}:0,{b}:1"), "weight")


@case("data")
def mixture_weight_missing_on_one(c):
    a, b = c.file("a.jsonl", _GOOD), c.file("b.jsonl", _GOOD)
    return refused(c.run("sft", c.work / "run", "--data", f"{a}:0.5,{b}"), "weight")


@case("data")
def eval_data_missing_file(c):
    a = c.file("a.jsonl", _GOOD)
    return refused(c.run("sft", c.work / "run", "--data", str(a), "--eval-data",
                         str(c.work / "nope.jsonl")), "nope.jsonl")


# ----------------------------------------------------------------------------- training faults


@case("training")
def nonfinite_stop(c):
    run = c.work / "run"
    out = c.run("sft", run, "--optim.learning-rate", "1e30", "--optim.max-grad-norm", "0",
                "--steps", "12", "--checkpoint.every", "2", "--optim.schedule", "constant")
    if steps_of(run) and not checkpoints_finite(c, run):
        return "data loss"
    if out.returncode == 0:
        return "data loss"  # trained on NaN and said done
    return refused(out, "non-finite", "step")


@case("training")
def nonfinite_skip(c):
    run = c.work / "run"
    out = c.run("sft", run, "--optim.learning-rate", "1e30", "--optim.max-grad-norm", "0",
                "--steps", "16", "--optim.schedule", "constant", "--optim.on-nonfinite", "skip")
    if steps_of(run) and not checkpoints_finite(c, run):
        return "data loss"
    if out.returncode == 0:
        return "data loss"
    return refused(out, "in a row")


@case("training")
def sigterm_then_resume(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "100000", "--checkpoint.every", "0")
    _wait_metrics(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out_, err = proc.communicate(timeout=600)
    if "Traceback" in err:
        return "traceback"
    ok = proc.returncode == 143 and bool(steps_of(run))
    out = c.run("sft", run, "--steps", str(max(steps_of(run) or [0]) + 2))
    return works(out, ok, "resumed")


@case("training")
def sigkill_then_resume(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "100000", "--checkpoint.every", "5")
    _wait_metrics(run, 8, proc)
    deadline = time.time() + 600
    while not steps_of(run) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # the checkpoint at step 5 is written in the background
    proc.kill()
    proc.communicate(timeout=60)
    last = max(steps_of(run) or [0])
    out = c.run("sft", run, "--steps", str(last + 2))
    logged = [r["step"] for r in metrics(run) if r["split"] == "train"]
    if len(logged) != len(set(logged)):
        return "data loss"
    return works(out, last > 0, "resumed")


@case("training")
def ctrl_c_twice(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "100000", "--checkpoint.every", "3")
    _wait_metrics(run, 4, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    if "Traceback" in err:
        return "traceback"
    code = (f"from nnx_posttrain import runs\nfrom pathlib import Path\nd={str(run)!r}\n"
            "for s in sorted(int(p.name) for p in (Path(d)/'checkpoints').iterdir() if p.name.isdigit()):\n"
            "    runs.load(d, step=s)\nprint('ALL RESTORE')\n")
    if steps_of(run) and "ALL RESTORE" not in c.python(code).stdout:
        return "data loss"
    return "ok" if proc.returncode in (130, 1) else "unclear"


def _wait_metrics(run, step, proc, timeout=900):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("step", 0) >= step and r.get("split") == "train" for r in metrics(run)):
            return
        if proc.poll() is not None:
            return
        time.sleep(0.05)


# ----------------------------------------------------------------------------- runs and resume


def _finished(c, *args) -> Path:
    run = c.work / "run"
    c.run("sft", run, *args)
    return run


@case("resume")
def other_algorithm_resumes(c):
    run = _finished(c)
    out = c.run("dpo", run, "--steps", "6")
    if out.returncode == 0:
        return "data loss"  # trained DPO on SFT's optimizer state and data position
    return refused(out, "algorithm")


for _name, _args, _word in [
    ("changed_learning_rate", ["--optim.learning-rate", "1e-2"], "learning_rate"),
    ("changed_batch_size", ["--batching.batch-size", "8"], "batch_size"),
    ("changed_seed", ["--seed", "3"], "seed"),
    ("changed_max_length", ["--batching.max-length", "32"], "max_length"),
    ("changed_lora", ["--lora.rank", "2"], "lora"),
    ("changed_dtype", ["--dtype", "bfloat16"], "dtype"),
    ("changed_schedule", ["--optim.schedule", "linear"], "schedule"),
]:
    def _changed(c, _args=_args, _word=_word):
        run = _finished(c)
        out = c.run("sft", run, "--steps", "6", *_args)
        if out.returncode == 0:
            return "data loss"  # mixed in silently
        return refused(out, _word)
    _changed.__name__ = _name
    CASES.append((_name, "resume", _changed))


@case("resume")
def changed_data_file(c):
    a, b = c.file("a.jsonl", _GOOD), c.file("b.jsonl", [_pc(i) for i in range(20, 40)])
    run = _finished(c, "--data", str(a))
    out = c.run("sft", run, "--steps", "6", "--data", str(b))
    return "data loss" if out.returncode == 0 else refused(out, "data")


@case("resume")
def changed_data_content(c):
    a = c.file("a.jsonl", _GOOD)
    run = _finished(c, "--data", str(a))
    c.file("a.jsonl", [_pc(i) for i in range(20, 40)])
    out = c.run("sft", run, "--steps", "6", "--data", str(a))
    return "data loss" if out.returncode == 0 else refused(out, "data")


@case("resume")
def changed_learning_rate_allowed(c):
    run = _finished(c)
    out = c.run("sft", run, "--steps", "6", "--optim.learning-rate", "1e-2", "--resume-changed",
                "optim.learning_rate")
    history = (run / "history.jsonl").read_text() if (run / "history.jsonl").exists() else ""
    return works(out, "learning_rate" in history and 6 in steps_of(run))


@case("resume")
def raised_steps(c):
    run = _finished(c)
    out = c.run("sft", run, "--steps", "6")
    return works(out, 6 in steps_of(run), "resumed")


@case("resume")
def same_command_twice(c):
    run = _finished(c)
    out = c.run("sft", run)
    return works(out, True, "already complete")


@case("resume")
def refused_command_keeps_config(c):
    run = _finished(c)
    before = (run / "config.json").read_text()
    c.run("sft", run, "--steps", "6", "--lora.rank", "4")
    if (run / "config.json").read_text() != before:
        return "data loss"
    out = c.python(f"from nnx_posttrain import runs; print(runs.load({str(run)!r}).step)")
    return "ok" if out.returncode == 0 else "data loss"


@case("resume")
def eval_only_keeps_config(c):
    run = _finished(c)
    before = (run / "config.json").read_text()
    out = c.run("sft", run, "--eval-only", "--steps", "100", "--batching.batch-size", "8")
    if (run / "config.json").read_text() != before:
        return "data loss"
    return works(out, True, "loss")


@case("resume")
def eval_only_keeps_metrics(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "100000", "--checkpoint.every", "0")
    _wait_metrics(run, 5, proc)
    proc.kill()
    proc.communicate(timeout=60)
    before = len(metrics(run))
    out = c.run("sft", run, "--eval-only")
    if len(metrics(run)) < before:
        return "data loss"
    return works(out, True, "initial weights")


@case("resume")
def eval_only_online_nothing_to_evaluate(c):
    # no answers to compare with, and a reward that needs none: no exact match, nothing scored
    prompts = c.file("prompts.jsonl", [{"prompt": f"What is {i} + 1?"} for i in range(8)])
    out = c.run("grpo", c.work / "run", "--eval-only", "--data", str(prompts), "--eval-data",
                str(prompts), "--algo.num-generations", "2", "--algo.rewards", "length")
    if out.returncode == 0 and out.stdout.strip().endswith("{}"):
        return "unclear"
    return refused(out, "exact-match")


@case("resume")
def eval_only_without_checkpoint_says_so(c):
    return works(c.run("sft", c.work / "run", "--eval-only"), True, "initial weights")


@case("resume")
def two_processes_one_run_dir(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "100000", "--checkpoint.every", "0")
    _wait_metrics(run, 2, proc)
    out = c.run("sft", run, "--steps", "3", "--checkpoint.every", "1")
    alive = proc.poll() is None
    proc.kill()
    proc.communicate(timeout=60)
    if out.returncode == 0:
        return "data loss"  # two writers on one directory
    return refused(out, "in use") if alive else "unclear"


@case("resume")
def stale_lock_taken_over(c):
    run = c.work / "run"
    run.mkdir()
    (run / "run.lock").write_text(json.dumps({"pid": 999999, "host": "x", "started": "then"}))
    return works(c.run("sft", run), (run / "checkpoints" / "4").is_dir())


@case("resume")
def metrics_deleted_mid_run(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "3000", "--checkpoint.every", "0")
    _wait_metrics(run, 3, proc)
    (run / "metrics.jsonl").unlink()
    try:
        out_, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        out_, err = proc.communicate()
    if "Traceback" in err:
        return "traceback"
    if not (run / "metrics.jsonl").exists() or not metrics(run):
        return "data loss"
    return "ok" if "removed" in (out_ + err) else "unclear"


@case("resume")
def metrics_partial_last_line(c):
    run = _finished(c)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "split": "tr')
    out = c.run("sft", run, "--steps", "6")
    try:
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    except ValueError:
        return "data loss"
    return works(out, 6 in steps_of(run))


@case("resume")
def metrics_missing_on_resume(c):
    run = _finished(c)
    (run / "metrics.jsonl").unlink()
    out = c.run("sft", run, "--steps", "6")
    return works(out, (run / "metrics.jsonl").exists(), "missing")


def _damage_case(name, damage):
    def fn(c):
        run = _finished(c)
        damage(run / "checkpoints" / "4")
        out = c.run("sft", run, "--steps", "6")
        return works(out, 6 in steps_of(run), "damaged", "resumed from")
    fn.__name__ = name
    CASES.append((name, "checkpoints", fn))


def _truncate(ck):
    files = sorted((ck / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    with files[-1].open("r+b") as f:
        f.truncate(files[-1].stat().st_size // 2)


_damage_case("damaged_truncated_data_file", _truncate)
_damage_case("damaged_missing_manifest", lambda ck: (ck / "state" / "manifest.ocdbt").unlink())
_damage_case("damaged_missing_metadata", lambda ck: (ck / "state" / "_METADATA").unlink())
_damage_case("damaged_empty_record", lambda ck: (ck / "record" / "metadata").write_text(""))
_damage_case("damaged_deleted_state", lambda ck: shutil.rmtree(ck / "state"))


@case("checkpoints")
def damaged_every_checkpoint(c):
    run = _finished(c)
    for ck in (run / "checkpoints").iterdir():
        if ck.name.isdigit():
            shutil.rmtree(ck / "state")
    out = c.run("sft", run, "--resume")
    return refused(out, "no complete checkpoint")


@case("checkpoints")
def interrupted_checkpoint_ignored(c):
    run = _finished(c)
    partial = run / "checkpoints" / "6.orbax-checkpoint-tmp-1795960000000000"
    shutil.copytree(run / "checkpoints" / "4", partial)
    out = c.run("sft", run, "--steps", "6")
    return works(out, 6 in steps_of(run), "resumed from")


@case("checkpoints")
def keep_best_of_exact_match(c):
    out = c.run("sft", c.work / "run", "--checkpoint.keep-best", "exact_match",
                "--checkpoint.best-mode", "max", "--eval.exact-match", "8", "--eval.every", "2",
                "--checkpoint.keep", "1")
    return works(out, bool(steps_of(c.work / "run")))


@case("checkpoints")
def load_for_inspection(c):
    run = _finished(c)
    out = c.python(f"from nnx_posttrain import runs; print('STEP', runs.load({str(run)!r}).step)")
    return "ok" if "STEP 4" in out.stdout else ("traceback" if traceback(out) else "unclear")


# ----------------------------------------------------------------------------- storage, generation


def _on_small_disk(c, size_kib, free_kib, *args):
    """A run on a tmpfs of ``size_kib`` with ``free_kib`` left free: (its output, run dir, how
    it ended: 'message' naming what is safe, or the failure's class)."""
    disk = c.work / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        c.note = "cannot mount a tmpfs here (needs root)"
        return None, None, "unclear"
    try:
        (disk / "filler").write_bytes(b"\0" * (size_kib - free_kib) * 1024)
        out = c.run("sft", disk / "run", *args)
        ended = refused(out, "storage under the run failed", "Safe:")
        if ended == "message" and len([l for l in out.stderr.splitlines() if l.strip()
                                       and not l.startswith("sft:")]) > 1:
            ended = "unclear"  # more than the one message
        return out, disk / "run", ended
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@case("storage")
def disk_full_during_checkpoint(c):
    return _on_small_disk(c, 1200, 1200, "--steps", "60", "--checkpoint.every", "2")[2]


@case("storage")
def disk_full_within_a_checkpoint_write(c):
    # a disk that fills up in the middle of a checkpoint's many writes (not at its first): the
    # writes it cut short are reported by asyncio when collected, at exit, after the message
    return _on_small_disk(c, 900, 900, "--steps", "60", "--checkpoint.every", "2")[2]


@case("storage")
def disk_full_while_logging(c):
    return _on_small_disk(c, 1200, 24, "--steps", "400", "--checkpoint.every", "1000")[2]


@case("storage")
def checkpoints_folder_removed_mid_run(c):
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "3000", "--checkpoint.every", "500")
    while proc.poll() is None and not (run / "checkpoints" / "500").is_dir():
        time.sleep(0.05)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    out_, err = proc.communicate(timeout=900)
    if "Traceback" in out_ + err:
        return "traceback"
    said = (out_ + err).count("was removed during the run")
    if proc.returncode == 0:
        return "ok" if said == 1 and steps_of(run) else "unclear"
    return "message" if "storage under the run failed" in err else "unclear"


@case("resume")
def config_json_edited_then_resumed(c):
    run = _finished(c)
    config = json.loads((run / "config.json").read_text())
    config["optim"]["learning_rate"] = 0.0123
    (run / "config.json").write_text(json.dumps(config))
    out = c.run("sft", run, "--steps", "6")
    if json.loads((run / "config.json").read_text())["optim"]["learning_rate"] != 0.0123:
        return "data loss"  # the user's edit, overwritten
    return refused(out, "was edited since the run wrote it", "0.0123")


@case("resume")
def eval_only_on_other_data(c):
    run = _finished(c, "--eval.every", "2")
    other = c.file("other.jsonl", [_pc(i) for i in range(8)])
    out = c.run("sft", run, "--eval-only", "--eval-data", str(other))
    last = metrics(run)[-1]
    if last.get("split") == "eval" or last.get("eval_data") != str(other):
        return "data loss"  # read as the run's own eval
    shown = c.python(f"from nnx_posttrain import compare; r = compare.compare([{str(run)!r}], "
                     f"out={str(c.work / 'plots')!r}, echo=lambda t: None); "
                     f"print({str(other)!r} in r['eval_only'] and {str(other)!r} not in r['summary'])")
    return works(out, shown.stdout.strip().endswith("True"))


@case("options")
def sample_max_new_tokens_huge(c):
    run = _finished(c)
    return refused(c.python("from nnx_posttrain import cli; raise SystemExit(cli.main(['sample', "
                            f"{str(run)!r}, '--prompt', 'Hi', '--max-new-tokens', '100000000']))"),
                   "max_new_tokens 100,000,000", "context")


@case("options")
def eval_max_new_tokens_huge(c):
    return refused(c.run("sft", c.work / "run", "--eval.max-new-tokens", "100000000",
                         "--eval.exact-match", "4"), "--eval.max-new-tokens", "context")


@case("options")
def rollout_length_huge(c):
    return refused(c.run("grpo", c.work / "run", "--algo.max-completion-length", "100000000"),
                   "--algo.max-completion-length", "context")


@case("noise")
def libtpu_installed_on_a_cpu_host(c):
    # JAX would start the TPU runtime first: a page of errors when no other process holds it
    out = c.run("sft", c.work / "run", env={"JAX_PLATFORMS": None})
    if not (c.work / "run" / "checkpoints" / "4").is_dir():
        return works(out, False)
    noise = [w for w in ("TPU_WORKER_HOSTNAMES", "host bounds", "libtpu") if w in out.stderr]
    return "unclear" if noise else works(out)


# ----------------------------------------------------------------------------- runs read live


def _live(c, *args):
    """A run training in the background (a checkpoint every step, only the last kept), once
    its first checkpoint is whole: (the process, its directory)."""
    run = c.work / "run"
    proc = c.start("sft", run, "--steps", "100000", "--checkpoint.every", "1",
                   "--checkpoint.keep", "1", *args)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline and not any(
            (run / "checkpoints" / str(s) / "state").is_dir() for s in steps_of(run)):
        time.sleep(0.05)
    return proc, run


def _read_live(c, reads) -> str:
    """``reads(run)`` (commands reading it) against a run that trains and rotates meanwhile:
    'ok' when every read succeeded without a traceback."""
    proc, run = _live(c)
    try:
        outs = [fn(run) for fn in reads]
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    if any(traceback(o) for o in outs):
        return "traceback"
    return "ok" if all(o.returncode == 0 for o in outs) else "unclear"


@case("runs read live")
def export_while_training_keep_1(c):
    return _read_live(c, [lambda run, i=i: c.command("export", run, "--to", c.work / f"out{i}")
                          for i in range(3)])


@case("runs read live")
def sample_while_training_keep_1(c):
    return _read_live(c, [lambda run: c.command("sample", run, "--prompt", "What is 2 + 2?",
                                                "--max-new-tokens", "2")] * 3)


@case("runs read live")
def load_while_training_keep_1(c):
    code = ("from nnx_posttrain import runs\nimport sys\n"
            "for _ in range(4): print('STEP', runs.load(sys.argv[1], echo=lambda _: None).step)\n")
    return _read_live(c, [lambda run: c.python(code, run)])


def _damaged_newest(c) -> Path:
    run = _finished(c)
    (run / "checkpoints" / "4" / "record" / "metadata").write_bytes(b'{"\xff\xfe')
    return run


@case("runs read live")
def sample_damaged_newest(c):
    out = c.command("sample", _damaged_newest(c), "--prompt", "What is 2 + 2?",
                    "--max-new-tokens", "2")
    return works(out, True, "cannot be read", "damaged")


@case("runs read live")
def load_damaged_newest(c):
    run = _damaged_newest(c)
    out = c.python(f"from nnx_posttrain import runs; print('STEP', runs.load({str(run)!r}).step)")
    return works(out, "STEP 2" in out.stdout, "damaged")


@case("runs read live")
def teacher_damaged_newest(c):
    run = _damaged_newest(c)
    out = c.run("distill", c.work / "student", "--algo.teacher", str(run), "--init-from", "")
    return works(out, bool(steps_of(c.work / "student")), "damaged")


# ----------------------------------------------------------------------------- agents

def _user_module(c) -> dict:
    """The environment of a process that imports the user code of tests/agent_tools.py (this
    checkout's, whichever ``--root`` runs) by 'agent_tools:name'."""
    return {"PYTHONPATH": f"{c.root}{os.pathsep}{Path(__file__).resolve().parent}"}


def _conversations(c, n=8, **extra) -> Path:
    return c.file("prompts.jsonl", [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                                     "answer": str(i + 1), **extra} for i in range(n)])


ONLINE = ["--algo.num-generations", "2", "--algo.max-completion-length", "4"]


def _tool_call(c, tool: str) -> str:
    """A call of ``tool`` the way a rollout calls it: 'ok' when it is a failed call, counted,
    with no traceback."""
    out = c.python("from nnx_posttrain.agents import Toolset\n"
                   f"episode = Toolset('agent_tools:{tool}').open([{{}}])[0]\n"
                   f"print('RESULT', episode.call({tool!r}, {{'x': 1}}))\n", env=_user_module(c))
    if traceback(out) or out.returncode != 0:
        return "traceback" if traceback(out) else "unclear"
    return "ok" if "True)" in out.stdout.split("RESULT", 1)[-1] else "unclear"


@case("agents")
def tool_result_str_raises(c):
    return _tool_call(c, "unprintable")


@case("agents")
def tool_calls_sys_exit(c):
    return _tool_call(c, "exits")


def _environment_case(name, cls, *words):
    def fn(c):
        out = c.run("grpo", c.work / "run", "--data", _conversations(c), *ONLINE,
                    "--algo.environment", f"agent_tools:{cls}", "--algo.rewards", "exact_match",
                    env=_user_module(c))
        return refused(out, *words, "agent_tools.py")
    fn.__name__ = name
    CASES.append((name, "agents", fn))


_environment_case("environment_reset_returns_a_dict", "DictReset", "reset returned a dict")
_environment_case("environment_reset_takes_no_record", "NoRecord", "NoRecord")


_BAD_TOOLS = [{"type": "function", "function": "multiply"}]


@case("agents")
def tools_column_not_a_schema_sft(c):
    rows = [{"messages": [{"role": "user", "content": "What is 2 x 3?"},
                          {"role": "assistant", "content": "6"}], "tools": _BAD_TOOLS}] * 8
    # long enough for the schemas: a run that trains wrote the bad ones into every prompt
    out = c.run("sft", c.work / "run", "--data", c.file("tools.jsonl", rows),
                "--batching.max-length", "1024")
    return "data loss" if out.returncode == 0 else refused(out, "tools.jsonl:1", "'tools'")


@case("agents")
def tools_column_not_a_schema_grpo(c):
    out = c.run("grpo", c.work / "run", "--data", _conversations(c, tools=_BAD_TOOLS), *ONLINE,
                "--algo.rewards", "exact_match")
    return "data loss" if out.returncode == 0 else refused(out, "prompts.jsonl:1", "'tools'")


# ----------------------------------------------------------------------------- evaluation, judging


def _task(c, text: str) -> Path:
    tasks = c.work / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "mine.yaml").write_text(text)
    return tasks


@case("evaluation")
def eval_task_data_file_missing(c):
    run = _finished(c)
    tasks = _task(c, "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                     f"{c.work / 'gone.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
                     "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                     "metric_list: [{metric: exact_match}]\n")
    out = c.command("eval", run, "--tasks", "mine", "--include-path", tasks)
    loaded = "loading model" in out.stdout + out.stderr
    return "unclear" if loaded and not traceback(out) else refused(out, "gone.jsonl")


@case("evaluation")
def eval_task_yaml_syntax_error(c):
    run = _finished(c)
    tasks = _task(c, "task: mine\ndataset_path: json\n  test_split: [x\n")
    return refused(c.command("eval", run, "--tasks", "mine", "--include-path", tasks),
                   "mine.yaml", "line 3")


@case("evaluation")
def judge_callable_raises(c):
    run = _finished(c)
    prompts = c.file("judge.jsonl", [{"prompt": f"What is {i} + 1?"} for i in range(4)])
    out = c.command("judge", run, run, "--prompts", prompts, "--judge",
                    "agent_tools:judge_that_raises", "--max-new-tokens", "2", env=_user_module(c))
    return refused(out, "agent_tools.py", "IndexError")


@case("evaluation")
def judge_two_runs_of_the_same_name(c):
    a = _finished(c)
    for side in ("x", "y"):
        shutil.copytree(a, c.work / side / "b")
    prompts = c.file("judge.jsonl", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)}
                                     for i in range(4)])
    outs = [c.command("judge", a, c.work / side / "b", "--prompts", prompts,
                      "--max-new-tokens", "2") for side in ("x", "y")]
    if any(traceback(o) for o in outs):
        return "traceback"
    kept = [json.loads(p.read_text()).get("run_b") for p in (a / "judge").glob("*.json")]
    if sorted(kept) != sorted(str(c.work / side / "b") for side in ("x", "y")):
        return "data loss"  # the first result overwritten by the second
    return works(outs[-1], True)


# ----------------------------------------------------------------------------- plan


@case("plan")
def plan_topology_cpu_0(c):
    return refused(c.command("plan", "sft", *MICRO, "--topology", "cpu-0"), "cpu-0")


@case("plan")
def plan_topology_odd_cores(c):
    return refused(c.command("plan", "sft", *MICRO, "--topology", "v4-9"), "v4-9")


@case("plan")
def plan_batch_size_huge(c):
    # planned from the shapes of a small batch; refused as too large for the chips, quickly
    out = c.command("plan", "sft", *MICRO, "--batching.batch-size", "4000000", "--topology",
                    "v5e-8", timeout=300)
    return "unclear" if out.returncode == 124 else refused(out, "would not fit")


# ----------------------------------------------------------------------------- the Python API


def _api(c, code: str, *words) -> str:
    """``code`` (a Python API call) as a script that reports the library's ``UserError`` (its
    class and message, exit status 1); anything else ends in a traceback."""
    return refused(c.python("import sys, nnx_posttrain as npt\ntry:\n    " + code + "\n"
                            "except npt.UserError as exc:\n"
                            "    sys.exit(f'{type(exc).__name__}: {exc}')\n"), *words)


@case("python api")
def api_configure_not_an_algorithm(c):
    return _api(c, "npt.configure(42)", "ConfigError", "int 42")


@case("python api")
def api_configure_config_not_a_path(c):
    return _api(c, "npt.configure('sft', config=123)", "ConfigError", "int 123")


@case("python api")
def api_run_a_dict(c):
    return _api(c, "npt.run({'steps': 4})", "ConfigError", "configure")


@case("python api")
def api_dotted_and_nested_key(c):
    outcome = _api(c, "npt.configure('sft', **{'optim.learning_rate': 1e-3, "
                      "'optim': {'learning_rate': 2e-3}})", "ConfigError", "given twice")
    return "data loss" if outcome == "unclear" and c.outs[-1].returncode == 0 else outcome


@case("python api")
def api_two_threads_one_run_dir(c):
    run = c.work / "run"
    code = (
        "import threading, nnx_posttrain as npt\n"
        f"cfg = npt.configure('sft', model='gemma_micro', run_dir={str(run)!r}, steps=200, "
        "log_every=1, checkpoint={'every': 0}, eval={'every': 0, 'exact_match': 0}, "
        "batching={'max_length': 24, 'batch_size': 4})\n"
        "said = []\n"
        "def second():\n"
        "    try:\n"
        "        npt.run(cfg, echo=lambda _: None)\n"
        "    except npt.UserError as exc:\n"
        "        said.append(str(exc))\n"
        "first = threading.Thread(target=npt.run, args=(cfg,), kwargs={'echo': lambda _: None})\n"
        "first.start()\n"
        "import time, pathlib\n"
        f"while not pathlib.Path({str(run / 'run.lock')!r}).exists(): time.sleep(0.05)\n"
        "second()\n"
        "first.join()\n"
        "print('SAID', said)\n")
    out = c.python(code)
    said = out.stdout.split("SAID", 1)[-1]
    if traceback(out):
        return "traceback"
    return "message" if "this process" in said else "unclear"


# ----------------------------------------------------------------------------- restarts, metrics


@case("resume")
def restart_without_checkpoints_other_settings(c):
    run = _finished(c, "--steps", "6")
    before = metrics(run)
    shutil.rmtree(run / "checkpoints")
    out = c.run("sft", run, "--steps", "2", "--optim.learning-rate", "1e-3")
    kept = [p for p in run.glob("earlier-*") if (p / "metrics.jsonl").exists()]
    if not kept or metrics(kept[0]) != before:
        return "data loss"  # the earlier run's records replaced without a word
    return works(out, True, "kept in")


@case("training")
def sigterm_window_equals_uninterrupted(c):
    whole, cut = c.work / "whole", c.work / "cut"
    common = ["--steps", "80", "--log-every", "8", "--checkpoint.every", "0"]
    c.run("sft", whole, *common)
    proc = c.start("sft", cut, *common)
    _wait_metrics(cut, 8, proc)
    time.sleep(0.1)  # into the next window
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=600)
    stopped = max(steps_of(cut) or [0])
    if stopped % 8 == 0 or stopped >= 80:
        c.note = f"stopped at step {stopped}: not inside a log window"
        return "unclear"
    out = c.run("sft", cut, *common)

    def untimed(run):
        return [{k: v for k, v in r.items() if k not in ("tokens_per_second", "compile_seconds")}
                for r in metrics(run) if r.get("split") == "train"]
    return works(out, untimed(cut) == untimed(whole)) if untimed(whole) else "unclear"


# ----------------------------------------------------------------------------- driver


def run_cases(root: Path, only: str | None) -> list[dict]:
    results = []
    for name, category, fn in CASES:
        if only and only not in name:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"fault_{name}_"))
        c = Case(root, work)
        t0 = time.perf_counter()
        try:
            outcome = fn(c)
        except Exception as exc:  # noqa: BLE001  (a case that breaks is reported, not fatal)
            outcome, c.note = "unclear", f"case failed: {exc!r}"
        seconds = time.perf_counter() - t0
        tail = c.outs[-1].stderr.strip().splitlines()[-1:] if c.outs else []
        results.append({"case": name, "category": category, "outcome": outcome,
                        "seconds": round(seconds, 1), "last_line": tail[0][:300] if tail else "",
                        "note": getattr(c, "note", "")})
        print(f"{outcome:10s} {name:42s} {seconds:6.1f}s  {results[-1]['last_line'][:100]}",
              flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return results


def counts(results) -> dict:
    return {k: sum(r["outcome"] == k for r in results) for k in CLASSES}


def table(*paths: str) -> None:
    """results/fault_cases.json from one run of the cases (AFTER) or two (BEFORE AFTER)."""
    from tools.results import record

    runs = [json.loads(Path(p).read_text()) for p in paths]
    after = runs[-1]
    columns = ["outcome", *[f"{'before' if i < len(runs) - 1 else 'after'} ({r['commit']})"
                            for i, r in enumerate(runs)]]
    tallies = [counts(r["results"]) for r in runs]
    rows = [[k, *(t[k] for t in tallies)] for k in CLASSES]
    rows.append(["all", *(len(r["results"]) for r in runs)])
    before = {x["case"]: x["outcome"] for x in runs[0]["results"]} if len(runs) > 1 else {}
    changed = [f"{r['case']}: {before.get(r['case'], 'new')} -> {r['outcome']}"
               for r in after["results"] if before and before.get(r["case"]) != r["outcome"]]
    left = [f"{r['case']} ({r['outcome']})" for r in after["results"]
            if r["outcome"] in ("traceback", "data loss", "unclear")]
    record("fault_cases", "python -m tests/fault_cases.py --json FILE [--root DIR]; --table [BEFORE] AFTER",
           columns, rows,
           notes=["Not fine after: " + (", ".join(left) or "none"),
                  f"{len(after['results'])} cases, each one to three real processes on the micro "
                  "model, run one after the other on a machine shared with other jobs.",
                  *[f"{'After' if r is after else 'Before'}: run at {r['rerun']['commit']} "
                    f"(--only): {', '.join(r['rerun']['cases'])}: {r['rerun']['why']}."
                    for r in runs if r.get("rerun")]],
           data={"runs": runs, "changed": changed})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(ROOT), help="checkout whose code runs the cases")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="record results/fault_cases.json from one --json file (after) or two "
                             "(before, after)")
    args = parser.parse_args(argv)
    if args.table:
        if len(args.table) > 2:
            raise ToolError("--table takes one or two --json files")
        return table(*args.table)
    root = Path(args.root).resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                            capture_output=True, text=True).stdout.strip()
    results = run_cases(root, args.only)
    print(json.dumps(counts(results)))
    if args.json:
        Path(args.json).write_text(json.dumps({"root": str(root), "commit": commit,
                                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
