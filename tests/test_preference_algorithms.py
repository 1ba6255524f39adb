"""Preference algorithms through the model and the loop: the concatenated chosen/rejected forward,
the three reference modes (LoRA base view, frozen copy, precomputed cache joined after shuffling),
KTO's mismatched KL rows, the reward model, short end-to-end runs and the command line."""

import json
import math
from pathlib import Path

import nnx_posttrain  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_posttrain import config, data, errors, metrics_log, model, train
from nnx_posttrain.algorithms import preference, reference
from nnx_posttrain.algorithms.base import RunContext
from nnx_posttrain.algorithms import DPO, KTO, Reward
from nnx_posttrain.model.heads import RewardModel
from support import MICRO, bare_config, jitted, records, refusal, train_run

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 24
CHUNK = 8  # several log-prob chunks per sequence
LOG2 = math.log(2.0)
TRL_PAIR_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
                    "rewards/accuracies", "logps/chosen", "logps/rejected")


# ----------------------------------------------------------------------------- data


def _builtin(split, kind, n):
    src = data.source("builtin", split, builtin=kind)
    return [{k: v for k, v in src[i].items() if not k.startswith("_")} for i in range(n)]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def pref_files(tmp_path_factory):
    """(train.jsonl, eval.jsonl): 24 + 7 of the built-in preference pairs. 24 train records, so
    the runs below wrap into a reshuffled second epoch; 7 eval records, so a whole-split
    evaluation in micro-batches of 4 ends with a padded batch."""
    d = tmp_path_factory.mktemp("pref_data")
    return (_write_jsonl(d / "train.jsonl", _builtin("train", "preference", 24)),
            _write_jsonl(d / "eval.jsonl", _builtin("eval", "preference", 7)))


# Pairs whose chosen and rejected completions differ in length (plain strings and chats), padded.
UNEVEN = [
    {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "twenty-two"},
    {"prompt": "What is 10 + 15?", "chosen": "It is 25.", "rejected": "5"},
    {"prompt": [{"role": "user", "content": "What is 7 + 8?"}],
     "chosen": [{"role": "assistant", "content": "15"}],
     "rejected": [{"role": "assistant", "content": "1"}]},
    {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 11 or 2"},
]


def _pair_batch(lm, records, max_length=MAX_LEN):
    """Tokenized pairs as one device batch. The tests keep to 4 pairs of MAX_LEN tokens: eager
    computations then reuse each other's compiled operations."""
    src = data.ListSource(records, "test")
    transform = data.make_transform(src, lm, max_length)
    assert transform.kind == "preference"
    examples = [transform(src[i]) for i in range(len(src))]
    return {k: jnp.asarray(np.stack([e[k] for e in examples]))
            for k in examples[0] if k != "truncated"}


def _args(run_dir, *extra, data_files=None):
    train_file, eval_file = data_files
    return [*MICRO, "--init-from", "", "--data", str(train_file),
            "--eval-data", str(eval_file), "--run-dir", str(run_dir),
            "--batching.max-length", str(MAX_LEN), "--checkpoint.every", "0", *extra]


_train_records = records


# ----------------------------------------------------------------------------- 1. one forward


@pytest.mark.slow
def test_pair_logps_in_one_forward_equals_two_separate_forwards():
    lm = model.load("gemma_micro", seed=0)
    batch = _pair_batch(lm, UNEVEN)
    lp = preference.pair_logps(lm.module, batch, CHUNK)
    for side in ("chosen", "rejected"):
        summed, avg, lengths = preference.sequence_logps(
            lm.module, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"],
            batch[f"{side}_loss_mask"], CHUNK)
        np.testing.assert_allclose(lp[side], summed, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lp[f"{side}_avg"], avg, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(lp[f"{side}_len"], lengths)
        np.testing.assert_array_equal(lengths, batch[f"{side}_loss_mask"].sum(-1))
    # The pairs are uneven and padded: a mix-up of the halves or of the rows would show.
    assert np.all(np.asarray(lp["chosen_len"]) != np.asarray(lp["rejected_len"]))
    assert int(batch["chosen_attention_mask"].sum()) < batch["chosen_attention_mask"].size
    np.testing.assert_allclose(lp["chosen_avg"], lp["chosen"] / lp["chosen_len"], rtol=1e-6)


# ----------------------------------------------------------------------------- 2. reference modes


def _lora_layers(module):
    return [l for l in module._flatten_layers(include_self=False) if getattr(l, "lora_enabled", False)]


@pytest.mark.slow
def test_lora_base_reference_is_the_model_before_lora():
    lm = model.load("gemma_micro", seed=0)
    batch = _pair_batch(lm, _builtin("train", "preference", 4))
    before = preference.pair_logps(lm.module, batch, CHUNK)

    model.enable_lora(lm.module, rank=2, targets="attention")
    rng = np.random.default_rng(0)
    for layer in _lora_layers(lm.module):  # B = 0 at init: make the adapters do something
        layer.lora_kernel_b.assign(rng.normal(0.0, 0.5, layer.lora_kernel_b.shape).astype(np.float32))
    policy = preference.pair_logps(lm.module, batch, CHUNK)
    for side in ("chosen", "rejected"):
        assert np.max(np.abs(np.asarray(policy[side]) - np.asarray(before[side]))) > 1e-2

    with model.lora_disabled(lm.module):
        assert not model.has_lora(lm.module)
        ref = preference.pair_logps(lm.module, batch, CHUNK)
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(ref[side], before[side], atol=1e-5, rtol=0)
    assert model.has_lora(lm.module)  # active again after the block
    again = preference.pair_logps(lm.module, batch, CHUNK)
    np.testing.assert_array_equal(again["chosen"], policy["chosen"])

    # The same inside a compiled function over split / merged state, as the training step runs it.
    algo = DPO(DPO.Config(), CHUNK)
    algo.setup(lm.module)
    assert algo.reference_mode == "lora_base"
    graphdef, params, frozen = model.split(lm.module)

    @jax.jit
    def policy_and_reference(params, batch):
        module, reference = train.merge(graphdef, params, {"model": frozen, "reference": None})
        forward = lambda m: preference.pair_logps(m, batch, CHUNK)
        return forward(module), algo.reference(module, reference, forward)

    jit_policy, jit_ref = policy_and_reference(params, batch)
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(jit_ref[side], before[side], atol=1e-5, rtol=0)
        np.testing.assert_allclose(jit_policy[side], policy[side], atol=1e-5, rtol=0)


def test_lora_base_needs_lora():
    lm = model.load("gemma_micro", seed=0)
    with pytest.raises(errors.ConfigError, match="lora_base needs LoRA"):
        DPO(DPO.Config(reference="lora_base"), CHUNK).setup(lm.module)
    algo = DPO(DPO.Config(), CHUNK)
    algo.setup(lm.module)
    assert algo.reference_mode == "copy"  # auto, full fine-tuning


def _pair_logps(module, batch):
    """``preference.pair_logps`` as one jitted program (op by op, each operation of a new shape
    compiles on its own)."""
    return jitted(lambda m, b: preference.pair_logps(m, b, CHUNK), module)(batch)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["copy", "lora_base"])
def test_reference_stays_the_starting_model_while_the_policy_trains(mode):
    """At step 0 (policy == reference) the DPO sigmoid loss is log 2 and the rewards 0; after a few
    steps of ``make_train_step`` the reference still gives the starting log-probs."""
    lm = model.load("gemma_micro", seed=0)
    batch = _pair_batch(lm, _builtin("train", "preference", 4))
    start = _pair_logps(lm.module, batch)
    if mode == "lora_base":
        model.enable_lora(lm.module, rank=2, targets="attention")
    algo = DPO(DPO.Config(beta=0.1, reference=mode), CHUNK)
    algo.setup(lm.module)
    assert algo.reference_mode == mode
    graphdef, params, frozen_model = model.split(lm.module)
    tx, lr = train.optimizer(config.OptimConfig(learning_rate=1e-2, schedule="constant",
                                                   warmup_ratio=0.0), 10)
    frozen = {"model": frozen_model,
              "reference": jax.tree.map(jnp.copy, params) if mode == "copy" else None}
    state = train.init_state(jax.tree.map(jnp.copy, params), tx, seed=0)
    step = jax.jit(train.make_train_step(graphdef, algo.loss, tx, lr), donate_argnums=(0,))
    stacked = jax.tree.map(lambda x: x[None], batch)  # [accum = 1, micro, ...]

    state, metrics = step(state, frozen, stacked)
    metrics = {k: float(v) for k, v in metrics.items()}
    assert metrics["loss"] == pytest.approx(LOG2, abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[name] == pytest.approx(0.0, abs=1e-6), name
    assert metrics["logps/chosen"] == pytest.approx(float(jnp.mean(start["chosen"])), abs=1e-4)

    losses = [metrics["loss"]]
    for _ in range(3):
        state, metrics = step(state, frozen, stacked)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 1e-3  # the policy moved away from the reference
    # The reference the step itself used: rewards/chosen = beta * (policy - reference).
    used = float(metrics["logps/chosen"]) - float(metrics["rewards/chosen"]) / 0.1
    assert used == pytest.approx(float(jnp.mean(start["chosen"])), abs=1e-4)
    assert abs(float(metrics["rewards/chosen"])) > 1e-3

    module, reference = train.merge(graphdef, state["params"], frozen)
    policy = _pair_logps(module, batch)
    if mode == "copy":
        ref = _pair_logps(reference, batch)
    else:
        assert reference is None
        with model.lora_disabled(module):
            ref = _pair_logps(module, batch)
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(ref[side], start[side], atol=1e-5, rtol=0)
        assert np.max(np.abs(np.asarray(policy[side]) - np.asarray(start[side]))) > 1e-3


# ----------------------------------------------------------------------------- 3. precompute


# A short run that learns: 20 steps at a constant learning rate, every step logged.
LEARNING_RUN = ["--steps", "20", "--log-every", "1", "--batching.batch-size", "8",
                "--optim.learning-rate", "3e-3", "--optim.schedule", "constant",
                "--optim.warmup-steps", "0", "--eval.exact-match", "0", "--eval.every", "0"]


def _assert_learns_and_logs_trl_metrics(records, steps=20):
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert set(TRL_PAIR_METRICS) <= set(r), sorted(r)
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"],
                                                     abs=1e-4)
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05, losses
    assert np.mean([r["rewards/margins"] for r in records[-5:]]) > 0
    assert np.mean([r["rewards/accuracies"] for r in records[-5:]]) > 0.5


@pytest.mark.slow
def test_precomputed_reference_is_cached_reused_and_joined_to_the_right_examples(
        tmp_path, capsys, pref_files):
    """Also DPO's end-to-end run: the 'copy' run below learns and logs TRL's metrics."""
    runs = tmp_path / "runs"

    def dpo_run(name, reference):
        train_run("dpo", *_args(
            runs / name, *LEARNING_RUN, "--batching.grad-accum", "2", "--eval.batches", "0",
            "--algo.beta", "1.0", "--algo.reference", reference, data_files=pref_files))
        return capsys.readouterr().out

    out_a = dpo_run("a", "precompute")
    cache_files = list((runs / ".reference_cache").glob("*.npz"))
    assert len(cache_files) == 1, cache_files
    cache = cache_files[0]
    assert "reference log-probs: computed" in out_a and str(cache) in out_a
    mtime = cache.stat().st_mtime_ns

    out_b = dpo_run("b", "precompute")
    assert "reference log-probs: reused" in out_b and str(cache) in out_b
    assert list((runs / ".reference_cache").glob("*.npz")) == [cache]
    assert cache.stat().st_mtime_ns == mtime

    # The cached values are the starting model's log-probs of the same records.
    with np.load(cache) as cached:
        cached = {k: cached[k] for k in cached.files}
    assert sorted(cached) == ["eval/ref_chosen_logps", "eval/ref_rejected_logps",
                              "train/ref_chosen_logps", "train/ref_rejected_logps"]
    assert cached["train/ref_chosen_logps"].shape == (24,)
    assert cached["eval/ref_rejected_logps"].shape == (7,)
    lm = model.load("gemma_micro", seed=0)
    for split, path, indices in (("train", pref_files[0], [0, 9, 17, 23]),
                                 ("eval", pref_files[1], [0, 2, 4, 6])):
        src = data.source(str(path))
        lp = preference.pair_logps(lm.module, _pair_batch(lm, [src[i] for i in indices]), CHUNK)
        for side in ("chosen", "rejected"):
            np.testing.assert_allclose(cached[f"{split}/ref_{side}_logps"][indices], lp[side],
                                       rtol=1e-6, atol=1e-5, err_msg=f"{split} {side}")
    # Different records have different reference values: a wrong join would be visible.
    assert len(np.unique(np.round(cached["train/ref_chosen_logps"], 3))) > 12

    dpo_run("copy", "copy")
    pre, reused, copy = (_train_records(runs / n) for n in ("a", "b", "copy"))
    _assert_learns_and_logs_trl_metrics(copy)
    for name in TRL_PAIR_METRICS:
        np.testing.assert_array_equal([r[name] for r in reused], [r[name] for r in pre])
        # at step 1 the policy is the reference: every margin is 0 up to float rounding, and which
        # side of 0 a margin falls on (the accuracy) is rounding noise, not behaviour
        first = 1 if name == "rewards/accuracies" else 0
        np.testing.assert_allclose([r[name] for r in pre][first:], [r[name] for r in copy][first:],
                                   rtol=0, atol=1e-5, err_msg=name)
    # Step 1: policy == reference on whatever shuffled examples the batch holds.
    assert pre[0]["loss"] == pytest.approx(LOG2, abs=1e-6)
    assert pre[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    # The whole eval split, its last micro-batch padded with a blank row.
    evals = [[r for r in metrics_log.read(runs / n) if r["split"] == "eval"] for n in ("a", "copy")]
    assert [r["step"] for r in evals[0]] == [0, 20]
    for e_pre, e_copy in zip(*evals):
        for name in TRL_PAIR_METRICS:
            assert e_pre[name] == pytest.approx(e_copy[name], abs=1e-5), name


@pytest.mark.slow
def test_reference_cache_key_includes_the_init_from_checkpoint(tmp_path):
    """Reference log-probs of one --init-from run are never reused for another, or for the same run
    directory once it has a new checkpoint."""
    lm = model.load("gemma_micro", seed=0)
    graphdef, params, frozen_model = model.split(lm.module)
    frozen = {"model": frozen_model, "reference": None}
    src = data.ListSource(_builtin("train", "preference", 4), "four")
    transform = data.make_transform(src, lm, MAX_LEN)
    inits = {name: tmp_path / name for name in ("sft_a", "sft_b")}
    for d in inits.values():
        (d / "checkpoints" / "100").mkdir(parents=True)

    def precompute(init_from):
        cfg = bare_config(DPO, model="gemma_micro", init_from=init_from,
                          batching=dict(batch_size=4, grad_accum=1, max_length=MAX_LEN))
        algo = DPO(DPO.Config(reference="precompute"), CHUNK)
        algo.reference_mode = "precompute"
        said = []
        run = RunContext(cfg, lm, graphdef, frozen, src, None, transform, tmp_path / "runs" / "x",
                         said.append)
        reference.precomputed(run, algo, params)
        return said[-1].split()[2]  # 'computed' or 'reused'

    assert precompute(str(inits["sft_a"])) == "computed"
    assert precompute(str(inits["sft_a"])) == "reused"
    assert precompute(str(inits["sft_b"])) == "computed"
    (inits["sft_a"] / "checkpoints" / "200").mkdir()
    assert precompute(str(inits["sft_a"])) == "computed"


# ----------------------------------------------------------------------------- 4. KTO's KL rows


def _unpaired_batch(rows, width):
    """rows: (prompt ids, completion ids, trailing non-loss ids) -> a right-padded numpy batch."""
    n = len(rows)
    ids = np.zeros((n, width), np.int32)
    att = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.float32)
    for i, (prompt, completion, trailing) in enumerate(rows):
        row = prompt + completion + trailing
        ids[i, : len(row)] = row
        att[i, : len(row)] = 1
        mask[i, len(prompt) : len(prompt) + len(completion)] = 1
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask,
            "label": np.array([1.0, 0.0, 1.0][:n], np.float32)}


def test_kto_kl_rows_pair_each_prompt_with_the_next_completion():
    rows = [
        ([2, 11, 12, 13], [21, 22], [6]),  # a template token after the completion: not prompt
        ([2, 14, 15], [31, 32, 33], []),
        ([2, 16, 17, 18, 19], [41], [6, 7]),
    ]
    batch = _unpaired_batch(rows, width=10)
    out = KTO(KTO.Config(), CHUNK).prepare(batch)
    for k, v in batch.items():
        np.testing.assert_array_equal(out[k], v)  # the batch itself is untouched
    n = len(rows)
    for i in range(n):
        prompt, completion = rows[i][0], rows[(i + 1) % n][1]
        expect = prompt + completion
        np.testing.assert_array_equal(out["kl_input_ids"][i, : len(expect)], expect)
        np.testing.assert_array_equal(out["kl_input_ids"][i, len(expect):], 0)
        np.testing.assert_array_equal(out["kl_attention_mask"][i],
                                      [1] * len(expect) + [0] * (10 - len(expect)))
        np.testing.assert_array_equal(
            out["kl_loss_mask"][i],
            [0] * len(prompt) + [1] * len(completion) + [0] * (10 - len(expect)))
    for k in ("kl_input_ids", "kl_attention_mask", "kl_loss_mask"):
        assert out[k].dtype == batch[k[3:]].dtype

    # A row longer than the width is cut at the end; the mask stops with it.
    short = _unpaired_batch([([2, 11, 12, 13], [21], []), ([2, 14], [31, 32, 33, 34], [])], width=6)
    out = KTO(KTO.Config(), CHUNK).prepare(short)
    np.testing.assert_array_equal(out["kl_input_ids"], [[2, 11, 12, 13, 31, 32], [2, 14, 21, 0, 0, 0]])
    np.testing.assert_array_equal(out["kl_loss_mask"], [[0, 0, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["kl_attention_mask"], [[1] * 6, [1, 1, 1, 0, 0, 0]])


def test_kto_kl_rows_of_chat_data_read_as_a_prompt_and_another_answer():
    lm = model.load("gemma_micro", seed=0)
    src = data.ListSource(_builtin("train", "unpaired_preference", 3), "three")
    transform = data.make_transform(src, lm, 32)
    examples = [transform(src[i]) for i in range(3)]
    batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
    out = KTO(KTO.Config(), CHUNK).prepare(batch)
    text = lambda ids, keep: lm.tokenizer.decode(ids[keep > 0])
    for i in range(3):
        j = (i + 1) % 3
        kl = text(out["kl_input_ids"][i], out["kl_attention_mask"][i])
        prompt = src[i]["prompt"][0]["content"]
        answer = src[j]["completion"][0]["content"]
        assert kl.endswith(f"{prompt}<end_of_turn>\n<start_of_turn>model\n{answer}<end_of_turn>"), kl
        assert text(out["kl_input_ids"][i], out["kl_loss_mask"][i]) == f"{answer}<end_of_turn>"


# ----------------------------------------------------------------------------- 5. reward model


@pytest.mark.slow
def test_reward_model_reads_the_last_real_token_and_its_loss_is_finite():
    lm = model.load("gemma_micro", seed=0)
    rm = RewardModel(lm.module, seed=0)
    batch = _pair_batch(lm, UNEVEN)
    ids = np.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    att = np.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    last = int(att[0].sum()) - 1
    assert last < ids.shape[1] - 1  # there is padding after the last real token
    pad_changed, last_changed = ids.copy(), ids.copy()
    pad_changed[0, last + 1 :] = 7
    last_changed[0, last] = 7 if ids[0, last] != 7 else 8
    score = lambda x: np.asarray(rm(jnp.asarray(x), jnp.asarray(att)))
    base = score(ids)
    assert base.shape == (8,) and base.dtype == np.float32
    np.testing.assert_allclose(score(pad_changed), base, rtol=0, atol=1e-6)
    changed = score(last_changed)
    assert abs(changed[0] - base[0]) > 1e-4
    np.testing.assert_allclose(changed[1:], base[1:], rtol=0, atol=1e-6)  # rows are independent

    total, weight, metrics = Reward(Reward.Config(), CHUNK).loss(rm, batch)
    assert np.isfinite(float(total)) and float(total) > 0 and float(weight) == 4
    assert {"loss", "accuracy", "margin"} <= set(metrics)


def test_the_data_margin_column_reaches_the_reward_loss_and_a_bad_one_is_named():
    """TRL's optional ``margin`` column: -log sigmoid(r_c - r_r - m) per pair, read from the data
    (it once never left the file: a margin of 100 trained exactly as none)."""
    lm = model.load("gemma_micro", seed=0)
    rm = RewardModel(lm.module, seed=0)
    plain = _pair_batch(lm, UNEVEN)
    assert "margin" not in plain
    margins = [100.0, 0.0, 2.5, -1]
    batch = _pair_batch(lm, [dict(r, margin=m) for r, m in zip(UNEVEN, margins)])
    np.testing.assert_array_equal(np.asarray(batch["margin"]), np.float32(margins))
    total, weight, _ = Reward(Reward.Config(), CHUNK).loss(rm, batch)
    ids = np.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    att = np.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    r = np.asarray(rm(jnp.asarray(ids), jnp.asarray(att)), np.float64)
    expected = np.logaddexp(0.0, -(r[:4] - r[4:] - np.asarray(margins))).sum()
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)
    assert float(total) / float(weight) > 20  # the margin of 100 dominates
    src = data.ListSource([dict(UNEVEN[0], margin=1.0), UNEVEN[1],
                           dict(UNEVEN[2], margin="big")], "pairs.jsonl")
    transform = data.make_transform(src, lm, MAX_LEN)
    with pytest.raises(data.DataError, match="field 'margin' is missing"):
        transform(src[1])
    with pytest.raises(data.DataError, match="field 'margin' must be a finite number, got str"):
        transform(src[2])
    # the column is the data's when any early record names it, a null first value too (Parquet);
    # a margin on a later record only is refused, never dropped
    for rows in ([UNEVEN[0], dict(UNEVEN[1], margin=2.0)], [dict(UNEVEN[0], margin=None), UNEVEN[1]]):
        src = data.ListSource(rows, "pairs.jsonl")
        transform = data.make_transform(src, lm, MAX_LEN)
        assert transform.margin
        with pytest.raises(data.DataError, match=r"field 'margin' is (missing|null) \(the data"):
            transform(src[0])
    src = data.ListSource([UNEVEN[0]] * 100 + [dict(UNEVEN[1], margin=2.0)], "pairs.jsonl")
    transform = data.make_transform(src, lm, MAX_LEN)
    assert not transform.margin and "margin" not in transform(src[0])
    with pytest.raises(data.DataError, match="field 'margin' is set here but in none of the data's "
                                             "first records"):
        transform(src[100])


@pytest.mark.slow
def test_reward_run_logs_accuracy_and_no_exact_match(tmp_path, pref_files):
    args = _args(tmp_path / "rm", "--steps", "4", "--batching.batch-size", "4",
                 "--eval.batches", "1", "--eval.every", "0", data_files=pref_files)
    train_run("reward", *args, recipe=False)
    records = metrics_log.read(tmp_path / "rm")
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4]
    for r in evals:
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["loss"])
        assert "exact_match" not in r and "perplexity" not in r
    assert all(math.isfinite(r["loss"]) for r in records if r["split"] == "train")


@pytest.mark.slow
def test_reward_model_learns_a_learnable_preference(tmp_path):
    """A preference a scalar head can read off the last tokens (answers ending in '!' preferred):
    held-out accuracy reaches (nearly) 1 in 20 steps."""
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "rock", "fish"]
    pairs = [{"prompt": a, "chosen": f" {b}!", "rejected": f" {b}."}
             for a in words for b in words if a != b]
    files = (_write_jsonl(tmp_path / "train.jsonl", pairs[::2]),
             _write_jsonl(tmp_path / "eval.jsonl", pairs[1::2][:32]))
    train_run("reward", *_args(
        tmp_path / "rm", *LEARNING_RUN, "--eval.batches", "8", data_files=files))
    evals = [r for r in metrics_log.read(tmp_path / "rm") if r["split"] == "eval"]
    assert evals[-1]["accuracy"] >= 0.95 and evals[-1]["loss"] < evals[0]["loss"] / 2, evals


@pytest.mark.slow
def test_kto_with_desirable_examples_only_logs_no_nan_for_the_missing_class(tmp_path, capsys):
    """A batch (or eval set) without an undesirable example has no rejected metrics: they are
    left out of the record, as TRL leaves out a class it saw none of, not logged as NaN; the
    run warns that the data lacks the class."""
    rows = [{"prompt": f"What is {i} + 1?", "completion": f" {i + 1}", "label": True}
            for i in range(8)]
    files = (_write_jsonl(tmp_path / "train.jsonl", rows), _write_jsonl(tmp_path / "eval.jsonl", rows))
    train_run("kto", *_args(
        tmp_path / "kto", "--steps", "2", "--log-every", "1", "--batching.batch-size", "4",
        "--eval.batches", "1", "--eval.every", "0", "--eval.exact-match", "0", data_files=files))
    out = metrics_log.read(tmp_path / "kto")
    assert {r["split"] for r in out} == {"train", "eval"} and len(out) == 4, out
    for r in out:
        assert "rewards/chosen" in r and "logps/chosen" in r, r
        assert not any(k.endswith("/rejected") for k in r), r
        assert all(not isinstance(v, str) or k == "split" for k, v in r.items()), r  # no "nan"
    out = capsys.readouterr().out
    assert "train data: 8 records, 0 bad (skipped), 0 truncated" in out
    assert "8 desirable / 0 undesirable" in out
    assert "warning: the train data has no undesirable example (8 desirable / 0 undesirable" in out


@pytest.mark.slow
def test_kto_reads_preference_pairs_as_trl_does(tmp_path, pref_files, capsys):
    """KTO on preference pairs (TRL's maybe_unpair_preference_dataset): each pair a desirable
    (chosen) and an undesirable (rejected) example, bad pairs named by their side."""
    src = data.unpaired(data.ListSource(UNEVEN[:2] + [{"chosen": "a", "rejected": 3}], "p.jsonl"))
    assert len(src) == 6
    assert [(r["prompt"], r["completion"], r["label"], r["_where"]) for r in (src[0], src[1])] == [
        ("What is 2 + 2?", "4", True, "p.jsonl[0] (chosen)"),
        ("What is 2 + 2?", "twenty-two", False, "p.jsonl[0] (rejected)")]
    with pytest.raises(data.DataError, match=r"p.jsonl\[2\]: field 'rejected' must be"):
        src[5]
    train_run("kto", *_args(
        tmp_path / "kto", "--steps", "2", "--batching.batch-size", "4", "--eval.batches", "4",
        "--eval.every", "0", "--eval.exact-match", "0", data_files=pref_files))
    out = capsys.readouterr().out
    assert "preference pairs read as unpaired examples" in out
    assert "train data: 48 records" in out and "24 desirable / 24 undesirable" in out
    records = metrics_log.read(tmp_path / "kto")
    assert [(r["step"], r["split"]) for r in records] == [(0, "eval"), (2, "train"), (2, "eval")]
    assert all("rewards/chosen" in r and "rewards/rejected" in r for r in records
               if r["split"] == "eval")  # the held-out pairs' both sides


@pytest.mark.parametrize("counts, weights, advice", [
    ((50, 50), (1.0, 1.0), None),
    ((60, 50), (1.0, 1.0), None),  # 1.2: inside TRL's [1, 4/3]
    ((100, 50), (1.0, 1.0), "EITHER --algo.desirable-weight in [0.5, 0.67] OR "
                            "--algo.undesirable-weight in [1.5, 2]"),
    ((100, 50), (0.6, 1.0), None),
    ((20, 80), (1.0, 1.0), "EITHER --algo.desirable-weight in [4, 5.32] OR "
                           "--algo.undesirable-weight in [0.19, 0.25]"),
])
def test_kto_label_balance_follows_trls_advice(counts, weights, advice):
    from nnx_posttrain.data.validate import ValidationReport

    said = []
    report = ValidationReport(sum(counts), np.arange(sum(counts)), 0, desirable=counts[0],
                              undesirable=counts[1])
    KTO(KTO.Config(desirable_weight=weights[0], undesirable_weight=weights[1])).check_train_data(
        report, said.append)
    if advice is None:
        assert said == []
    else:
        assert len(said) == 1 and advice in said[0] and said[0].startswith("warning: "), said


def test_drop_uncounted_keeps_every_value_of_a_non_finite_step():
    from nnx_posttrain.train.step import drop_uncounted

    nan = math.nan
    assert drop_uncounted({"loss": 1.0, "grad_norm": 2.0, "rewards/rejected": nan}) == {
        "loss": 1.0, "grad_norm": 2.0}
    for bad in ({"loss": nan, "grad_norm": 2.0, "x": nan}, {"loss": 1.0, "grad_norm": nan, "x": nan}):
        assert set(drop_uncounted(bad)) == set(bad)


# ----------------------------------------------------------------------------- 6. end to end
# (DPO's end-to-end run is the 'copy' run of the precompute test above.)


@pytest.mark.slow
def test_short_simpo_run_learns_and_logs_trl_metrics(tmp_path, pref_files):
    train_run("simpo", *_args(
        tmp_path / "simpo", *LEARNING_RUN, "--eval.batches", "1", "--algo.beta", "2.0",
        data_files=pref_files))
    _assert_learns_and_logs_trl_metrics(_train_records(tmp_path / "simpo"))


# ----------------------------------------------------------------------------- 7. wrong data


def test_sft_data_for_a_preference_experiment_fails_before_training(tmp_path):
    sft = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "What is 1 + 2?", "completion": "3"}] * 4)
    args = ["--model", "gemma_micro", "--init-from", "", "--data", str(sft), "--steps", "2",
            "--run-dir", str(tmp_path / "run")]
    message = refusal("dpo", *args, error=errors.DataError)
    assert message.startswith("dpo needs preference records"), message
    assert "sft" in message.split("holds")[-1], message
    assert str(sft) in message
    assert not (tmp_path / "run").exists()  # refused before it wrote anything: no directory left


# ----------------------------------------------------------------------------- 8. command line


def test_help_lists_the_algorithm_options(capsys, monkeypatch):
    from support import command_output

    outs = {name: command_output(capsys, monkeypatch, [name, "--help"], columns=200,
                                 command_prog=f"python -m experiments.{name}")
            for name in ("simpo", "dpo")}
    # An option's own line names its type (the docstrings above it mention some options too).
    expected = {
        "simpo": ("--algo.beta FLOAT", "--algo.gamma {None}|FLOAT",
                  "--algo.gamma-beta-ratio {None}|FLOAT", "--algo.nll-weight FLOAT"),
        "dpo": ("--algo.loss-type STR", "--algo.reference {auto,lora_base,copy,precompute}",
                "--algo.beta FLOAT"),
    }
    for name, (code, out, err) in outs.items():
        assert code == 0, err[-2000:]
        for option in expected[name]:
            assert option in out, (name, option)
        if name == "simpo":
            assert "--algo.reference" not in out  # reference-free
