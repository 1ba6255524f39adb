"""Data: JSONL reading, format detection, tokenization and loss masks, batching."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras / keras_hub are imported)
import keras_hub  # noqa: E402

from nnx_posttrain import chat, data  # noqa: E402
from nnx_posttrain.tasks import arithmetic  # noqa: E402
from nnx_posttrain.tasks import tokenizer as tk  # noqa: E402
from nnx_posttrain.data import DataError  # noqa: E402
from nnx_posttrain.model import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(keras_hub.models.GemmaTokenizer(proto=tk.builtin_proto()))


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def real_length(ex):
    return int(ex["attention_mask"].sum())


def masked_ids(ex):
    return [int(i) for i, m in zip(ex["input_ids"], ex["loss_mask"]) if m]


CONV = {
    "messages": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
}


# ----------------------------------------------------------------------------- JsonlSource


def test_jsonl_random_access_skips_blank_lines(tmp_path):
    path = write_jsonl(
        tmp_path / "file.jsonl",
        ['{"text": "a"}', "", '{"text": "b"}', "   ", '{"text": "c"}'],
    )
    src = data.JsonlSource(path)
    assert len(src) == 3
    # out-of-order access works and each record knows its own line
    assert src[2]["text"] == "c" and src[2]["_where"] == f"{path}:5"
    assert src[0]["text"] == "a" and src[0]["_where"] == f"{path}:1"
    assert src[1]["text"] == "b" and src[1]["_where"] == f"{path}:3"
    assert src[1] == src[1]  # re-readable


def test_jsonl_last_line_without_newline_and_unicode(tmp_path):
    path = tmp_path / "file.jsonl"
    path.write_bytes('{"text": "é"}\n{"text": "日本"}'.encode())
    src = data.JsonlSource(path)
    assert [src[i]["text"] for i in range(len(src))] == ["é", "日本"]
    assert src[1]["_where"].endswith("file.jsonl:2")


def test_jsonl_malformed_line_reports_its_line_number(tmp_path):
    path = write_jsonl(tmp_path / "file.jsonl", ['{"text": "a"}', "", '{"text": "b"'])
    src = data.JsonlSource(path)
    assert len(src) == 2
    src[0]  # the good record is still readable
    with pytest.raises(DataError) as info:
        src[1]
    assert "file.jsonl:3" in str(info.value)
    assert "malformed JSON" in str(info.value)


def test_jsonl_non_object_line(tmp_path):
    path = write_jsonl(tmp_path / "file.jsonl", ['{"text": "a"}', "[1, 2]"])
    with pytest.raises(DataError, match=r"file\.jsonl:2: expected a JSON object, got list"):
        data.JsonlSource(path)[1]


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        data.JsonlSource(tmp_path / "missing.jsonl")


def test_source_dispatch(tmp_path):
    with pytest.raises(DataError, match="unsupported data file"):
        data.source(str(tmp_path / "data.csv"))
    path = write_jsonl(tmp_path / "d.jsonl", ['{"text": "a"}'])
    assert isinstance(data.source(str(path)), data.JsonlSource)
    ev = data.source("builtin", "eval")
    assert len(ev) == arithmetic.EVAL_SIZE
    a, b = arithmetic.problems("eval")[0]
    assert ev[0]["messages"] == arithmetic.sft_record(a, b)["messages"]
    assert ev[0]["_where"] == "builtin:sft:eval[0]"
    pref = data.source("builtin", "eval", builtin="preference")[0]
    assert pref["chosen"][0]["content"] != pref["rejected"][0]["content"]


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    "record, fmt",
    [
        (CONV, "messages"),
        ({"messages": [], "text": "x"}, "messages"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"prompt": "a", "completion": "b", "text": "t"}, "prompt_completion"),
        ({"text": "x", "_where": "f:1"}, "text"),
        ({"text": "x", "prompt": "only a prompt"}, "text"),
    ],
)
def test_detect_format(record, fmt):
    assert data.detect_format(record) == fmt


def test_detect_format_unknown_columns_names_them():
    with pytest.raises(DataError) as info:
        data.detect_format({"question": "q", "answer": "a", "_where": "f.jsonl:7"})
    msg = str(info.value)
    assert "f.jsonl:7" in msg and "'answer'" in msg and "'question'" in msg
    assert "_where" not in msg
    # a null value counts as absent, and the message says which columns were null
    with pytest.raises(DataError, match=r"f\.jsonl:5: cannot tell the format from columns "
                                        r"\['completion'\] \(null: 'prompt'\)"):
        data.detect_format({"prompt": None, "completion": " 2", "_where": "f.jsonl:5"})
    # a prompt alone is a prompt-only record (for RL), which SFT rejects naming the missing field
    assert data.detect_format({"prompt": "only a prompt"}) == "prompt_only"


# ----------------------------------------------------------------------------- Tokenize masks


def test_messages_mask_covers_answer_and_end_of_turn_only(tok):
    ex = data.Tokenize(tok, "gemma", 32)(CONV)
    eot = tok.token_id("<end_of_turn>")
    assert eot is not None
    prompt_ids = tok.encode("<start_of_turn>user\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n")
    answer_ids = tok.encode("5")
    expected = [tok.bos_id, *prompt_ids, *answer_ids, eot, *tok.encode("\n")]
    n = len(expected)
    assert list(ex["input_ids"][:n]) == expected
    assert all(ex["input_ids"][n:] == tok.pad_id)
    want_mask = np.zeros(32, np.float32)
    start = 1 + len(prompt_ids)
    want_mask[start : start + len(answer_ids) + 1] = 1
    np.testing.assert_array_equal(ex["loss_mask"], want_mask)
    np.testing.assert_array_equal(ex["attention_mask"], (np.arange(32) < n).astype(np.int32))
    assert tok.decode(masked_ids(ex)) == "5<end_of_turn>"
    assert int(ex["truncated"]) == 0
    assert ex["input_ids"].dtype == np.int32 and ex["loss_mask"].dtype == np.float32


def test_multi_turn_messages_train_every_assistant_turn(tok):
    record = {
        "messages": [
            {"role": "system", "content": "Add."},
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
        ]
    }
    ex = data.Tokenize(tok, "gemma", 64)(record)
    assert tok.decode(masked_ids(ex)) == "2<end_of_turn>4<end_of_turn>"
    # all real tokens together are the rendered template (the BOS is an id, not text)
    n = real_length(ex)
    assert ex["input_ids"][0] == tok.bos_id
    assert tok.decode(ex["input_ids"][1:n]) == chat.to_text(record["messages"], "gemma")


def test_string_prompt_completion_bos_eos(tok):
    ex = data.Tokenize(tok, "gemma", 32)({"prompt": "What is 2 + 3?", "completion": " 5"})
    n = real_length(ex)
    prompt_ids, completion_ids = tok.encode("What is 2 + 3?"), tok.encode(" 5")
    assert list(ex["input_ids"][:n]) == [tok.bos_id, *prompt_ids, *completion_ids, tok.eos_id]
    assert ex["input_ids"][0] == tok.bos_id
    assert ex["input_ids"][n - 1] == tok.eos_id
    assert ex["loss_mask"][n - 1] == 1  # EOS carries loss: the model learns to stop
    assert ex["loss_mask"][: 1 + len(prompt_ids)].sum() == 0
    assert ex["loss_mask"][n:].sum() == 0
    assert masked_ids(ex) == [*completion_ids, tok.eos_id]


def test_empty_string_prompt_is_allowed(tok):
    ex = data.Tokenize(tok, "gemma", 16)({"prompt": "", "completion": "42"})
    assert masked_ids(ex) == [*tok.encode("42"), tok.eos_id]
    assert ex["loss_mask"][0] == 0


def test_conversational_prompt_completion_trains_answer_only(tok):
    pc = {
        "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "completion": [{"role": "assistant", "content": "5"}],
    }
    t = data.Tokenize(tok, "gemma", 32)
    ex_pc, ex_msgs = t(pc), t(CONV)
    # same tokens and same mask as the equivalent conversation: the "<start_of_turn>model\n"
    # header belongs to the prompt, not to what the model learns to write
    for key in ("input_ids", "attention_mask", "loss_mask"):
        np.testing.assert_array_equal(ex_pc[key], ex_msgs[key])
    assert tok.decode(masked_ids(ex_pc)) == "5<end_of_turn>"


def test_conversational_prompt_with_few_shot_answer_is_not_trained(tok):
    pc = {
        "prompt": [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "What is 2 + 3?"},
        ],
        "completion": [{"role": "assistant", "content": "5"}],
    }
    ex = data.Tokenize(tok, "gemma", 64)(pc)
    assert tok.decode(masked_ids(ex)) == "5<end_of_turn>"


def test_text_every_real_token_carries_loss(tok):
    ex = data.Tokenize(tok, "gemma", 32)({"text": "What is 2 + 3? 5"})
    n = real_length(ex)
    assert list(ex["input_ids"][:n]) == [tok.bos_id, *tok.encode("What is 2 + 3? 5"), tok.eos_id]
    assert ex["loss_mask"][0] == 0  # the BOS is never predicted
    assert ex["loss_mask"][1:n].tolist() == [1.0] * (n - 1)
    assert ex["loss_mask"][n:].sum() == 0


def test_padding(tok):
    ex = data.Tokenize(tok, "gemma", 40)({"text": "12"})
    n = real_length(ex)
    assert n == 1 + len(tok.encode("12")) + 1
    assert ex["input_ids"].shape == ex["attention_mask"].shape == ex["loss_mask"].shape == (40,)
    assert (ex["input_ids"][n:] == tok.pad_id).all()
    assert ex["attention_mask"][:n].all() and not ex["attention_mask"][n:].any()
    assert int(ex["truncated"]) == 0


def test_truncation_keep_start_and_keep_end(tok):
    record = {"prompt": "What is 12 + 34? What is 56 + 78?", "completion": "46"}
    full = data.Tokenize(tok, "gemma", 256)(record)
    n = real_length(full)
    ids, mask = full["input_ids"][:n], full["loss_mask"][:n]
    L = 8
    assert n > L

    start = data.Tokenize(tok, "gemma", L, truncation="keep_start")(record)
    assert int(start["truncated"]) == 1
    np.testing.assert_array_equal(start["input_ids"], ids[:L])
    np.testing.assert_array_equal(start["loss_mask"], mask[:L])
    assert start["attention_mask"].all()
    assert start["input_ids"][0] == tok.bos_id
    assert start["loss_mask"].sum() == 0  # the completion was cut off

    end = data.Tokenize(tok, "gemma", L, truncation="keep_end")(record)
    assert int(end["truncated"]) == 1
    np.testing.assert_array_equal(end["input_ids"], ids[-L:])
    np.testing.assert_array_equal(end["loss_mask"], mask[-L:])
    assert end["input_ids"][-1] == tok.eos_id and end["loss_mask"][-1] == 1
    assert masked_ids(end) == [*tok.encode("46"), tok.eos_id]

    exact = data.Tokenize(tok, "gemma", n)(record)
    assert int(exact["truncated"]) == 0
    np.testing.assert_array_equal(exact["input_ids"], ids)


# ----------------------------------------------------------------------------- bad records


def test_wrong_typed_completion_names_file_line_and_field(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "file.jsonl",
        ['{"prompt": "a", "completion": "b"}', "", '{"prompt": "What is 2 + 3?", "completion": 5}'],
    )
    src = data.JsonlSource(path)
    t = data.Tokenize(tok, "gemma", 16)
    t(src[0])
    with pytest.raises(DataError) as info:
        t(src[1])
    msg = str(info.value)
    assert "file.jsonl:3" in msg and "'completion'" in msg and "int" in msg


def test_wrong_typed_text(tok):
    with pytest.raises(DataError, match=r"x\.jsonl:4: field 'text' must be a string, got list"):
        data.Tokenize(tok, "gemma", 16)({"text": ["a"], "_where": "x.jsonl:4"})


@pytest.mark.parametrize("completion", ["", "   "])
def test_empty_completion(tok, completion):
    with pytest.raises(DataError, match=r"x\.jsonl:2: field 'completion' is empty"):
        data.Tokenize(tok, "gemma", 16)({"prompt": "p", "completion": completion, "_where": "x.jsonl:2"})


def test_empty_text(tok):
    with pytest.raises(DataError, match="field 'text' is empty"):
        data.Tokenize(tok, "gemma", 16)({"text": ""})


def test_messages_without_assistant_turn(tok):
    record = {"messages": [{"role": "user", "content": "Hi"}], "_where": "x.jsonl:9"}
    with pytest.raises(DataError, match=r"x\.jsonl:9: field 'messages' has no assistant turn"):
        data.Tokenize(tok, "gemma", 16)(record)


def test_messages_with_empty_assistant_turn(tok):
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}
    with pytest.raises(DataError, match="empty assistant turn"):
        data.Tokenize(tok, "gemma", 16)(record)


def test_messages_bad_role_becomes_data_error_naming_the_field(tok):
    record = {"messages": [{"role": "bot", "content": "Hi"}], "_where": "x.jsonl:1"}
    with pytest.raises(DataError, match=r"x\.jsonl:1: field 'messages': message 0 has role 'bot'"):
        data.Tokenize(tok, "gemma", 16)(record)


def test_messages_not_a_list(tok):
    with pytest.raises(DataError, match="field 'messages'"):
        data.Tokenize(tok, "gemma", 16)({"messages": "Hi"})


# ----------------------------------------------------------------------------- validate


def test_validate_counts(tok):
    long_prompt = "What is 12 + 34? " * 4
    src = data.ListSource(
        [
            {"prompt": "What is 1 + 1?", "completion": "2"},  # fits
            {"prompt": long_prompt, "completion": "46"},  # truncated, completion cut: no loss
            {"text": long_prompt},  # truncated, still has loss
        ],
        "mem",
    )
    report = data.validate(src, data.Tokenize(tok, "gemma", 12))
    assert (report.records, report.truncated, report.no_loss_tokens) == (3, 2, 1)
    assert (report.bad, report.bad_examples, report.good_indices.tolist()) == (0, [], [0, 1, 2])
    # the former dict's keys still read
    assert (report["records"], report["truncated"], report["no_loss_tokens"]) == (3, 2, 1)


def test_validate_stops_on_a_bad_record(tmp_path, tok):
    path = write_jsonl(tmp_path / "file.jsonl", ['{"text": "a"}', '{"text": "b"}', '{"txt": "c"}'])
    with pytest.raises(DataError, match=r"file\.jsonl:3: cannot tell the format"):
        data.validate(data.JsonlSource(path), data.Tokenize(tok, "gemma", 16))


def test_the_same_data_validated_again_in_a_process_is_not_read_again(tok, monkeypatch):
    """The built-in data validated again the same way (its fingerprint, the transform's
    settings and tokenizer) gives the first report without a record read; other settings read
    it again."""
    first = data.validate(data.source("builtin", "eval"), data.Tokenize(tok, "gemma", 48))
    first.good_indices[:] = -1  # the caller's copy: what is kept is not changed
    calls, tokenize = [], data.Tokenize.__call__
    monkeypatch.setattr(data.Tokenize, "__call__",
                        lambda self, record: calls.append(1) or tokenize(self, record))
    again = data.validate(data.source("builtin", "eval"), data.Tokenize(tok, "gemma", 48))
    assert calls == [] and again.records == 500
    assert again.good_indices.tolist() == list(range(500))
    data.validate(data.source("builtin", "eval"), data.Tokenize(tok, "gemma", 40))
    assert len(calls) == 500


def test_a_changed_file_is_validated_again_and_its_bad_record_refused(tmp_path, tok):
    """A file validated once, then changed (one character of its fifth line, the same size):
    validated again, its bad record refused with its file and line."""
    lines = [json.dumps({"prompt": f"What is {i} + 1?", "completion": str(i + 1)})
             for i in range(8)]
    path = write_jsonl(tmp_path / "file.jsonl", lines)
    transform = data.Tokenize(tok, "gemma", 24)
    assert data.validate(data.JsonlSource(path), transform).bad == 0
    lines[4] = "[" + lines[4][1:]
    write_jsonl(path, lines)
    with pytest.raises(DataError, match=r"file\.jsonl:5: malformed JSON"):
        data.validate(data.JsonlSource(path), transform)


def test_validate_empty_source(tmp_path, tok):
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no records"):
        data.validate(data.JsonlSource(path), data.Tokenize(tok, "gemma", 16))
    with pytest.raises(DataError, match=rf"^{path}: no records$"):  # the file, not an object
        data.data_format(data.JsonlSource(path))


# ----------------------------------------------------------------------------- batches


def arithmetic_source(n, split="train"):
    return data.ListSource([arithmetic.sft_record(a, b) for a, b in arithmetic.problems(split)[:n]], split)


def test_eval_batches_pad_last_batch_with_zero_mask_rows(tok):
    src = arithmetic_source(5, "eval")
    t = data.Tokenize(tok, "gemma", 24)
    batches = data.eval_batches(src, t, batch_size=2)
    assert len(batches) == 3
    for b in batches:
        assert b["input_ids"].shape == b["loss_mask"].shape == b["attention_mask"].shape == (2, 24)
    # in order
    for i in range(5):
        np.testing.assert_array_equal(batches[i // 2]["input_ids"][i % 2], t(src[i])["input_ids"])
    last = batches[-1]
    assert last["loss_mask"][0].sum() > 0
    assert last["loss_mask"][1].sum() == 0 and last["attention_mask"][1].sum() == 0
    assert sum(b["loss_mask"].sum() for b in batches) == sum(t(src[i])["loss_mask"].sum() for i in range(5))


def test_eval_batches_limit(tok):
    src = arithmetic_source(7, "eval")
    t = data.Tokenize(tok, "gemma", 24)
    batches = data.eval_batches(src, t, batch_size=2, limit=2)
    assert len(batches) == 2
    assert all(b["loss_mask"].sum(axis=1).all() for b in batches)  # full batches, no blank rows
    assert len(data.eval_batches(src, t, batch_size=2, limit=0)) == 4


def test_prompts_and_answers_for_messages():
    records = [
        {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]},
        # last turn is the user's: no reference answer, skipped
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Bye"}]},
        {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 1 + 1?"},
                      {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "What is 4 + 4?"}, {"role": "assistant", "content": "8"}]},
    ]
    src = data.ListSource(records, "mem")
    pairs = data.prompts_and_answers(src, "gemma", limit=2)
    assert len(pairs) == 2
    (p0, a0), (p1, a1) = pairs
    assert a0 == "5" and a1 == "2"
    assert p0 == [("<start_of_turn>user\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n", False)]
    assert p1 == chat.render(records[2]["messages"][:-1], "gemma", add_generation_prompt=True)
    assert not any(flag for _, flag in p0 + p1)
    assert len(data.prompts_and_answers(src, "gemma", limit=10)) == 3


def test_prompts_and_answers_for_prompt_completion():
    src = data.ListSource(
        [
            {"prompt": "Q: 2 + 3 =", "completion": " 5"},
            {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
             "completion": [{"role": "assistant", "content": "5"}]},
            {"text": "no answer here"},
        ],
        "mem",
    )
    pairs = data.prompts_and_answers(src, "chatml", limit=10)
    assert pairs == [
        ([("Q: 2 + 3 =", False)], " 5"),
        ([("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", False)], "5"),
    ]


def take(it, n):
    return [next(it) for _ in range(n)]


def test_train_batches_deterministic_by_seed(tok):
    src = arithmetic_source(24)
    t = data.Tokenize(tok, "gemma", 24)
    a = take(data.train_batches(src, t, batch_size=4, seed=0), 3)
    b = take(data.train_batches(src, t, batch_size=4, seed=0), 3)
    c = take(data.train_batches(src, t, batch_size=4, seed=1), 3)
    for batch in a:
        assert batch["input_ids"].shape == (4, 24)
        assert batch["loss_mask"].shape == batch["attention_mask"].shape == (4, 24)
        assert (batch["loss_mask"].sum(axis=1) > 0).all()
    for x, y in zip(a, b):
        for key in ("input_ids", "attention_mask", "loss_mask"):
            np.testing.assert_array_equal(x[key], y[key])
    assert any(not np.array_equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))


def test_train_batches_epoch_is_a_permutation_and_repeats(tok):
    src = arithmetic_source(8)
    t = data.Tokenize(tok, "gemma", 24)
    expected = sorted(tuple(t(src[i])["input_ids"].tolist()) for i in range(8))
    batches = take(data.train_batches(src, t, batch_size=4, seed=3), 4)  # two epochs
    rows = [tuple(r.tolist()) for b in batches for r in b["input_ids"]]
    assert sorted(rows[:8]) == expected
    assert sorted(rows[8:]) == expected


def test_train_batches_without_shuffle_keep_file_order(tok):
    src = arithmetic_source(6)
    t = data.Tokenize(tok, "gemma", 24)
    first = next(data.train_batches(src, t, batch_size=3, seed=0, shuffle=False))
    for i in range(3):
        np.testing.assert_array_equal(first["input_ids"][i], t(src[i])["input_ids"])


def test_tokenize_is_picklable(tok):
    import pickle

    t = data.Tokenize(tok, "gemma", 24)
    t2 = pickle.loads(pickle.dumps(t))
    for key in ("input_ids", "loss_mask"):
        np.testing.assert_array_equal(t2(CONV)[key], t(CONV)[key])


def test_jsonl_end_to_end(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(arithmetic.sft_record(a, b)) for a, b in [(1, 2), (3, 4)]) + "\n")
    src = data.source(str(path))
    t = data.Tokenize(tok, "gemma", 24)
    report = data.validate(src, t)
    assert (report.records, report.bad, report.truncated, report.no_loss_tokens) == (2, 0, 0, 0)
    assert tok.decode(masked_ids(t(src[1]))) == "7<end_of_turn>"


# ============================================================================= formats (TRL)


@pytest.mark.parametrize(
    "record, fmt",
    [
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference"),
        ({"chosen": "a", "rejected": "b"}, "preference"),  # implicit prompt
        ({"messages": [], "chosen": "a", "rejected": "b"}, "preference"),
        ({"prompt": "p", "completion": "c", "label": True}, "unpaired_preference"),
        ({"prompt": "p", "completion": "c", "label": None}, "prompt_completion"),  # null = absent
        ({"prompt": "p", "answer": "42"}, "prompt_only"),
        ({"prompt": "p", "completion": None}, "prompt_only"),
        ({"text": None, "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ],
)
def test_detect_new_formats(record, fmt):
    assert data.detect_format(record) == fmt


def test_data_format_explicit_auto_and_first_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{oops", '{"chosen": "a b", "rejected": "a c"}'])
    src = data.JsonlSource(path)
    assert data.data_format(src) == "preference"  # the malformed first line is passed over
    assert data.data_format(src, "prompt_only") == "prompt_only"
    assert data.data_format(data.ListSource([{"messages": []}], "m")) == "language_modeling"
    with pytest.raises(DataError, match=r"d\.jsonl:1: malformed JSON"):
        data.data_format(data.Subset(src, [0]))
    with pytest.raises(ValueError, match="unknown data format 'dpo'"):
        data.data_format(src, "dpo")


def test_make_transform_picks_by_format(tok):
    def src(*records):
        return data.ListSource(list(records), "m")

    lm = SimpleNamespace(tokenizer=tok, chat_format="gemma")
    t = data.make_transform(src({"text": "x"}), lm, 16, "keep_end", 8)
    assert type(t) is data.Tokenize and t.kind == "sft"
    assert (t.max_length, t.truncation, t.max_prompt_length, t.format) == (16, "keep_end", 8, "auto")
    t = data.make_transform(src({"chosen": "a", "rejected": "b"}), lm, 16)
    assert type(t) is data.TokenizePreference and t.kind == "preference"
    t = data.make_transform(src({"prompt": "a", "completion": "b", "label": False}), lm, 16)
    assert type(t) is data.TokenizeUnpaired and t.kind == "unpaired_preference"
    t = data.make_transform(src({"prompt": "a"}), lm, 16)
    assert type(t) is data.TokenizePrompt and t.max_prompt_length == 16
    t = data.make_transform(src({"text": "a"}), lm, 16, max_prompt_length=4,
                            format="prompt_only")
    assert type(t) is data.TokenizePrompt and t.max_prompt_length == 4
    t = data.make_transform(src({"text": "a"}), lm, 16, format="prompt_completion")
    assert type(t) is data.Tokenize and t.format == "prompt_completion"
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1 or None, got 0"):
        data.TokenizePreference(tok, "gemma", 16, max_prompt_length=0)
    with pytest.raises(ValueError, match="truncation must be 'keep_start' or 'keep_end'"):
        data.Tokenize(tok, "gemma", 16, "middle")


# ----------------------------------------------------------------------------- SFT format pins


def test_sft_rejects_prompt_only_and_preference_records_naming_the_field(tok):
    t = data.Tokenize(tok, "gemma", 16)
    with pytest.raises(DataError, match=r"^x\.jsonl:2: field 'completion' is missing \(a prompt-only"):
        t({"prompt": "What is 2 + 3?", "_where": "x.jsonl:2"})
    with pytest.raises(DataError, match=r"^x\.jsonl:3: a preference record \(columns \['chosen', "
                                        r"'rejected'\]\) cannot be used for SFT"):
        t({"chosen": "a", "rejected": "b", "_where": "x.jsonl:3"})
    # a null value (Parquet / Arrow) is a missing field
    with pytest.raises(DataError, match=r"^f\.parquet:row 4: field 'completion' is missing"):
        t({"prompt": "p", "completion": None, "_where": "f.parquet:row 4"})


def test_sft_explicit_format_requires_its_columns(tok):
    lm = data.Tokenize(tok, "gemma", 16, format="language_modeling")
    with pytest.raises(DataError, match=r"^x:1: field 'text' is missing \(format 'language_modeling' "
                                        r"needs 'text' or 'messages'; columns \['completion', 'prompt'\]\)"):
        lm({"prompt": "a", "completion": "b", "_where": "x:1"})
    pc = data.Tokenize(tok, "gemma", 16, format="prompt_completion")
    with pytest.raises(DataError, match=r"^x:2: field 'prompt' is missing$"):
        pc({"text": "a", "completion": "b", "_where": "x:2"})
    # a record with text *and* prompt/completion is read as prompt/completion when pinned so
    ex = pc({"text": "ignored", "prompt": "Q: 2 + 3 =", "completion": " 5"})
    assert masked_ids(ex) == [*tok.encode(" 5"), tok.eos_id]


def test_mixed_string_and_message_prompt_completion(tok):
    with pytest.raises(DataError, match=r"^x:5: fields 'prompt' and 'completion' must both be strings or "
                                        r"both be lists of messages, got list and str$"):
        data.Tokenize(tok, "gemma", 16)({"prompt": [{"role": "user", "content": "q"}], "completion": "a",
                                         "_where": "x:5"})


def test_sft_max_prompt_length_keeps_the_prompt_end_and_bos(tok):
    record = {"prompt": "What is 2 + 3?", "completion": " 5"}
    p, c = tok.encode("What is 2 + 3?"), tok.encode(" 5")
    ex = data.Tokenize(tok, "gemma", 32, max_prompt_length=4)(record)
    want = [tok.bos_id, *p[-3:], *c, tok.eos_id]
    assert ex["input_ids"][: len(want)].tolist() == want
    assert ex["loss_mask"][: len(want)].tolist() == [0.0] * 4 + [1.0] * (len(c) + 1)
    assert int(ex["truncated"]) == 1
    # a prompt that fits is not marked
    assert int(data.Tokenize(tok, "gemma", 32, max_prompt_length=1 + len(p))(record)["truncated"]) == 0


# ----------------------------------------------------------------------------- preference


def test_preference_strings_explicit_prompt(tok):
    ex = data.TokenizePreference(tok, "gemma", 24)(
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."})
    p = tok.encode("The sky is")
    for side, text in (("chosen", " blue."), ("rejected", " green.")):
        c = tok.encode(text)
        want = [tok.bos_id, *p, *c, tok.eos_id]
        n = len(want)
        assert ex[f"{side}_input_ids"].tolist() == want + [tok.pad_id] * (24 - n)
        assert ex[f"{side}_attention_mask"].tolist() == [1] * n + [0] * (24 - n)
        assert ex[f"{side}_loss_mask"].tolist() == [0.0] * (1 + len(p)) + [1.0] * (len(c) + 1) + [0.0] * (24 - n)
        assert ex[f"{side}_input_ids"].dtype == np.int32 and ex[f"{side}_loss_mask"].dtype == np.float32
    assert sorted(ex) == sorted(f"{s}_{k}" for s in ("chosen", "rejected")
                                for k in ("input_ids", "attention_mask", "loss_mask")) + ["truncated"]
    assert int(ex["truncated"]) == 0


def test_implicit_prompt_strings_like_trl():
    # common characters; the space before the difference goes to the completions
    assert data.implicit_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert data.implicit_prompt("2 + 2 = 4", "2 + 2 = 5") == ("2 + 2 =", " 4", " 5")
    assert data.implicit_prompt("x=4", "x=5") == ("x=", "4", "5")
    assert data.implicit_prompt("abc", "xyz") == ("", "abc", "xyz")


def test_implicit_prompt_messages():
    u = {"role": "user", "content": "Capital of France?"}
    a1, a2 = {"role": "assistant", "content": "Paris"}, {"role": "assistant", "content": "Lyon"}
    assert data.implicit_prompt([u, a1], [u, a2]) == ([u], [a1], [a2])


def test_preference_implicit_prompt_equals_explicit(tok):
    t = data.TokenizePreference(tok, "gemma", 24)
    implicit = t({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    explicit = t({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."})
    for key in explicit:
        np.testing.assert_array_equal(implicit[key], explicit[key])


def test_preference_conversational(tok):
    u = {"role": "user", "content": "What is 2 + 3?"}
    record = {"chosen": [u, {"role": "assistant", "content": "5"}],
              "rejected": [u, {"role": "assistant", "content": "6"}]}
    ex = data.TokenizePreference(tok, "gemma", 32)(record)
    head = tok.encode("<start_of_turn>user\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n")
    eot = tok.token_id("<end_of_turn>")
    for side, answer in (("chosen", "5"), ("rejected", "6")):
        want = [tok.bos_id, *head, *tok.encode(answer), eot, *tok.encode("\n")]
        n = len(want)
        assert ex[f"{side}_input_ids"][:n].tolist() == want
        assert ex[f"{side}_loss_mask"].tolist() == (
            [0.0] * (1 + len(head)) + [1.0] * (len(tok.encode(answer)) + 1) + [0.0] * (32 - n + 1))
        # the same tokens as the equivalent SFT conversation
        sft = data.Tokenize(tok, "gemma", 32)({"messages": record[side]})
        np.testing.assert_array_equal(ex[f"{side}_input_ids"], sft["input_ids"])
        np.testing.assert_array_equal(ex[f"{side}_loss_mask"], sft["loss_mask"])
    # an explicit conversational prompt gives the same
    explicit = data.TokenizePreference(tok, "gemma", 32)(
        {"prompt": [u], "chosen": record["chosen"][1:], "rejected": record["rejected"][1:]})
    for key in ex:
        np.testing.assert_array_equal(ex[key], explicit[key])


def test_preference_truncation_prompt_first_then_sequence(tok):
    record = {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": "Q: 2 + 3 ="}
    p = tok.encode("What is 2 + 3?")
    c, r = tok.encode(" 5"), tok.encode("Q: 2 + 3 =")
    t = data.TokenizePreference(tok, "gemma", 9, max_prompt_length=3)
    ex = t(record)
    assert int(ex["truncated"]) == 1
    # prompt -> BOS + its last 2 tokens; chosen fits; rejected is then cut at 9 (keep_start)
    assert ex["chosen_input_ids"][: 3 + len(c) + 1].tolist() == [tok.bos_id, *p[-2:], *c, tok.eos_id]
    assert ex["rejected_input_ids"].tolist() == [tok.bos_id, *p[-2:], *r][:9]
    assert ex["rejected_loss_mask"].tolist() == [0.0] * 3 + [1.0] * 6
    end = data.TokenizePreference(tok, "gemma", 9, "keep_end", max_prompt_length=3)(record)
    assert end["rejected_input_ids"].tolist() == [tok.bos_id, *p[-2:], *r, tok.eos_id][-9:]
    assert end["rejected_loss_mask"].tolist() == [1.0] * 9
    # only the chosen side is cut: still marked
    long_chosen = data.TokenizePreference(tok, "gemma", 12)(
        {"prompt": "a", "chosen": "What is 2 + 3? What is 2 + 3?", "rejected": " 5"})
    assert int(long_chosen["truncated"]) == 1


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "p", "chosen": "a"}, r"^x:7: field 'rejected' is missing$"),
        ({"prompt": "p", "chosen": " ", "rejected": "b"}, r"^x:7: field 'chosen' is empty$"),
        ({"prompt": "p", "chosen": "a", "rejected": ""}, r"^x:7: field 'rejected' is empty$"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"},
         r"^x:7: field 'chosen' must be a string or a list of messages, got int$"),
        ({"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
         r"^x:7: fields 'chosen' and 'rejected' must both be strings or both be lists of messages, "
         r"got str and list$"),
        ({"chosen": "same", "rejected": "same"},
         r"^x:7: field 'chosen' is empty once the implicit prompt"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": " "}],
          "rejected": [{"role": "assistant", "content": "b"}]},
         r"^x:7: field 'chosen' has an empty assistant turn$"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "bot", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]},
         r"^x:7: field 'chosen': message 0 has role 'bot'"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]},
         r"^x:7: field 'chosen' has no assistant turn to learn from$"),
    ],
)
def test_preference_bad_records(tok, record, message):
    with pytest.raises(DataError, match=message):
        data.TokenizePreference(tok, "gemma", 16)(dict(record, _where="x:7"))


# ----------------------------------------------------------------------------- unpaired preference


def test_unpaired_preference(tok):
    t = data.TokenizeUnpaired(tok, "gemma", 24)
    good = t({"prompt": "What is 2 + 3?", "completion": " 5", "label": True})
    bad = t({"prompt": "What is 2 + 3?", "completion": " 5", "label": False})
    p, c = tok.encode("What is 2 + 3?"), tok.encode(" 5")
    want = [tok.bos_id, *p, *c, tok.eos_id]
    assert good["input_ids"][: len(want)].tolist() == want
    assert good["loss_mask"].tolist() == [0.0] * (1 + len(p)) + [1.0] * (len(c) + 1) + [0.0] * (24 - len(want))
    assert good["label"] == np.float32(1.0) and bad["label"] == np.float32(0.0)
    assert good["label"].dtype == np.float32
    assert sorted(good) == ["attention_mask", "input_ids", "label", "loss_mask", "truncated"]
    np.testing.assert_array_equal(good["input_ids"], bad["input_ids"])
    conv = t({"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
              "completion": [{"role": "assistant", "content": "5"}], "label": np.bool_(True)})
    assert tok.decode(masked_ids(conv)) == "5<end_of_turn>" and conv["label"] == 1.0
    # 1 / 0 as TRL reads them (a pandas or CSV export's labels)
    for number, value in ((1, 1.0), (0, 0.0), (np.int64(1), 1.0)):
        assert t({"prompt": "What is 2 + 3?", "completion": "5", "label": number})["label"] == value


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "p", "completion": "c", "label": 2},
         r"^x:2: field 'label' must be a boolean \(true or false, or 1 / 0\), got int 2$"),
        ({"prompt": "p", "completion": "c", "label": "yes"},
         r"^x:2: field 'label' must be a boolean \(true or false, or 1 / 0\), got str 'yes'$"),
        ({"prompt": "p", "completion": "c", "label": 1.0},
         r"^x:2: field 'label' must be a boolean \(true or false, or 1 / 0\), got float 1.0$"),
        ({"prompt": "p", "completion": "c", "label": None}, r"^x:2: field 'label' is null$"),
        ({"prompt": "p", "completion": "c"}, r"^x:2: field 'label' is missing$"),
        ({"prompt": "p", "completion": "", "label": True}, r"^x:2: field 'completion' is empty$"),
        ({"completion": "c", "label": True}, r"^x:2: field 'prompt' is missing$"),
    ],
)
def test_unpaired_bad_records(tok, record, message):
    with pytest.raises(DataError, match=message):
        data.TokenizeUnpaired(tok, "gemma", 16)(dict(record, _where="x:2"))


# ----------------------------------------------------------------------------- prompt-only


def test_prompt_only_left_padded(tok):
    ex = data.TokenizePrompt(tok, "gemma", 16)({"prompt": "What is 2 + 3?", "answer": "5", "_index": 7})
    want = [tok.bos_id, *tok.encode("What is 2 + 3?")]
    k = 16 - len(want)
    assert ex["prompt_ids"].tolist() == [tok.pad_id] * k + want
    assert ex["prompt_mask"].tolist() == [0] * k + [1] * len(want)
    assert int(ex["truncated"]) == 0 and int(ex["index"]) == 7
    assert sorted(ex) == ["index", "prompt_ids", "prompt_mask", "truncated"]  # arrays only
    assert int(data.TokenizePrompt(tok, "gemma", 16)({"prompt": "x"})["index"]) == -1


def test_prompt_only_conversation_ends_with_generation_prompt(tok):
    from nnx_posttrain.sampling import generate

    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2 + 3?"}]
    ex = data.TokenizePrompt(tok, "gemma", 32)({"prompt": prompt})
    text = "<start_of_turn>user\nAdd.\n\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n"
    want = [tok.bos_id, *tok.encode(text)]
    assert ex["prompt_ids"][-len(want):].tolist() == want
    # what generation encodes for the same prompt (exact-match evaluation)
    lm = type("LM", (), {"tokenizer": tok})()
    assert generate.encode_prompt(lm, chat.render(prompt, "gemma", add_generation_prompt=True)) == want


def test_prompt_only_truncation_keeps_end_and_bos(tok):
    p = tok.encode("What is 2 + 3?")
    ex = data.TokenizePrompt(tok, "gemma", 4)({"prompt": "What is 2 + 3?"})
    assert ex["prompt_ids"].tolist() == [tok.bos_id, *p[-3:]]
    assert ex["prompt_mask"].tolist() == [1, 1, 1, 1] and int(ex["truncated"]) == 1


@pytest.mark.parametrize(
    "record, message",
    [
        ({"answer": "5"}, r"^x:4: field 'prompt' is missing$"),
        ({"prompt": ""}, r"^x:4: field 'prompt' is empty$"),
        ({"prompt": 5}, r"^x:4: field 'prompt' must be a string or a list of messages, got int$"),
        ({"prompt": [{"role": "user"}]}, r"^x:4: field 'prompt': message 0 must be an object with"),
    ],
)
def test_prompt_only_bad_records(tok, record, message):
    with pytest.raises(DataError, match=message):
        data.TokenizePrompt(tok, "gemma", 16)(dict(record, _where="x:4"))


def test_prompt_only_batches_and_extra_columns(tok):
    src = data.ListSource([{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i}
                           for i in range(5)], "mem")
    t = data.TokenizePrompt(tok, "gemma", 16)
    batches = data.eval_batches(src, t, batch_size=2)
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3], [4, -1]]
    assert batches[-1]["prompt_mask"][1].sum() == 0
    assert data.extra_columns(src, batches[-1]["index"]) == [{"answer": "5", "level": 4}, {}]
    assert data.extra_columns(src, [1], exclude=()) == [{"prompt": "What is 1 + 1?", "answer": "2", "level": 1}]
    it = data.train_batches(src, t, batch_size=5, seed=0)
    batch = next(it)
    extras = data.extra_columns(src, batch["index"])
    for row, extra in zip(batch["prompt_ids"], extras):  # each row's answer is its own prompt's
        i = int(extra["answer"]) - 1
        np.testing.assert_array_equal(row, t(src[i])["prompt_ids"])
    assert sorted(int(e["answer"]) for e in extras) == [1, 2, 3, 4, 5]
