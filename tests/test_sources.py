"""Data sources (JSONL, Parquet, Hugging Face Arrow directories, concatenation, mixtures),
validation with bad records, and Grain batches: exact resume, epochs, worker processes.

This module stays light to import (no keras): Grain worker processes import it to unpickle
``CharTokenizer``.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nnx_posttrain import data
from nnx_posttrain.data import DataError

FIXTURES = Path(__file__).parent / "fixtures" / "hf_datasets"  # real `save_to_disk` output


class CharTokenizer:
    """One token per character (id = code point + 3); ids 0, 1, 2 are pad, EOS, BOS."""

    pad_id, eos_id, bos_id = 0, 1, 2

    def encode(self, text):
        return [ord(c) + 3 for c in text]

    def decode(self, ids):
        return "".join(chr(int(i) - 3) for i in ids if int(i) > 2)

    def token_id(self, piece):
        return None


TOK = CharTokenizer()


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_parquet(path, records, row_group_size):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_hf_dir(path, shards):
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC stream shards + state.json."""
    path.mkdir()
    names = []
    for k, records in enumerate(shards):
        name = f"data-{k:05d}-of-{len(shards):05d}.arrow"
        table = pa.Table.from_pylist(records)
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
        names.append({"filename": name})
    (path / "state.json").write_text(json.dumps({"_data_files": names, "_split": None}))
    (path / "dataset_info.json").write_text("{}")
    return path


def pc(i):
    return {"prompt": f"q{i}", "completion": f"a{i}"}


def text_of(batch, row):
    """The prompt text of a row made by `Tokenize` over `pc` records with CharTokenizer."""
    ids = batch["input_ids"][row]
    return TOK.decode([t for t, m in zip(ids, batch["loss_mask"][row]) if not m])


def rows(batches):
    return [text_of(b, r) for b in batches for r in range(len(b["input_ids"]))]


def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for key in x:
            np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]), err_msg=key)


# ============================================================================= Parquet


def test_parquet_random_access_by_row_group(tmp_path):
    records = [dict(pc(i), messages=[{"role": "user", "content": f"m{i}"}], score=i / 2) for i in range(8)]
    path = write_parquet(tmp_path / "d.parquet", records, row_group_size=3)
    src = data.ParquetSource(path)
    assert len(src) == 8
    assert src._offsets.tolist() == [0, 3, 6, 8]  # row groups of 3, 3, 2
    assert src._cached == (None, None)  # nothing decoded yet
    r = src[7]
    assert r == dict(records[7], _where=f"{path}:row 7")
    assert src._cached[0] == 2 and src._cached[1].num_rows == 2  # only that group was decoded
    assert src[1]["messages"] == [{"role": "user", "content": "m1"}] and src._cached[0] == 0
    assert [src[i]["prompt"] for i in (5, 0, 3)] == ["q5", "q0", "q3"]
    with pytest.raises(IndexError):
        src[8]


def test_parquet_reads_one_row_group_not_the_file(tmp_path):
    records = [{"text": "x" * 1000 + str(i)} for i in range(400)]
    path = write_parquet(tmp_path / "big.parquet", records, row_group_size=100)
    src = data.ParquetSource(path)
    reads = []
    real_read = src._file.read_row_group
    src._file.read_row_group = lambda i, **kw: reads.append(i) or real_read(i, **kw)
    assert src[250]["text"].endswith("250")
    assert src[299]["text"].endswith("299")  # same group: no new read
    assert reads == [2]
    assert src._cached[1].num_rows == 100  # one row group held, not the 400-row table
    assert src[5]["text"].endswith("5") and reads == [2, 0]


def test_parquet_nulls_are_missing_fields(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [pc(0), {"prompt": "q1", "completion": None}], 10)
    src = data.ParquetSource(path)
    t = data.Tokenize(TOK, "gemma", 16)
    t(src[0])
    with pytest.raises(DataError, match=rf"^{path}:row 1: field 'completion' is missing"):
        t(src[1])


def test_parquet_errors(tmp_path):
    with pytest.raises(DataError, match=r"missing\.parquet: no such data file"):
        data.source(str(tmp_path / "missing.parquet"))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable Parquet file"):
        data.source(str(bad))


def test_parquet_pickles_without_its_open_file(tmp_path):
    import pickle

    src = data.ParquetSource(write_parquet(tmp_path / "d.parquet", [pc(i) for i in range(5)], 2))
    src[0]
    copy = pickle.loads(pickle.dumps(src))
    assert copy._file is None and copy._cached == (None, None)
    assert copy[4] == src[4]


# ============================================================================= Hugging Face datasets


def test_hf_dataset_dict_written_by_datasets():
    train = data.source(str(FIXTURES / "dict"), "train")
    assert isinstance(train, data.ArrowSource) and len(train) == 5  # two shards: 3 + 2 rows
    r = train[3]
    assert r["prompt"] == [{"role": "user", "content": "What is 3 + 1?"}]
    assert r["completion"] == [{"role": "assistant", "content": "4"}]
    assert r["answer"] == "4"
    assert r["_where"] == f"{FIXTURES / 'dict' / 'train' / 'data-00001-of-00002.arrow'}:row 0"
    assert train[0]["_where"] == f"{FIXTURES / 'dict' / 'train' / 'data-00000-of-00002.arrow'}:row 0"
    ev = data.source(str(FIXTURES / "dict"), "eval")  # no 'eval' split: 'test' is used
    assert len(ev) == 3 and ev[2]["answer"] == "4"
    assert len(data.source(str(FIXTURES / "dict" / "test"))) == 3  # a split directory directly
    with pytest.raises(DataError, match=r"dict: a DatasetDict with splits \['train', 'test'\], none of "
                                        r"them is the 'dev' split"):
        data.source(str(FIXTURES / "dict"), "dev")


def test_hf_preference_dataset_with_implicit_prompt_and_nulls():
    src = data.source(str(FIXTURES / "pref"))
    assert [src[i]["score"] for i in range(2)] == [1.5, None]
    assert data.data_format(src) == "preference"
    ex = data.TokenizePreference(TOK, "gemma", 24)(src[0])
    prompt = [TOK.bos_id, *TOK.encode("The sky is")]
    assert ex["chosen_input_ids"][:18].tolist() == prompt + TOK.encode(" blue.") + [TOK.eos_id]
    assert ex["rejected_loss_mask"].sum() == len(" green.") + 1


def test_hf_directory_is_memory_mapped(tmp_path):
    shards = [[{"text": "y" * 2000 + str(i)} for i in range(k, k + 50)] for k in (0, 50, 100)]
    path = write_hf_dir(tmp_path / "ds", shards)
    before = pa.total_allocated_bytes()
    src = data.source(str(path))
    assert len(src) == 150
    assert src[149]["text"].endswith("149") and src[1]["text"].endswith("1")
    assert src[120]["_where"] == f"{path / 'data-00002-of-00003.arrow'}:row 20"
    assert src[51]["_where"] == f"{path / 'data-00001-of-00003.arrow'}:row 1"
    # zero copy: the 300 KB stay in the files (a small bound: the allocator is process-wide)
    assert pa.total_allocated_bytes() - before < 50_000


def test_hf_directory_without_state_json_and_bad_directories(tmp_path):
    path = write_hf_dir(tmp_path / "ds", [[{"text": "a"}], [{"text": "b"}]])
    (path / "state.json").unlink()
    src = data.source(str(path))
    assert [src[0]["text"], src[1]["text"]] == ["a", "b"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: not a Hugging Face datasets directory \(no state\.json, "
                                        r"no data-\*\.arrow files\)"):
        data.source(str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"nowhere: no such data file or directory"):
        data.source(str(tmp_path / "nowhere"))
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
    with pytest.raises(DataError, match="lists data files that do not exist"):
        data.source(str(path))


def test_single_arrow_file(tmp_path):
    path = write_hf_dir(tmp_path / "ds", [[{"text": "a"}, {"text": "b"}]])
    src = data.source(str(path / "data-00000-of-00001.arrow"))
    assert len(src) == 2 and src[1]["text"] == "b"


# ============================================================================= source(): lists


def test_comma_list_concatenates_files_of_any_kind(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [pc(0), pc(1)])
    b = write_parquet(tmp_path / "b.parquet", [pc(2), pc(3), pc(4)], 2)
    c = write_hf_dir(tmp_path / "c", [[pc(5)]])
    src = data.source(f"{a}, {b},{c}")
    assert isinstance(src, data.Concat) and not isinstance(src, data.Mixture)
    assert len(src) == 6
    assert [src[i]["prompt"] for i in range(6)] == [f"q{i}" for i in range(6)]
    assert [src[i]["_where"] for i in (1, 2, 5)] == [
        f"{a}:2", f"{b}:row 0", f"{c / 'data-00000-of-00001.arrow'}:row 0"]
    assert src.part(4) == (1, 2)


def test_weights_make_a_mixture(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [pc(0)])
    b = write_jsonl(tmp_path / "b.jsonl", [pc(1), pc(2)])
    src = data.source(f"{a}:0.7,{b}:0.3")
    assert isinstance(src, data.Mixture) and src.weights == [0.7, 0.3]
    assert len(src) == 3 and src[2]["_where"] == f"{b}:2"
    assert data.source(f"builtin:1,{a}:2", "eval").weights == [1.0, 2.0]
    with pytest.raises(DataError, match="give every file a weight"):
        data.source(f"{a}:0.7,{b}")
    with pytest.raises(DataError, match=r"a\.jsonl:0: the mixture weight must be a positive number, got '0'"):
        data.source(f"{a}:0,{b}:1")
    with pytest.raises(DataError, match="empty entry"):
        data.source(f"{a},,{b}")
    with pytest.raises(DataError, match=r"data\.csv: unsupported data file"):
        data.source(str(tmp_path / "data.csv"))


# ============================================================================= validation


BAD_FILE = [
    pc(0),                                       # line 1: good
    '{"prompt": "q1", "completion": ',           # line 2: malformed JSON
    {"prompt": "q2"},                            # line 3: completion missing (a prompt-only record)
    {"prompt": "q3", "completion": 3},           # line 4: wrong type
    "",                                          # line 5: blank, not a record
    {"prompt": "q5", "completion": " "},         # line 6: empty completion
    pc(6),                                       # line 7: good
    {"question": "q7"},                          # line 8: unknown columns
    pc(8),                                       # line 9: good
]


def test_validate_stops_at_the_first_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_FILE)
    with pytest.raises(DataError, match=rf"^{path}:2: malformed JSON \(Expecting value at column 32\)$"):
        data.validate(data.source(str(path)), data.Tokenize(TOK, "gemma", 16))


def test_validate_skip_bad_counts_and_serves_only_good_records(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_FILE)
    src = data.source(str(path))
    t = data.Tokenize(TOK, "gemma", 16)
    report = data.validate(src, t, skip_bad=True, max_examples=3)
    assert report.records == 8
    assert report.bad == 5
    assert report.good_indices.tolist() == [0, 5, 7]
    assert report.bad_examples == [
        f"{path}:2: malformed JSON (Expecting value at column 32)",
        f"{path}:3: field 'completion' is missing (a prompt-only record; SFT needs 'prompt' + "
        "'completion', 'messages' or 'text')",
        f"{path}:4: field 'completion' must be a string or a list of messages, got int",
    ]
    assert (report.truncated, report.no_loss_tokens) == (0, 0)
    good = data.only_good(src, report)
    assert isinstance(good, data.Subset) and len(good) == 3
    assert [good[i]["_where"] for i in range(3)] == [f"{path}:1", f"{path}:7", f"{path}:9"]
    batches = take(data.train_batches(good, t, batch_size=3, seed=0), 4)
    for k in range(4):  # every epoch is the three good records
        assert sorted(rows(batches[k : k + 1])) == ["q0", "q6", "q8"]
    # a clean source is served as it is
    assert data.only_good(good, data.validate(good, t, skip_bad=True)) is good


def test_validate_counts_truncation_and_records_without_loss(tmp_path):
    src = data.ListSource([pc(0), {"prompt": "q" * 20, "completion": "a"}, {"text": "t" * 20}], "mem")
    report = data.validate(src, data.Tokenize(TOK, "gemma", 8))
    assert (report.records, report.bad, report.truncated, report.no_loss_tokens) == (3, 0, 2, 1)
    pref = data.ListSource([{"prompt": "q" * 6, "chosen": "a", "rejected": "b" * 9}], "mem")
    report = data.validate(pref, data.TokenizePreference(TOK, "gemma", 8))
    assert (report.truncated, report.no_loss_tokens) == (1, 0)
    report = data.validate(pref, data.TokenizePreference(TOK, "gemma", 7))
    assert (report.truncated, report.no_loss_tokens) == (1, 1)  # the chosen side has no loss token


def test_validate_all_bad_or_empty(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"x": 1}', "[1]"])
    with pytest.raises(DataError, match=rf"^{path}: all 2 records are bad; the first: {path}:1: cannot tell"):
        data.validate(data.source(str(path)), data.Tokenize(TOK, "gemma", 8), skip_bad=True)
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match=rf"^{empty}: no records$"):
        data.validate(data.source(str(empty)), data.Tokenize(TOK, "gemma", 8), skip_bad=True)


def test_skip_bad_in_a_mixture_keeps_each_part_and_its_weight(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [pc(0), {"prompt": "q1"}, pc(2)])
    b = write_jsonl(tmp_path / "b.jsonl", [pc(3), pc(4)])
    src = data.source(f"{a}:3,{b}:1")
    report = data.validate(src, data.Tokenize(TOK, "gemma", 8), skip_bad=True)
    assert report.good_indices.tolist() == [0, 2, 3, 4] and report.bad == 1
    good = data.only_good(src, report)
    assert isinstance(good, data.Mixture) and good.weights == [3.0, 1.0]
    assert isinstance(good.sources[0], data.Subset) and good.sources[1] is src.sources[1]
    assert [good.sources[0][i]["prompt"] for i in range(2)] == ["q0", "q2"]
    c = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "q5"}])
    src = data.source(f"{a}:1,{c}:1")
    report = data.validate(src, data.Tokenize(TOK, "gemma", 8), skip_bad=True)
    with pytest.raises(DataError, match=rf"^{c}: no good records left in this part of the mixture$"):
        data.only_good(src, report)


# ============================================================================= batches


def pc_source(n):
    return data.ListSource([pc(i) for i in range(n)], "mem")


def test_epochs_are_reshuffled_permutations(tmp_path):
    it = data.train_batches(pc_source(6), data.Tokenize(TOK, "gemma", 8), batch_size=4, seed=5)
    got = rows(take(it, 6))  # 24 rows = 4 epochs of 6; batches straddle epoch boundaries
    epochs = [got[k : k + 6] for k in range(0, 24, 6)]
    for epoch in epochs:
        assert sorted(epoch) == [f"q{i}" for i in range(6)]
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled by epoch
    again = rows(take(data.train_batches(pc_source(6), data.Tokenize(TOK, "gemma", 8), 4, seed=5), 6))
    assert again == got


def test_state_restores_exactly_mid_epoch_and_across_epochs():
    t = data.Tokenize(TOK, "gemma", 8)
    it = data.train_batches(pc_source(6), t, batch_size=4, seed=1)
    take(it, 1)  # 4 of the 6 records of epoch 0
    state = it.get_state()
    assert json.loads(json.dumps(state)) == state  # checkpointable as JSON
    expected = take(it, 4)  # finishes epoch 0 inside a batch, then epochs 1-2
    resumed = data.train_batches(pc_source(6), t, batch_size=4, seed=1)
    resumed.set_state(state)
    same(take(resumed, 4), expected)


def test_mixture_proportions_and_per_part_epochs():
    a = data.ListSource([pc(i) for i in range(7)], "a")
    b = data.ListSource([pc(i) for i in range(100, 103)], "b")
    mix = data.Mixture([a, b], [0.75, 0.25])
    t = data.Tokenize(TOK, "gemma", 8)
    got = rows(take(data.train_batches(mix, t, batch_size=4, seed=0), 10))
    from_b = [r for r in got if int(r[1:]) >= 100]
    from_a = [r for r in got if int(r[1:]) < 100]
    assert (len(from_a), len(from_b)) == (30, 10)  # exactly 3:1
    for k in (0, 3, 6):  # each part is reshuffled and repeated on its own
        assert sorted(from_b[k : k + 3]) == ["q100", "q101", "q102"]
    for k in (0, 7, 14, 21):
        assert sorted(from_a[k : k + 7]) == sorted(f"q{i}" for i in range(7))
    assert rows(take(data.train_batches(mix, t, batch_size=4, seed=0), 10)) == got
    assert rows(take(data.train_batches(mix, t, batch_size=4, seed=1), 10)) != got
    # the mixture's resumed iterator continues exactly too
    it = data.train_batches(mix, t, batch_size=4, seed=0)
    take(it, 3)
    resumed = data.train_batches(mix, t, batch_size=4, seed=0)
    resumed.set_state(it.get_state())
    same(take(resumed, 3), take(it, 3))


@pytest.mark.slow
def test_workers_give_the_same_batches_and_resume(tmp_path):
    # a Parquet, an Arrow and a JSONL file, mixed: every source is pickled to the workers
    a = write_parquet(tmp_path / "a.parquet", [pc(i) for i in range(5)], 2)
    b = write_hf_dir(tmp_path / "b", [[pc(i) for i in range(10, 13)]])
    c = write_jsonl(tmp_path / "c.jsonl", [pc(i) for i in range(20, 24)])
    src = data.source(f"{a},{b}:2,{c}:1".replace(",", ":1,", 1))  # a:1, b:2, c:1
    assert isinstance(src, data.Mixture) and src.weights == [1.0, 2.0, 1.0]
    t = data.Tokenize(TOK, "gemma", 8)
    serial = take(data.train_batches(src, t, batch_size=3, seed=2), 9)
    it = data.train_batches(src, t, batch_size=3, seed=2, num_workers=2)
    try:
        same(take(it, 5), serial[:5])
        state = it.get_state()
        assert json.loads(json.dumps(state)) == state  # checkpointable as JSON
        same(take(it, 2), serial[5:7])
    finally:
        it.close()
    resumed = data.train_batches(src, t, batch_size=3, seed=2, num_workers=2)
    try:
        resumed.set_state(state)
        same(take(resumed, 4), serial[5:9])
    finally:
        resumed.close()


# ============================================================================= robustness


def test_file_sources_are_safe_to_read_from_many_threads(tmp_path):
    # Grain reads a source from several threads; a ParquetFile read from two threads at once
    # crashes the process, so the source serialises its reads
    from concurrent.futures import ThreadPoolExecutor

    records = [{"text": f"t{i}", "n": i} for i in range(300)]
    sources = [data.ParquetSource(write_parquet(tmp_path / "a.parquet", records, 7)),
               data.ArrowSource(write_hf_dir(tmp_path / "b", [records[:150], records[150:]]))]
    order = np.random.default_rng(0).permutation(300).tolist() * 3
    for src in sources:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda i: src[i]["n"], order))
        assert got == order


def test_validate_does_not_keep_the_examples():
    import tracemalloc

    src = data.ListSource([{"text": "x"}] * 500, "mem")
    t = data.Tokenize(TOK, "gemma", 2048)  # 20 KB an example: 10 MB if they were all kept
    tracemalloc.start()
    try:
        report = data.validate(src, t)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.records == 500 and len(report.good_indices) == 500
    assert peak < 3_000_000, peak  # (traced over all threads of the process)
