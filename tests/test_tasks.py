"""The built-in task: a sloppy teacher's demonstrations, an exact checker, disjoint splits."""

import collections

import pytest

from nnx_posttrain import data
from nnx_posttrain.tasks import arithmetic as A
from nnx_posttrain.tasks import records


def _answer(record):
    return record["messages"][-1]["content"]


def test_splits_are_disjoint_and_fixed():
    train, ev = A.problems("train"), A.problems("eval")
    assert len(ev) == A.EVAL_SIZE and not set(train) & set(ev)
    assert A.problems("eval") == ev  # the same on every call (and machine: a seeded shuffle)
    with pytest.raises(ValueError, match="unknown split"):
        A.problems("test")


def test_the_teacher_is_right_without_a_carry_and_forgets_most_carries():
    train = A.problems("train")
    demos = records("sft", "train")
    kinds = collections.Counter()
    for (a, b), rec in zip(train, demos):
        answer = int(_answer(rec))
        if not A.carries(a, b):
            assert answer == a + b
            kinds["no carry"] += 1
        else:
            assert answer in (a + b, a + b - 10)
            kinds["slip" if answer == a + b - 10 else "carried"] += 1
    carry = kinds["slip"] + kinds["carried"]
    assert 0.40 < carry / len(train) < 0.50  # units digits carry on ~45% of the problems
    assert kinds["slip"] / carry == pytest.approx(A.SLIP_RATE, abs=0.03)
    # a plateau, not a cliff: imitating the teacher's most frequent answer is right exactly on
    # the carry-free problems
    assert A.SLIP_RATE > 0.5
    # then the one-digit table, repeated, answered by the same teacher
    table = demos[len(train):]
    assert len(table) == 100 * A.TABLE_REPEATS
    assert A.demonstrations()[len(train):][:100] == [(a, b) for a in range(10) for b in range(10)]
    assert not set(A.demonstrations()) & set(A.problems("eval"))


def test_held_out_records_and_the_checker_use_the_correct_sum():
    for (a, b), sft, prompt in zip(A.problems("eval"), records("sft", "eval"),
                                   records("prompt_only", "eval")):
        assert _answer(sft) == prompt["answer"] == str(a + b)
        assert A.is_correct(f" {a + b}", prompt["answer"])
        assert not A.is_correct(str(a + b - 10), prompt["answer"])


@pytest.mark.parametrize("split", ["train", "eval"])
def test_preference_pairs_reject_the_teachers_mistake_and_labels_follow_the_checker(split):
    for (a, b), pair, unpaired in zip(A.problems(split), records("preference", split),
                                      records("unpaired_preference", split)):
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        assert chosen == str(a + b) and rejected != chosen and int(rejected) >= 0
        if A.carries(a, b):
            assert rejected == str(a + b - 10)  # the forgotten carry
        completion = unpaired["completion"][0]["content"]
        assert unpaired["label"] == (completion == str(a + b))


def test_the_data_is_a_fixed_function_of_the_problem():
    assert records("sft", "train") == records("sft", "train")
    assert records("preference", "eval") == records("preference", "eval")
    assert data.source("builtin", "train")[3]["messages"] == records("sft", "train")[3]["messages"]
