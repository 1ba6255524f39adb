"""The built-in image task: count the coloured shapes in a small picture drawn in code.

Each problem is a 32 x 32 RGB picture (a ``uint8`` array drawn with numpy: no file, no download)
holding 1 to ``MAX_SHAPES`` shapes (squares and discs of three colours, one in each quarter it
uses, so none hides another) on a grey background,
and a question: how many shapes of one colour ("How many red shapes are in the picture?"); the
answer is a number, checked exactly (``arithmetic.is_correct`` reads it). Records are TRL's vision
format: an ``images`` column (one image) beside a conversation whose user turn starts with a
``{"type": "image"}`` part.

Every record is a fixed function of its index and the ``seed`` (``problem(i, seed)``): the same
seed gives the same pictures and questions on every machine; train and eval draw from disjoint
index ranges. ``--data builtin:shapes`` reads them (registered by ``tasks.register()``).
"""

from __future__ import annotations

import numpy as np

SIZE = 32
MAX_SHAPES = 4
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220)}
BACKGROUND = 128
SEED = 0
SIZES = {"train": 4000, "eval": 200}
_EVAL_OFFSET = 1_000_000  # eval indices: a range train never reaches


def _shape(canvas: np.ndarray, rng: np.random.Generator, colour, cell: int) -> None:
    """One square or disc of side / diameter 6-9 pixels at a random place in quarter ``cell`` of
    the picture (one shape a quarter: none hides another), drawn in ``colour``."""
    side, half = int(rng.integers(6, 10)), SIZE // 2
    top, left = (int(v) for v in rng.integers(0, half - side + 1, size=2))
    top, left = top + half * (cell // 2), left + half * (cell % 2)
    if rng.random() < 0.5:
        canvas[top:top + side, left:left + side] = colour
        return
    yy, xx = np.mgrid[:side, :side]
    r = (side - 1) / 2
    disc = (yy - r) ** 2 + (xx - r) ** 2 <= r * r + 0.5
    canvas[top:top + side, left:left + side][disc] = colour


def problem(index: int, seed: int = SEED) -> tuple[np.ndarray, str, int]:
    """(picture, colour asked, count) of problem ``index``: a fixed function of both."""
    rng = np.random.default_rng([seed, index])
    canvas = np.full((SIZE, SIZE, 3), BACKGROUND, np.uint8)
    names = list(COLOURS)
    n = int(rng.integers(1, MAX_SHAPES + 1))
    drawn = [names[int(k)] for k in rng.integers(0, len(names), size=n)]
    for name, cell in zip(drawn, rng.permutation(MAX_SHAPES)[:n]):
        _shape(canvas, rng, COLOURS[name], int(cell))
    asked = names[int(rng.integers(0, len(names)))]
    return canvas, asked, drawn.count(asked)


def question(colour: str) -> str:
    return f"How many {colour} shapes are in the picture?"


def _indices(split: str) -> range:
    if split not in SIZES:
        raise ValueError(f"unknown split {split!r}: expected 'train' or 'eval'")
    start = 0 if split == "train" else _EVAL_OFFSET
    return range(start, start + SIZES[split])


def _user(colour: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                             "text": question(colour)}]}]


def sft_record(index: int, seed: int = SEED) -> dict:
    """A conversation (``messages``) with its picture and the count as the answer."""
    image, colour, count = problem(index, seed)
    return {"images": [image], "messages": _user(colour) + [
        {"role": "assistant", "content": str(count)}]}


def prompt_record(index: int, seed: int = SEED) -> dict:
    """A prompt-only record with its picture and the expected ``answer`` (evaluation and RL)."""
    image, colour, count = problem(index, seed)
    return {"images": [image], "prompt": _user(colour), "answer": str(count)}


def preference_record(index: int, seed: int = SEED) -> dict:
    """A preference pair: the right count chosen, a count off by one rejected."""
    image, colour, count = problem(index, seed)
    wrong = count + 1 if count == 0 or index % 2 else count - 1
    return {"images": [image], "prompt": _user(colour),
            "chosen": [{"role": "assistant", "content": str(count)}],
            "rejected": [{"role": "assistant", "content": str(wrong)}]}


def unpaired_record(index: int, seed: int = SEED) -> dict:
    """An unpaired example: the right count (label true) on even indices, a wrong one on odd."""
    pair = preference_record(index, seed)
    good = index % 2 == 0
    return {"images": pair["images"], "prompt": pair["prompt"],
            "completion": pair["chosen"] if good else pair["rejected"], "label": good}


_RECORDS = {"sft": sft_record, "preference": preference_record,
            "unpaired_preference": unpaired_record, "prompt_only": prompt_record}


def records(kind: str, split: str, seed: int = SEED) -> list[dict]:
    """The task's records of one format (``kind``) and split."""
    return [_RECORDS[kind](i, seed) for i in _indices(split)]
