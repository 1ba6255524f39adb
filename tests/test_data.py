"""Data: JSONL reading, format detection, tokenization and loss masks, batching."""

import json

import numpy as np
import pytest

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras / keras_hub are imported)
import keras_hub  # noqa: E402

from nnx_posttrain import arithmetic, chat, data  # noqa: E402
from nnx_posttrain import tokenizer as tk  # noqa: E402
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
    assert ev[0]["_where"] == "builtin:eval[0]"


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
    with pytest.raises(DataError, match="'prompt'"):
        data.detect_format({"prompt": "only a prompt"})


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
    counts = data.validate(src, data.Tokenize(tok, "gemma", 12))
    assert counts == {"records": 3, "truncated": 2, "no_loss_tokens": 1}


def test_validate_stops_on_a_bad_record(tmp_path, tok):
    path = write_jsonl(tmp_path / "file.jsonl", ['{"text": "a"}', '{"text": "b"}', '{"txt": "c"}'])
    with pytest.raises(DataError, match=r"file\.jsonl:3: cannot tell the format"):
        data.validate(data.JsonlSource(path), data.Tokenize(tok, "gemma", 16))


def test_validate_empty_source(tmp_path, tok):
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no records"):
        data.validate(data.JsonlSource(path), data.Tokenize(tok, "gemma", 16))


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
    assert data.validate(src, t) == {"records": 2, "truncated": 0, "no_loss_tokens": 0}
    assert tok.decode(masked_ids(t(src[1]))) == "7<end_of_turn>"
