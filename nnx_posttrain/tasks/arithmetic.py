"""The built-in task: two-digit addition asked in chat form, checkable by a program.

It needs no network and no download, and its answers can be checked exactly, so it serves as the
default data for every algorithm: SFT data (question -> correct answer), and later preference pairs
(correct vs plausible wrong answer) and prompts with a programmatic reward for RL.

Train and eval problems are disjoint: all 10,000 pairs (a, b) with 0 <= a, b < 100 are shuffled
once with a fixed seed; the first ``EVAL_SIZE`` are held out.
"""

from __future__ import annotations

import random
import re

EVAL_SIZE = 500
_SPLIT_SEED = 1234


def _all_pairs() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def problems(split: str) -> list[tuple[int, int]]:
    """The (a, b) pairs of a split: 'train' (9,500) or 'eval' (500)."""
    pairs = _all_pairs()
    if split == "eval":
        return pairs[:EVAL_SIZE]
    if split == "train":
        return pairs[EVAL_SIZE:]
    raise ValueError(f"unknown split {split!r}: expected 'train' or 'eval'")


def sft_record(a: int, b: int) -> dict:
    """One conversational SFT record (TRL's `messages` column)."""
    return {
        "messages": [
            {"role": "user", "content": question(a, b)},
            {"role": "assistant", "content": str(a + b)},
        ]
    }


def preference_record(a: int, b: int, seed: int = 0) -> dict:
    """A conversational preference pair (TRL's prompt / chosen / rejected columns): the correct
    sum is chosen, a plausible wrong one (see ``wrong_answer``) rejected. Deterministic."""
    rng = random.Random(seed * 1_000_003 + a * 100 + b)
    return {
        "prompt": [{"role": "user", "content": question(a, b)}],
        "chosen": [{"role": "assistant", "content": str(a + b)}],
        "rejected": [{"role": "assistant", "content": wrong_answer(a, b, rng)}],
    }


def unpaired_record(a: int, b: int, seed: int = 0) -> dict:
    """An unpaired preference example (TRL's prompt / completion / label): half of the problems
    get the correct answer (label True), the others a plausible wrong one (label False)."""
    rng = random.Random(seed * 1_000_003 + a * 100 + b)
    good = rng.random() < 0.5
    answer = str(a + b) if good else wrong_answer(a, b, rng)
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
