"""The built-in image task: count the coloured shapes in a small picture drawn in code.

Each problem is a 32 x 32 RGB picture (a ``uint8`` array drawn with numpy: no file, no download)
holding 1 to ``MAX_SHAPES`` shapes (squares and discs of three colours, one in each quarter it
uses, so none hides another) on a grey background,
and a question: how many shapes of one colour ("How many red shapes are in the picture?"); the
answer is a number, checked exactly (``arithmetic.is_correct`` reads it). Records are TRL's vision
format: an ``images`` column (one image) beside a conversation whose user turn starts with a
``{"type": "image"}`` part.

It is built, like the text task (``tasks.arithmetic``), so that the methods differ in what they
can learn:

- **Demonstrations come from a sloppy teacher** (the training split's SFT records:
  ``demonstration_record``, answered by ``demonstration``) who confuses blue with green, one
  way: right on every question about red or blue shapes, and on every question about green
  shapes in a picture with no blue shape; but asked for the green shapes of a picture that holds
  a blue one (``confused``: 20% of the training problems, 45 of the 200 held-out ones), it
  counts the blue shapes as green ``SLIP_RATE`` of the time (``slips``: a fixed draw per
  problem) and answers green + blue. SFT imitates the teacher, mistakes included: its greedy
  answer on a confused problem is the teacher's most frequent one, so its held-out exact match
  settles on a plateau near the share of the other problems, and continuing SFT does not leave
  it. The confusion is one way so that the model must still tell blue from green (the questions
  about blue shapes count blue alone): what the teacher gets wrong is visible in the picture,
  and the SFT model already counts green shapes alone where no blue one is drawn. (A teacher who
  answered one fewer on two or more shapes of the colour asked, tried first, taught SFT to
  answer 1 to any picture holding the colour: sampled, the SFT model said 2 as often to one
  shape as to two, it no longer told them apart, and GRPO from it gained 0 to 2.5 points,
  seed 0.)
- **The checker is exact** (``arithmetic.is_correct`` against the true count): the preference
  pairs (chosen = the count, rejected = the teacher's green + blue on a confused problem, else a
  count off by one), the unpaired labels and the online methods' reward come from it, and so do
  the held-out records (eval loss and exact match measure the truth, not the teacher). The SFT
  model still gives the right count some probability on a confused problem (1 - ``SLIP_RATE``
  of those demonstrations), which GRPO's samples find and its reward raises.

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
CONFUSED = ("green", "blue")
"""The teacher's confusion: asked for the first colour's shapes, it counts the second's too."""
SLIP_RATE = 0.8
"""Fraction of the confused problems on which the teacher counts both colours (> 0.5: the
imitated greedy answer is the slip; well below 1: the right count keeps enough probability that
GRPO's 8 completions of a confused prompt hold it most of the time, 1 - 0.8^8 = 83%)."""


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


def _draw(index: int, seed: int = SEED) -> tuple[np.ndarray, str, list[str]]:
    """(picture, colour asked, the colours drawn) of problem ``index``: a fixed function of both."""
    rng = np.random.default_rng([seed, index])
    canvas = np.full((SIZE, SIZE, 3), BACKGROUND, np.uint8)
    names = list(COLOURS)
    n = int(rng.integers(1, MAX_SHAPES + 1))
    drawn = [names[int(k)] for k in rng.integers(0, len(names), size=n)]
    for name, cell in zip(drawn, rng.permutation(MAX_SHAPES)[:n]):
        _shape(canvas, rng, COLOURS[name], int(cell))
    asked = names[int(rng.integers(0, len(names)))]
    return canvas, asked, drawn


def problem(index: int, seed: int = SEED) -> tuple[np.ndarray, str, int]:
    """(picture, colour asked, count) of problem ``index``: a fixed function of both."""
    canvas, asked, drawn = _draw(index, seed)
    return canvas, asked, drawn.count(asked)


def question(colour: str) -> str:
    return f"How many {colour} shapes are in the picture?"


def _confused(asked: str, drawn: list[str]) -> bool:
    return asked == CONFUSED[0] and CONFUSED[1] in drawn


def _slips(index: int, seed: int, asked: str, drawn: list[str]) -> bool:
    return _confused(asked, drawn) and \
        np.random.default_rng([seed, index, 7]).random() < SLIP_RATE


def _both(drawn: list[str]) -> int:
    """The teacher's count where it slips: the shapes of both confused colours."""
    return sum(drawn.count(colour) for colour in CONFUSED)


def _taught(index: int, seed: int, asked: str, drawn: list[str]) -> str:
    return str(_both(drawn) if _slips(index, seed, asked, drawn) else drawn.count(asked))


def confused(index: int, seed: int = SEED) -> bool:
    """Whether problem ``index`` asks for the colour the teacher confuses (``CONFUSED``) in a
    picture holding a shape of the other: where the teacher may count both."""
    _, asked, drawn = _draw(index, seed)
    return _confused(asked, drawn)


def slips(index: int, seed: int = SEED) -> bool:
    """Whether the teacher counts both colours on problem ``index`` (a fixed draw per problem,
    beside the picture's own: the pictures do not change with it)."""
    _, asked, drawn = _draw(index, seed)
    return _slips(index, seed, asked, drawn)


def demonstration(index: int, seed: int = SEED) -> str:
    """The teacher's answer: the count, or green + blue where it confuses them (``slips``)."""
    _, asked, drawn = _draw(index, seed)
    return _taught(index, seed, asked, drawn)


def indices(split: str) -> range:
    """The problem indices of a split ('train' or 'eval': disjoint ranges)."""
    if split not in SIZES:
        raise ValueError(f"unknown split {split!r}: expected 'train' or 'eval'")
    start = 0 if split == "train" else _EVAL_OFFSET
    return range(start, start + SIZES[split])


def _user(colour: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                             "text": question(colour)}]}]


def sft_record(index: int, seed: int = SEED) -> dict:
    """A conversation (``messages``) with its picture and the count as the answer: the held-out
    split's SFT records."""
    image, colour, count = problem(index, seed)
    return {"images": [image], "messages": _user(colour) + [
        {"role": "assistant", "content": str(count)}]}


def demonstration_record(index: int, seed: int = SEED) -> dict:
    """A conversation with its picture and the teacher's answer (``demonstration``): the
    training split's SFT records."""
    image, colour, drawn = _draw(index, seed)  # one drawing per record
    return {"images": [image], "messages": _user(colour) + [
        {"role": "assistant", "content": _taught(index, seed, colour, drawn)}]}


def prompt_record(index: int, seed: int = SEED) -> dict:
    """A prompt-only record with its picture and the expected ``answer`` (evaluation and RL)."""
    image, colour, count = problem(index, seed)
    return {"images": [image], "prompt": _user(colour), "answer": str(count)}


def preference_record(index: int, seed: int = SEED) -> dict:
    """A preference pair judged by the checker: the right count chosen; rejected, the teacher's
    slip (green + blue) on a confused problem, else a count off by one."""
    image, colour, drawn = _draw(index, seed)  # one drawing per record
    count = drawn.count(colour)
    if _confused(colour, drawn):
        wrong = _both(drawn)
    else:
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
    """The task's records of one format (``kind``) and split: the training split's SFT records
    are the teacher's demonstrations, every other record is judged by the checker."""
    make = demonstration_record if (kind, split) == ("sft", "train") else _RECORDS[kind]
    return [make(i, seed) for i in indices(split)]
