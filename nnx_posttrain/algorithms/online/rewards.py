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

import inspect
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nnx_posttrain import chat, data, errors, user_code
from nnx_posttrain.algorithms.online.generation import Completions

_INTEGER_IN = re.compile(r"-?\d+")


def first_integer(text: str) -> str | None:
    """The first integer in a completion, or None."""
    match = _INTEGER_IN.search(text)
    return match.group(0) if match else None


def text_of(completion) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's
    last assistant message (TRL's ``[{"role": "assistant", "content": ...}]``, what rewards get
    for chat prompts; a tool-calling rollout's answer after its tool results)."""
    if isinstance(completion, str):
        return completion
    answers = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return answers[-1] if answers else ""


def exact_match(prompts, completions, answer=None, **_):
    """1.0 when the completion's first integer equals the ``answer`` column, else 0.0."""
    if answer is None:
        raise ValueError("the exact_match reward needs an 'answer' column in the data")
    return [None if a is None else float(first_integer(text_of(c)) == str(a))
            for c, a in zip(completions, answer)]


exact_match.required_columns = ("answer",)


_INTEGER = re.compile(r"\s*-?\d+\s*")


def format_reward(prompts, completions, **_):
    """1.0 when the completion is a bare integer (the task's answer format), else 0.0."""
    return [float(bool(_INTEGER.fullmatch(text_of(c)))) for c in completions]


def length_penalty(prompts, completions, **_):
    """-len(completion) / 100: prefers short answers."""
    return [-len(text_of(c)) / 100.0 for c in completions]


BUILTIN = {"exact_match": exact_match, "format": format_reward, "length": length_penalty}


class RewardModelScore:
    """The score of a reward model trained by ``experiments.reward``, on token ids.

    Called by the rollout with the prompt and completion token ids (``score_rows``); it has no
    text interface because it must see exactly the tokens the policy produced. ``loaded`` is the
    run read back by ``nnx_posttrain.runs.load``."""

    needs_tokens = True

    def __init__(self, run_dir: str | Path, loaded):
        import jax
        from flax import nnx

        if not hasattr(loaded.module, "head"):
            raise errors.RewardError(
                f"--algo.rewards {run_dir}: not a reward-model run "
                f"(its algorithm is {loaded.config.get('algo_name')})")
        self.run_dir = str(run_dir)
        self.tokenizer = loaded.lm.tokenizer
        graphdef, state = nnx.split(loaded.module)
        self._score = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))
        self._state = state
        self.__name__ = Path(run_dir).name
        fmt = loaded.lm.chat_format  # a completion ends as the reward model's training data did
        self._end = self.tokenizer.encode(chat.turn_end(fmt))
        marker = self.tokenizer.token_id(chat.END_OF_TURN[fmt])
        self._stops = {t for t in (self.tokenizer.eos_id, marker) if t is not None}

    def score_rows(self, rows: list[list[int]]) -> list[float]:
        """Scores of (prompt + completion) token rows, each scored as the chat template ends a
        conversation, the sequences the reward model was trained on (TRL renders the
        completion's text in the template): the completion's stop token, if any, replaced by
        the template's end of turn (``chat.turn_end``: Gemma's ``<end_of_turn>\n``), whose
        last token the head reads."""
        ended = []
        for row in rows:
            real = [int(t) for t in row]
            while real and real[-1] in self._stops:
                real.pop()
            ended.append(real + self._end)
        width = -(-max(map(len, ended)) // 16) * 16
        ids = np.zeros((len(ended), width), np.int32)
        mask = np.zeros((len(ended), width), np.int32)
        for i, row in enumerate(ended):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        return [float(x) for x in np.asarray(self._score(self._state, ids, mask))]


def resolve(spec: str, load_run=None) -> list[tuple[str, object]]:
    """``--algo.rewards`` -> [(name, function)]; a clear error for a name that is none of the
    three kinds. ``load_run`` (``nnx_posttrain.runs.load``) reads a reward-model run; without it
    a reward-model run is only checked (its ``config.json``'s algorithm) and stands as None."""
    specs = [x.strip() for x in spec.split(",") if x.strip()]
    out = []
    for name in specs:
        if name in BUILTIN:
            out.append((name, BUILTIN[name]))
        elif ":" in name and not Path(name).exists():
            out.append((name.partition(":")[2],
                        user_code.load(name, "--algo.rewards", errors.RewardError)))
        elif (Path(name) / "config.json").exists():
            out.append((Path(name).name, RewardModelScore(name, load_run(name)) if load_run
                        else _reward_run(name)))
        else:
            raise errors.RewardError(
                f"--algo.rewards {name!r}: not a built-in reward ({', '.join(BUILTIN)}), a "
                "'module:function' path, or a reward-model run directory")
    if not out:
        raise errors.RewardError("--algo.rewards: give at least one reward function")
    if len(set(specs)) < len(specs):
        twice = sorted({x for x in specs if specs.count(x) > 1})
        raise errors.RewardError(
            f"--algo.rewards: {', '.join(twice)} given twice; weigh one reward with "
            "--algo.reward-weights instead")
    names = [name for name, _ in out]  # the metrics' and rewards' keys: one per function
    return [(spec if names.count(name) > 1 else name, fn)
            for spec, (name, fn) in zip(specs, out)]


def _reward_run(run_dir: str) -> None:
    """A reward-model run directory checked by its ``config.json`` (before anything loads)."""
    try:
        algo = json.loads((Path(run_dir) / "config.json").read_text()).get("algo_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise errors.RewardError(
            f"--algo.rewards {run_dir}: its config.json cannot be read ({exc})") from None
    if algo != "RewardConfig":
        what = f"its algorithm is {algo}" if algo else "its config.json names no algorithm: SFT"
        raise errors.RewardError(f"--algo.rewards {run_dir}: not a reward-model run ({what})")


def check(cfg, train_src, data_name: str) -> None:
    """``--algo.rewards`` / ``--algo.reward-weights`` of an online run (``cfg``: its algorithm's
    config) checked before the model loads: each name found and imported, a reward-model run's
    algorithm, the weights' count, the rewards' columns in the first record of ``train_src``."""
    fns = resolve(cfg.rewards)
    weights(cfg.reward_weights, len(fns))
    if len(train_src):
        check_columns([(n, f) for n, f in fns if f is not None],
                      data.extra_columns(train_src, [0], exclude=())[0], data_name)


# the reward function's own arguments, not dataset columns
_NOT_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state")


def required_columns(fn) -> tuple[str, ...]:
    """Dataset columns a reward function needs: those it declares (``fn.required_columns``, as
    the built-in ones do), else the named parameters of its signature without a default (other
    than ``prompts`` and ``completions``); none for a reward model."""
    if getattr(fn, "needs_tokens", False):
        return ()
    declared = getattr(fn, "required_columns", None)
    if declared is not None:
        return tuple(declared)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.name not in _NOT_COLUMNS and p.default is inspect.Parameter.empty
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_columns(reward_fns, columns, data_name: str) -> None:
    """Every reward's required columns are in the data (checked before the first rollout)."""
    have = sorted(c for c in columns if not c.startswith("_"))
    problems = []
    for name, fn in reward_fns:
        missing = [c for c in required_columns(fn) if c not in columns]
        if missing:
            problems.append(f"reward {name!r} needs column(s) {', '.join(map(repr, missing))}")
    if problems:
        raise errors.RewardError(
            f"--algo.rewards: {'; '.join(problems)}, which {data_name} does not have (its "
            f"columns: {', '.join(have) or 'none'}). Add the column(s) to the data, or choose "
            "rewards that fit it (a 'module:function' reward receives every column by name).")


class Call(NamedTuple):
    """What a reward function is called with (TRL's reward signature): the prompts, the
    completions, the data's columns (and ``completion_ids``), one per completion, and TRL's
    ``trainer_state`` (``global_step``, ``max_steps``)."""

    prompts: list
    completions: list
    columns: dict
    state: Any = None

    def row(self, i: int) -> "Call":
        """The call of completion ``i`` alone."""
        return Call(self.prompts[i:i + 1], self.completions[i:i + 1],
                    {k: v[i:i + 1] for k, v in self.columns.items()}, self.state)


def _call(fn, call: Call):
    """``fn(prompts=, completions=, **columns, trainer_state=)``, as TRL calls a reward; a function
    without ``**kwargs`` gets only the arguments it names."""
    kwargs = dict(call.columns, trainer_state=call.state)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(prompts=call.prompts, completions=call.completions, **kwargs)


def score(name: str, fn, call: Call, describe) -> list:
    """``fn``'s rewards of a batch (``call``) as floats (NaN for None). A reward that raises, or
    returns something else than one number (or None) per completion, stops the run with a
    message naming the reward and the first row it fails on (``describe(i)``: where row i comes
    from; called only for that message)."""
    try:
        raw = _call(fn, call)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's function: where it fails
        row = _first_failing_row(fn, call)
        at = f" on {describe(row)}" if row is not None else ""
        raise errors.RewardError(f"reward {name!r} failed{at}{user_code.failure(exc, fn)}"
                                 ) from None
    completions = call.completions
    try:
        values = None if raw is None or isinstance(raw, (str, bytes)) else list(raw)
    except TypeError:  # one number, not one per completion
        values = None
    if values is None or len(values) != len(completions):
        got = (f"{len(values)} values" if values is not None
               else "None" if raw is None else f"a {type(raw).__name__} ({raw!r:.40})")
        raise errors.RewardError(
            f"reward {name!r} returned {got} for {len(completions)} "
            "completions; it must return a list of one number (or None) per "
            "completion")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(np.nan)
            continue
        try:
            if isinstance(v, (str, bytes)):  # float('1') would pass: a reward returns numbers
                raise TypeError
            out.append(float(v))
        except (TypeError, ValueError):
            raise errors.RewardError(
                f"reward {name!r} returned {v!r} on {describe(i)}; expected a "
                "number or None") from None
    return out


def score_batch(reward_fns, reward_weights, src, index, gen: Completions, state=None):
    """The completions ``gen`` of the records of ``src`` at ``index`` -> ([B] sum of the rewards
    times ``reward_weights``, NaN-ignoring as TRL; {name: [B] rewards, NaN where a function does
    not apply}). Each function is called as TRL calls it (``score``): the records' columns,
    conversational completions for conversational prompts, every completion's token ids; a
    reward model reads the prompt and completion tokens. ``gen.conversations``: each completion
    as chat messages (a tool-calling rollout: assistant turns, tool results), given to the
    functions as the conversational completions."""
    texts = gen.texts
    records = data.extra_columns(src, index, exclude=())
    columns = {k: [r.get(k) for r in records] for k in {k for r in records for k in r}}
    prompts = columns.pop("prompt", [None] * len(texts))
    index = np.asarray(index).reshape(-1)
    completions = texts
    if prompts and isinstance(prompts[0], list):
        completions = gen.conversations or [[{"role": "assistant", "content": t}] for t in texts]
    columns["completion_ids"] = [row[m > 0].tolist() for row, m in
                                 zip(np.asarray(gen.completion_ids), np.asarray(gen.completion_mask))]

    def describe(i):  # for an error message only: the record's file:line
        j = int(index[i])
        where = src[j].get("_where", f"record {j}") if j >= 0 else "padding"
        return f"completion {i} ({where}, prompt {str(prompts[i])[:80]!r})"

    per_fn = np.zeros((len(texts), len(reward_fns)), np.float32)
    for j, (name, fn) in enumerate(reward_fns):
        if getattr(fn, "needs_tokens", False):
            values = fn.score_rows(_token_rows(gen.prompt_ids, gen.prompt_mask,
                                               gen.completion_ids, gen.completion_mask))
        else:
            values = score(name, fn, Call(prompts, completions, columns, state), describe)
        per_fn[:, j] = [np.nan if v is None else float(v) for v in values]
    total = np.nansum(per_fn * reward_weights[None, :], axis=1)
    return total, {name: per_fn[:, j] for j, (name, _) in enumerate(reward_fns)}


def _token_rows(prompt_ids, prompt_mask, completion_ids, completion_mask) -> list[list[int]]:
    """Left-padded prompts + completions -> each row's real tokens."""
    ids = np.concatenate([prompt_ids, completion_ids], axis=1)
    mask = np.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
    return [row[m].tolist() for row, m in zip(ids, mask)]


def _first_failing_row(fn, call: Call) -> int | None:
    for i in range(len(call.completions)):
        try:
            _call(fn, call.row(i))
        except (Exception, SystemExit):  # noqa: BLE001
            return i
    return None


def weights(spec: str | None, n: int) -> np.ndarray:
    if not spec:
        return np.ones(n, np.float32)
    try:
        values = [float(x) for x in spec.split(",")]
    except ValueError:
        raise errors.RewardError(
            f"--algo.reward-weights {spec!r}: expected numbers separated by commas, "
            f"one per reward function (e.g. 1.0,0.5)") from None
    if len(values) != n:
        raise errors.RewardError(
            f"--algo.reward-weights has {len(values)} values for {n} reward functions")
    return np.asarray(values, np.float32)
