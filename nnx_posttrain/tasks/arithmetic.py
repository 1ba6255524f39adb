"""The built-in task: two-digit addition asked in chat form, checkable by a program.

It needs no network and no download, and its answers can be checked exactly, so it serves as the
default data for every algorithm. It is built so that the methods differ in what they can learn:

- **Demonstrations come from a sloppy teacher** (the SFT data: ``demonstrations``, answered by
  ``demonstration``): right on every problem whose units digits do not carry, but on a problem
  with a carry (``carries``: a % 10 + b % 10 >= 10, about 45% of the problems) the teacher
  forgets the carry ``SLIP_RATE`` of the time and writes a + b - 10. SFT imitates the teacher, mistakes included: its greedy answer is
  the teacher's most frequent one, right without a carry and wrong with one, so its held-out
  exact match settles on a plateau near the share of carry-free problems (not on a learning
  curve's cliff, where rounding decides the outcome), and continuing SFT does not leave it.
- **The checker is exact** (``is_correct``): the preference pairs (chosen = the correct sum,
  rejected = the teacher's forgotten carry, or a plausible wrong answer on a problem without a
  carry), the unpaired labels and the online methods' reward come from it. They cover what the
  demonstrations get wrong, so preference and RL methods can show what imitation alone does not
  give (the SFT model still puts some probability on the right carry, which RL samples find).

Both operands have two digits (10 .. 99), so every question has the same layout. Train and eval
problems are disjoint: all 8,100 pairs (a, b) are shuffled once with a fixed seed; the first
``EVAL_SIZE`` are held out. Held-out records carry the correct answer (eval loss and exact match
measure the truth, not the teacher). Every record is a fixed
function of its problem (no run's ``--seed`` changes the data, as with a data file).
"""

from __future__ import annotations

import random
import re

EVAL_SIZE = 500
_SPLIT_SEED = 1234
TABLE_REPEATS = 10
"""How often the demonstrations repeat the one-digit addition table (see ``demonstrations``)."""
SLIP_RATE = 0.9
"""Fraction of the problems with a carry on which the teacher forgets it (> 0.5: the imitated
greedy answer is the slip; < 1: the right answer keeps some probability for RL to find)."""


def _all_pairs() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def problems(split: str) -> list[tuple[int, int]]:
    """The (a, b) pairs of a split: 'train' (7,600) or 'eval' (500)."""
    pairs = _all_pairs()
    if split == "eval":
        return pairs[:EVAL_SIZE]
    if split == "train":
        return pairs[EVAL_SIZE:]
    raise ValueError(f"unknown split {split!r}: expected 'train' or 'eval'")


def demonstrations() -> list[tuple[int, int]]:
    """The problems the teacher demonstrates (the SFT training records): the training split, and
    the one-digit table (0 .. 9 + 0 .. 9) ``TABLE_REPEATS`` times. The table is the units-digit
    lookup every problem needs, at the simplest positions; without it the tiny model learns that
    lookup (addition mod 10) after anywhere from ~300 to over 1,500 steps, depending on the seed
    and even on rounding, with it within ~400."""
    return problems("train") + [(a, b) for a in range(10) for b in range(10)] * TABLE_REPEATS


def carries(a: int, b: int) -> bool:
    """Whether the units digits carry into the tens."""
    return a % 10 + b % 10 >= 10


def _rng(a: int, b: int, salt: int) -> random.Random:
    return random.Random(salt * 1_000_003 + a * 100 + b)


def slips(a: int, b: int) -> bool:
    """Whether the teacher forgets the carry on this problem (a fixed draw per problem)."""
    return carries(a, b) and _rng(a, b, 7).random() < SLIP_RATE


def demonstration(a: int, b: int) -> str:
    """The teacher's answer: the sum, or a + b - 10 where it forgets the carry (``slips``)."""
    return str(a + b - 10 if slips(a, b) else a + b)


def _chat(a: int, b: int, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question(a, b)},
            {"role": "assistant", "content": answer},
        ]
    }


def sft_record(a: int, b: int) -> dict:
    """One conversational record with the correct answer (TRL's `messages` column): the held-out
    split's SFT records."""
    return _chat(a, b, str(a + b))


def demonstration_record(a: int, b: int) -> dict:
    """One conversational record with the teacher's answer: the training split's SFT records."""
    return _chat(a, b, demonstration(a, b))


def rejected_answer(a: int, b: int, seed: int = 0) -> str:
    """The wrong answer of a preference pair: the forgotten carry (a + b - 10) where the problem
    carries, else a plausible wrong one (``wrong_answer``). Deterministic."""
    if carries(a, b):
        return str(a + b - 10)
    return wrong_answer(a, b, _rng(a, b, seed))


def preference_record(a: int, b: int, seed: int = 0) -> dict:
    """A conversational preference pair (TRL's prompt / chosen / rejected columns), judged by the
    checker: the correct sum is chosen, ``rejected_answer`` rejected."""
    return {
        "prompt": [{"role": "user", "content": question(a, b)}],
        "chosen": [{"role": "assistant", "content": str(a + b)}],
        "rejected": [{"role": "assistant", "content": rejected_answer(a, b, seed)}],
    }


def unpaired_record(a: int, b: int, seed: int = 0) -> dict:
    """An unpaired preference example (TRL's prompt / completion / label), labelled by the
    checker: half of the problems get the correct answer (label True), the others
    ``rejected_answer`` (label False)."""
    good = _rng(a, b, seed + 1).random() < 0.5
    answer = str(a + b) if good else rejected_answer(a, b, seed)
    return {
        "prompt": [{"role": "user", "content": question(a, b)}],
        "completion": [{"role": "assistant", "content": answer}],
        "label": good,
    }


def prompt_record(a: int, b: int) -> dict:
    """A prompt-only record with the expected answer, for evaluation and RL."""
    return {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)}


def wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A plausible wrong answer, like a small model's own mistakes: mostly a units digit off by
    1 to 3, otherwise a forgotten or spurious carry (off by 10)."""
    right = a + b
    if rng.random() < 0.7:
        candidates = [right + d for d in (-3, -2, -1, 1, 2, 3)]
    else:
        candidates = [right - 10, right + 10]
    return str(rng.choice([c for c in candidates if c >= 0]))


_INT = re.compile(r"-?\d+")


def extract_answer(text: str) -> str | None:
    """The first integer in a completion, or None."""
    match = _INT.search(text)
    return match.group(0) if match else None


def is_correct(completion: str, answer: str) -> bool:
    return extract_answer(completion) == answer


def corpus() -> list[str]:
    """Text the built-in tokenizer is trained on: every question and answer of the task."""
    lines = []
    for a, b in _all_pairs():
        lines.append(question(a, b))
        lines.append(str(a + b))
    return lines
