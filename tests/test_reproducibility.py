"""``--seed`` governs everything random in a run: the same seed gives the same run (metrics and
per-problem answers), another seed another run; LoRA and scalar-head initialisation follow the
seed, not Python's global random state."""

import json
import random

import numpy as np
import pytest

from nnx_posttrain import model
from nnx_posttrain.model import heads
from support import MICRO, records, train_run

TIMING = ("tokens_per_second", "compile_seconds", "time/rollout", "time/update")


def _untimed(run_dir, split="train"):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records(run_dir, split)]


def _per_problem(run_dir):
    return [json.loads(line) for line in (run_dir / "exact_match.jsonl").read_text().splitlines()]


def _sft(tmp_path, name, seed, *extra):
    args = [*MICRO, "--run-dir", str(tmp_path / name), "--seed", str(seed), "--steps", "6",
            "--log-every", "2", "--eval.every", "0", "--eval.exact-match", "8",
            "--eval.batches", "1", "--batching.batch-size", "8", "--checkpoint.every", "0", *extra]
    train_run("sft", *args)
    return tmp_path / name


@pytest.mark.slow
def test_sft_same_seed_same_run_other_seed_other_run(tmp_path):
    a, b, c = (_sft(tmp_path, name, seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert _untimed(a) == _untimed(b)  # bitwise: every logged loss, norm, learning rate
    assert _untimed(a, "eval") == _untimed(b, "eval")
    assert _per_problem(a) == _per_problem(b)
    assert [r["step"] for r in _per_problem(a)] == [0, 6]
    assert len(_per_problem(a)[0]["correct"]) == len(_per_problem(a)[0]["keys"]) == 8
    # another seed: other initial weights and data order, so other losses from the first step on
    assert all(x["loss"] != y["loss"] for x, y in zip(_untimed(a), _untimed(c)))


def _lora_a(seed, python_seed):
    lm = model.load("gemma_micro", seed=0)
    random.seed(python_seed)  # Keras' default initialisers would draw from this
    model.enable_lora(lm.module, rank=2, targets="attention", seed=seed)
    return {v.path: np.asarray(v.value) for v in lm.module.weights if "lora_kernel_a" in v.path}


def test_lora_initialisation_follows_the_seed_only():
    first, again, other = _lora_a(0, 1), _lora_a(0, 2), _lora_a(1, 1)
    assert first and first.keys() == again.keys() == other.keys()
    for path in first:
        np.testing.assert_array_equal(first[path], again[path])
        assert not np.array_equal(first[path], other[path])
    same_shape = [p for p in first if first[p].shape == first[next(iter(first))].shape]
    assert len(same_shape) > 1  # layers of one shape still get different factors
    assert not np.array_equal(first[same_shape[0]], first[same_shape[1]])


def test_reward_head_initialisation_follows_the_seed(micro):
    def kernel(seed):
        return np.asarray(heads.wrap("reward", micro.module, seed=seed).head.kernel.value)

    np.testing.assert_array_equal(kernel(3), kernel(3))
    assert not np.array_equal(kernel(3), kernel(4))


@pytest.mark.slow
def test_online_rollouts_follow_the_seed(tmp_path):
    def grpo(name, seed):
        args = [*MICRO, "--run-dir", str(tmp_path / name), "--init-from", "",
                "--seed", str(seed), "--steps", "2", "--log-every", "1", "--eval.every", "0",
                "--eval.exact-match", "0", "--batching.batch-size", "8",
                "--algo.num-generations", "2", "--algo.max-completion-length", "4",
                "--algo.rewards", "length", "--checkpoint.every", "0"]
        train_run("grpo", *args)
        return _untimed(tmp_path / name)

    a, b, c = grpo("a", 0), grpo("b", 0), grpo("c", 1)
    assert a == b  # the same completions, rewards, losses
    assert [r["reward"] for r in a] != [r["reward"] for r in c]  # other completions
