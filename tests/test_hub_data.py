"""--data hf://ORG/NAME[:SPLIT], folders of Parquet shards and globs (data/hub.py), offline: the
Hub cache is laid out in a temporary directory the way huggingface_hub writes it."""

import hashlib
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnx_posttrain import data
from nnx_posttrain.data import hub
from support import MICRO, ROOT, records

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _write_parquet(path, rows, row_group_size=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def hub_cache(tmp_path, repo_id, files: dict, readme: str | None = None):
    """A Hub cache (HF_HUB_CACHE) holding dataset ``repo_id`` at revision main: blobs named by
    their hash, snapshots/<commit>/<file> symlinks to them, refs/main = the commit."""
    cache = tmp_path / "hub"
    repo = cache / ("datasets--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    contents = {}
    for name, rows in files.items():
        scratch = tmp_path / "scratch" / name
        _write_parquet(scratch, rows, row_group_size=3)
        contents[name] = scratch.read_bytes()
    if readme is not None:
        contents["README.md"] = readme.encode()
    for name, blob in contents.items():
        digest = hashlib.sha256(blob).hexdigest()
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / digest).write_bytes(blob)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / digest, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def _rows(split, n):
    return [{"prompt": f"{split} question {i}", "completion": f"answer {i}"} for i in range(n)]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    cache = hub_cache(tmp_path, "acme/qa", {
        "data/train-00000-of-00002.parquet": _rows("train", 5),
        "data/train-00001-of-00002.parquet": _rows("train-b", 4),
        "data/validation-00000-of-00001.parquet": _rows("validation", 3),
        "data/test-00000-of-00001.parquet": _rows("test", 2),
    })
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_dataset_from_the_local_cache_every_split(offline):
    train = data.source("hf://acme/qa")
    assert isinstance(train, data.Concat) and len(train) == 9
    assert all(isinstance(s, data.ParquetSource) for s in train.sources)  # read lazily
    assert train[0]["prompt"] == "train question 0"
    assert train[5]["prompt"] == "train-b question 0"  # shards in order
    assert train[8]["_where"].endswith("train-00001-of-00002.parquet:row 3")
    # --eval-data: the first of eval, validation, ... that exists; :SPLIT names one
    assert data.source("hf://acme/qa", "eval")[0]["prompt"] == "validation question 0"
    assert [r["prompt"] for r in data.source("hf://acme/qa:test")] == ["test question 0",
                                                                        "test question 1"]
    assert len(data.source("hf://datasets/acme/qa:validation")) == 3  # HfFileSystem's spelling
    # a weight after the split, and a mixture with a local file
    mixed = data.source("hf://acme/qa:test:0.5,hf://acme/qa:validation:0.5")
    assert isinstance(mixed, data.Mixture) and len(mixed) == 5


def test_unknown_split_names_the_splits(offline):
    with pytest.raises(data.DataError) as info:
        data.source("hf://acme/qa:dev_prefs")
    msg = str(info.value)
    assert "no 'dev_prefs' split" in msg and "test, train, validation" in msg
    assert "hf://acme/qa:test" in msg


def test_offline_without_the_cache_says_what_to_do(offline):
    with pytest.raises(data.DataError) as info:
        data.source("hf://acme/missing")
    msg = str(info.value)
    assert msg.startswith("hf://acme/missing: dataset acme/missing is not in the local Hub cache")
    assert "HF_HUB_OFFLINE=1" in msg and "hf download acme/missing --repo-type dataset" in msg
    assert "\n" not in msg  # one message


def test_bad_handle(offline):
    with pytest.raises(data.DataError, match="expected hf://ORG/NAME"):
        data.source("hf://justaname")


def test_readme_configs_choose_the_files(monkeypatch, tmp_path):
    readme = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_prefs\n"
              "    path: data/train_prefs-*\n  - split: test_prefs\n    path: data/test_prefs-*\n"
              "- config_name: sft\n  data_files:\n  - split: train\n    path: sft/train-*\n---\n# card\n")
    cache = hub_cache(tmp_path, "acme/prefs", {
        "data/train_prefs-00000-of-00001.parquet": _rows("prefs", 4),
        "data/test_prefs-00000-of-00001.parquet": _rows("test_prefs", 2),
        "sft/train-00000-of-00001.parquet": _rows("sft", 3),
    }, readme=readme)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert len(data.source("hf://acme/prefs:train_prefs")) == 4
    assert data.source("hf://acme/prefs/sft")[0]["prompt"] == "sft question 0"  # a config
    with pytest.raises(data.DataError, match="its splits: test_prefs, train_prefs"):
        data.source("hf://acme/prefs")  # no 'train' split: named, not guessed


def test_downloaded_folder_of_parquet_shards_and_globs(tmp_path):
    root = tmp_path / "ds"
    _write_parquet(root / "data" / "train-00000-of-00002.parquet", _rows("a", 3))
    _write_parquet(root / "data" / "train-00001-of-00002.parquet", _rows("b", 2))
    _write_parquet(root / "data" / "test-00000-of-00001.parquet", _rows("t", 1))
    assert len(data.source(str(root))) == 5
    assert data.source(str(root), "eval")[0]["prompt"] == "t question 0"
    globbed = data.source(str(root / "data" / "train-0000*-of-*.parquet"))
    assert len(globbed) == 5 and globbed[3]["prompt"] == "b question 0"
    with pytest.raises(data.DataError, match="no files match"):
        data.source(str(root / "data" / "nope-*.parquet"))
    # shards without split names are all training data
    _write_parquet(tmp_path / "plain" / "part-0.parquet", _rows("p", 2))
    _write_parquet(tmp_path / "plain" / "part-1.parquet", _rows("q", 2))
    assert len(data.source(str(tmp_path / "plain"))) == 4


def test_split_of_hub_layouts():
    from pathlib import Path

    assert hub._split_of(Path("data/train-00000-of-00003.parquet")) == "train"
    assert hub._split_of(Path("default/train/0000.parquet")) == "train"  # refs/convert/parquet
    assert hub._split_of(Path("validation.parquet")) == "validation"
    assert hub._split_of(Path("en/test-00000-of-00001.parquet")) == "test"


@pytest.mark.slow
def test_sft_trains_from_a_hub_dataset_offline(tmp_path):
    """End to end, in a fresh process as a user runs it: HF_HUB_OFFLINE=1 and a Hub cache."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": str(i + 1)}]} for i in range(40)]
    cache = hub_cache(tmp_path, "acme/chats", {
        "data/train-00000-of-00001.parquet": rows[:32],
        "data/test-00000-of-00001.parquet": rows[32:],
    })
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.sft", *MICRO, "--run-dir", str(run_dir),
           "--data", "hf://acme/chats", "--eval-data", "hf://acme/chats", "--steps", "2",
           "--batching.batch-size", "4", "--eval.exact-match", "4", "--eval.batches", "1"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(records(run_dir, "train")) >= 1 and len(records(run_dir, "eval")) == 2
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["data"] == "hf://acme/chats"
    # offline, a dataset that is not cached: one line, no traceback
    cmd[cmd.index("hf://acme/chats")] = "hf://acme/absent"
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "error: hf://acme/absent: dataset acme/absent is not in the local Hub cache" in out.stderr
