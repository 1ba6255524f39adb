"""Head-to-head win rates (``nnx-posttrain judge RUN_A RUN_B --prompts FILE``): both runs answer
the same prompts with the same sampling settings and seed, and a judge picks the better answer of
each pair (AlpacaEval's and TRL's ``WinRateCallback``'s measure).

Judges (``--judge``):

- ``exact`` (the default when the prompts have an ``answer`` column): the exact checker, the
  answer whose first integer equals ``answer`` wins; both right or both wrong is a tie;
- a reward-model run directory (``experiments.reward``): the higher score wins, equal scores tie
  (it reads the token ids, so it must share the runs' tokenizer);
- ``module:name``: TRL's pairwise judge, a function ``judge(prompts, completion_pairs) -> list``
  or an object with that ``judge`` method (``trl.BasePairwiseJudge``): each entry the index (0 or
  1) of the better completion, -1 for none. It is asked in both orders; a verdict that changes
  with the order is a tie.

The result: A's win rate with ties counted half (AlpacaEval's) with a 95% bootstrap interval over
prompts, wins, losses and ties, examples where the answers differ; written from each side into
``RUN/judge/<other run's name>.json`` (``<name>-<8 hex digits>.json`` where that name's file holds
the result against another run of the same name: results are never overwritten by another run's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from nnx_posttrain import data, errors, runs, user_code
from nnx_posttrain.sampling import sampler

_INTEGER = re.compile(r"-?\d+")


def read_prompts(path: str) -> list[dict]:
    """The prompts file's records (``prompt``: a user message or a conversation; other columns
    kept), each checked (``DataError`` naming the line)."""
    src = data.source(str(path), "train", builtin="prompt_only")
    records = [src[i] for i in range(len(src))]
    for r in records:
        prompt = r.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            raise errors.DataError(f"{r.get('_where', path)}: field 'prompt' must be a message "
                                   "or a conversation")
    if not records:
        raise errors.DataError(f"{path}: no prompts")
    return records


def answers(run_dir, records, sampling: sampler.Sampling,
            echo=print) -> tuple[list[str], list[list[int]], list[list[int]], object]:
    """``run_dir``'s answers to the records' prompts (its chat template), sampled as
    ``sampling`` says (its max_new_tokens, temperature, top_p, seed), with the prompt and answer
    token ids, and its tokenizer."""
    max_new_tokens = sampling.max_new_tokens
    runs.check_policy(run_dir)
    run = runs.load(run_dir, echo=echo)
    lm, module = run.lm, run.policy()
    prompts = [sampler.chat_prompt(lm, r["prompt"]) for r in records]
    sampler.check_generation(module, min(64, len(prompts)), max(map(len, prompts)),
                             max_new_tokens, "--max-new-tokens")
    from flax import nnx

    graphdef, *states = nnx.split(module)
    sample = sampler.make_sampler(graphdef, max_new_tokens, pad_id=lm.tokenizer.pad_id)
    texts = sampler.sample_ids(lm, sample, states, prompts, sampling,
                               batch_size=min(64, len(prompts)))
    return texts, prompts, [lm.tokenizer.encode(t) for t in texts], lm.tokenizer


def _first_integer(text: str) -> str | None:
    match = _INTEGER.search(text)
    return match.group(0) if match else None


def exact_verdicts(records, a: list[str], b: list[str]) -> np.ndarray:
    """+1 (A wins), -1 (B wins), 0 (tie) by the exact checker."""
    if any(r.get("answer") is None for r in records):
        where = next(r.get("_where", "a record") for r in records if r.get("answer") is None)
        raise errors.DataError(f"{where}: the exact judge needs an 'answer' column")
    right = lambda texts: np.array([_first_integer(t) == str(r["answer"])  # noqa: E731
                                    for t, r in zip(texts, records)], int)
    return right(a) - right(b)


def reward_verdicts(run_dir, side_a, side_b, tokenizers=(), echo=print) -> np.ndarray:
    """+1 / -1 / 0 by a reward model's scores of (prompt, answer) token rows; ``tokenizers``
    (the runs'), checked against the reward model's."""
    from nnx_posttrain.algorithms.online.rewards import RewardModelScore

    scorer = RewardModelScore(run_dir, runs.load(run_dir, echo=echo))
    for tok in tokenizers:
        if tok.vocab_size != scorer.tokenizer.vocab_size:
            raise errors.ConfigError(
                f"--judge {run_dir}: its tokenizer has {scorer.tokenizer.vocab_size:,} ids and a "
                f"run's {tok.vocab_size:,}: a reward model reads the runs' token ids, so it must "
                "share their tokenizer")

    def scores(prompts, answers):  # 64 rows per forward
        rows = [p + ans for p, ans in zip(prompts, answers)]
        return np.asarray([s for start in range(0, len(rows), 64)
                           for s in scorer.score_rows(rows[start:start + 64])])
    return np.sign(scores(*side_a) - scores(*side_b)).astype(int)


def load_judge(spec: str):
    """``module:name`` -> the pairwise judging callable (a function, or an object's ``judge``)."""
    target = user_code.load(spec, "--judge")
    fn = getattr(target, "judge", target)
    if not callable(fn):
        raise errors.ConfigError(f"--judge {spec}: not a function or an object with judge()")
    return fn


def pairwise_verdicts(fn, spec, prompts: list[str], a: list[str], b: list[str]) -> np.ndarray:
    """+1 / -1 / 0 from a TRL pairwise judge asked in both orders (a changed verdict: a tie).
    A judge that raises (or exits) is a ``ConfigError`` naming the user's file and line."""
    first = _judged(fn, spec, prompts, [[x, y] for x, y in zip(a, b)])
    second = _judged(fn, spec, prompts, [[y, x] for x, y in zip(a, b)])
    if len(first) != len(a) or len(second) != len(a) or \
            not all(v in (-1, 0, 1) for v in first + second):
        raise errors.ConfigError(f"--judge {spec}: must return one of 0, 1 (the better "
                                 "completion's index) or -1 per pair")
    return np.array([1 if (x, y) == (0, 1) else -1 if (x, y) == (1, 0) else 0
                     for x, y in zip(first, second)], int)


def _judged(fn, spec, prompts, pairs) -> list:
    """``list(fn(prompts, pairs))``: the user's judge, whose failure is named where it fails."""
    try:
        return list(fn(prompts, pairs))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's judge
        raise errors.ConfigError(f"--judge {spec}: the judge failed on {len(pairs)} pairs"
                                 f"{user_code.failure(exc, fn)}") from None


def win_rate(verdicts: np.ndarray, reps: int = 10_000, seed: int = 0) -> dict:
    """A's win rate, ties counted half, with its 95% bootstrap interval over prompts."""
    points = (np.asarray(verdicts) + 1) / 2.0  # win 1, tie 0.5, loss 0
    rng = np.random.default_rng(seed)
    means = points[rng.integers(0, len(points), size=(reps, len(points)))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return {"win_rate": float(points.mean()), "low": float(low), "high": float(high),
            "wins": int((verdicts > 0).sum()), "losses": int((verdicts < 0).sum()),
            "ties": int((verdicts == 0).sum()), "n": int(len(verdicts))}


def _check_judge(spec: str, records) -> None:
    """The judge, before either run loads."""
    if spec == "exact":
        exact_verdicts(records, [""] * len(records), [""] * len(records))
    elif (Path(spec) / "config.json").exists():
        if runs.head_of(runs.run_config(spec)) != "reward":
            raise errors.ConfigError(f"--judge {spec}: not a reward-model run (train one with "
                                     "experiments.reward)")
    elif ":" in spec:
        load_judge(spec)
    else:
        raise errors.ConfigError(f"--judge {spec}: expected 'exact', a reward-model run "
                                 "directory or 'module:name' (a pairwise judge)")


@dataclasses.dataclass(frozen=True)
class Judging:
    """How ``judge_runs`` compares two runs: the ``judge`` ('exact', a reward-model run
    directory or 'module:name'; default: exact where the prompts have answers), how both runs
    answer (``max_new_tokens``, ``temperature`` (0: greedy), ``top_p``, ``seed``), the
    bootstrap's ``reps`` and the ``examples`` of differing answers kept."""

    judge: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    reps: int = 10_000
    examples: int = 5

    @property
    def settings(self) -> dict:
        """The answers' settings, as the result records them."""
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    top_p=self.top_p, seed=self.seed)


def judge_runs(run_a, run_b, prompts_path, how: Judging = Judging(), echo=print) -> dict:
    """Both runs' answers to the prompts, judged pair by pair (see the module docstring); the
    result is written into both runs (``"paths"``)."""
    records = read_prompts(prompts_path)
    judge, reps, examples = how.judge, how.reps, how.examples
    spec = judge or ("exact" if all(r.get("answer") is not None for r in records) else None)
    if spec is None:
        raise errors.ConfigError("--judge: the prompts have no 'answer' column for the exact "
                                 "judge: give a reward-model run or a 'module:name' judge")
    _check_judge(spec, records)
    settings = how.settings
    a = answers(run_a, records, sampler.Sampling(**settings), echo=echo)
    b = answers(run_b, records, sampler.Sampling(**settings), echo=echo)
    if spec == "exact":
        verdicts = exact_verdicts(records, a[0], b[0])
    elif ":" in spec and not (Path(spec) / "config.json").exists():
        texts = [r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
                 for r in records]
        verdicts = pairwise_verdicts(load_judge(spec), spec, texts, a[0], b[0])
    else:
        verdicts = reward_verdicts(spec, (a[1], a[2]), (b[1], b[2]), (a[3], b[3]), echo=echo)
    result = {"run_a": str(run_a), "run_b": str(run_b), "prompts": str(prompts_path),
              "judge": spec, "settings": settings, **win_rate(verdicts, reps),
              "verdicts": verdicts.tolist(),
              "examples": [{"prompt": records[i]["prompt"], "a": a[0][i], "b": b[0][i],
                            "verdict": {1: "a", -1: "b", 0: "tie"}[int(verdicts[i])]}
                           for i in np.flatnonzero(np.array(a[0]) != np.array(b[0]))[:examples]]}
    result["paths"] = [_write(run_a, run_b, result), _write(run_b, run_a, _flipped(result))]
    return result


def _flipped(result: dict) -> dict:
    """The same comparison from B's side."""
    out = dict(result, run_a=result["run_b"], run_b=result["run_a"],
               win_rate=1 - result["win_rate"], low=1 - result["high"], high=1 - result["low"],
               wins=result["losses"], losses=result["wins"],
               verdicts=[-v for v in result["verdicts"]])
    out["examples"] = [dict(e, a=e["b"], b=e["a"], verdict={"a": "b", "b": "a"}.get(
        e["verdict"], "tie")) for e in result["examples"]]
    return out


def _write(run_dir, other, result) -> str:
    """``RUN/judge/<other's name>.json``, or where that holds the result against another run
    of the same name, ``<other's name>-<8 hex digits of its path>.json``: results against
    different runs never share a file; the same pair judged again replaces its own."""
    against = str(Path(other).resolve())
    out = result_path(run_dir, other)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**{k: v for k, v in result.items() if k != "paths"},
                               "against": against}, indent=2))
    return str(out)


def result_path(run_dir, other) -> Path:
    """The file that holds (or will hold) ``run_dir``'s result against ``other`` (``_write``)."""
    folder, against = Path(run_dir) / "judge", Path(other).resolve()
    plain = folder / f"{against.name}.json"
    try:
        saved = json.loads(plain.read_text())  # written before "against": its "run_b"
        held = saved.get("against") or str(Path(saved["run_b"]).resolve())
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        held = None  # none yet, or not a result of ours
    if not plain.exists() or held == str(against):
        return plain
    return folder / f"{against.name}-{hashlib.sha1(str(against).encode()).hexdigest()[:8]}.json"
