"""Tools and environments the agent tests call by 'module:name' (tests/ is on the path)."""

import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"cannot handle {x}")


def undocumented(x: int) -> int:
    return x


class Counter:
    """A stateful environment: ``increment`` adds to a count; the reward is the count."""

    def __init__(self):
        self.count, self.resets = 0, 0

    def reset(self, **record) -> str:
        self.count, self.resets = 0, self.resets + 1
        self.record = record
        return " (count starts at 0)"

    def increment(self, by: int) -> int:
        """Add to the count.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class Quiet:
    """An environment without a reward whose reset adds nothing."""

    def reset(self, **record):
        return None

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


class Failing:
    """An environment whose reset raises."""

    def reset(self, **record):
        raise KeyError("level")


class Unprintable:
    def __str__(self):
        raise ValueError("no text")


def unprintable(x: int):
    """Answers with a value that cannot be written as text.

    Args:
        x: Anything.
    """
    return Unprintable()


def exits(x: int) -> int:
    """Ends the process (as a careless tool may).

    Args:
        x: Anything.
    """
    import sys

    sys.exit(3)


class DictReset:
    """An environment whose reset returns a dict, not text."""

    def reset(self, **record):
        return {"observation": "start"}


class NoRecord:
    """An environment whose reset takes none of the record's columns."""

    def reset(self):
        return None


def judge_that_raises(prompts, pairs):
    """A pairwise judge (nnx-posttrain judge --judge) with a bug: an IndexError on this line."""
    return [0] * len(pairs[len(pairs)])
