"""Reward functions for online RL (GRPO, RLOO, PPO, online DPO).

A reward function has TRL's signature: ``f(prompts, completions, **columns) -> list[float | None]``
— ``prompts`` as the dataset gives them (a string or a conversation), ``completions`` the generated
text (stop marker removed), ``columns`` the dataset's other columns for the same rows (e.g. the
built-in task's ``answer``). ``None`` means "does not apply" and is left out of means and sums.

``--algo.rewards`` names them, comma-separated:
- a built-in name: ``exact_match`` (1 when the completion's first integer is the ``answer``
  column), ``format`` (1 when the completion is just an integer), ``length`` (-characters/100);
- ``package.module:function`` — any importable function with the signature above;
- a reward-model run directory (trained by ``python -m experiments.reward``): its scalar score of
  the prompt and completion tokens. It must use the policy's tokenizer.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np

_INTEGER_IN = re.compile(r"-?\d+")


def first_integer(text: str) -> str | None:
    """The first integer in a completion, or None."""
    match = _INTEGER_IN.search(text)
    return match.group(0) if match else None


def exact_match(prompts, completions, answer=None, **_):
    """1.0 when the completion's first integer equals the ``answer`` column, else 0.0."""
    if answer is None:
        raise ValueError("the exact_match reward needs an 'answer' column in the data")
    return [None if a is None else float(first_integer(c) == str(a))
            for c, a in zip(completions, answer)]


_INTEGER = re.compile(r"\s*-?\d+\s*")


def format_reward(prompts, completions, **_):
    """1.0 when the completion is a bare integer (the task's answer format), else 0.0."""
    return [float(bool(_INTEGER.fullmatch(c))) for c in completions]


def length_penalty(prompts, completions, **_):
    """-len(completion) / 100: prefers short answers."""
    return [-len(c) / 100.0 for c in completions]


BUILTIN = {"exact_match": exact_match, "format": format_reward, "length": length_penalty}


class RewardModelScore:
    """The score of a reward model trained by ``experiments.reward``, on token ids.

    Called by the rollout with the prompt and completion token ids (``score_tokens``); it has no
    text interface because it must see exactly the tokens the policy produced. ``loaded`` is the
    run read back by ``nnx_posttrain.runs.load``."""

    needs_tokens = True

    def __init__(self, run_dir: str | Path, loaded):
        import jax
        from flax import nnx

        if not hasattr(loaded.module, "head"):
            raise SystemExit(f"--algo.rewards {run_dir}: not a reward-model run "
                             f"(its algorithm is {loaded.config.get('algo_name')})")
        self.run_dir = str(run_dir)
        self.tokenizer = loaded.lm.tokenizer
        graphdef, state = nnx.split(loaded.module)
        self._score = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))
        self._state = state
        self.__name__ = Path(run_dir).name

    def score_tokens(self, ids: np.ndarray, mask: np.ndarray) -> list[float]:
        """Scores of right-padded token rows ``ids`` [B, L] with attention ``mask``."""
        return [float(x) for x in np.asarray(self._score(self._state, ids, mask))]


def resolve(spec: str, load_run=None) -> list[tuple[str, object]]:
    """``--algo.rewards`` -> [(name, function)]; a clear error for a name that is none of the
    three kinds. ``load_run`` (``nnx_posttrain.runs.load``) reads a reward-model run."""
    out = []
    for name in (x.strip() for x in spec.split(",") if x.strip()):
        if name in BUILTIN:
            out.append((name, BUILTIN[name]))
        elif ":" in name and not Path(name).exists():
            module_name, _, attr = name.partition(":")
            try:
                fn = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise SystemExit(f"--algo.rewards {name}: cannot import it ({exc})") from None
            out.append((attr, fn))
        elif (Path(name) / "config.json").exists() and load_run is not None:
            out.append((Path(name).name, RewardModelScore(name, load_run(name))))
        else:
            raise SystemExit(
                f"--algo.rewards {name!r}: not a built-in reward ({', '.join(BUILTIN)}), a "
                "'module:function' path, or a reward-model run directory")
    if not out:
        raise SystemExit("--algo.rewards: give at least one reward function")
    return out


def weights(spec: str | None, n: int) -> np.ndarray:
    if not spec:
        return np.ones(n, np.float32)
    values = [float(x) for x in spec.split(",")]
    if len(values) != n:
        raise SystemExit(f"--algo.reward-weights has {len(values)} values for {n} reward functions")
    return np.asarray(values, np.float32)
