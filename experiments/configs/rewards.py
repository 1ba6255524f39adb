"""Reward functions used by the shipped configs (TRL's signature: ``f(prompts, completions,
**columns) -> list[float | None]``; the dataset's other columns arrive as keyword lists, and
completions of conversational prompts as ``[{"role": "assistant", "content": ...}]``)."""

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", str(text)).rstrip(".").replace("\\!", "").strip("$")


def boxed_answer(prompts, completions, solution=None, **_):
    """1.0 when the last ``\\boxed{...}`` of the completion equals the ``solution`` column
    (whitespace ignored), 0.0 otherwise; None for a row without a solution."""
    if solution is None:
        raise ValueError("boxed_answer needs a 'solution' column in the data")
    out = []
    for completion, answer in zip(completions, solution):
        if answer is None:
            out.append(None)
            continue
        if not isinstance(completion, str):  # a conversational completion, as TRL passes it
            completion = "".join(m["content"] for m in completion)
        found = _BOXED.findall(completion)
        out.append(float(bool(found) and _normalise(found[-1]) == _normalise(answer)))
    return out
