"""The training loop: SFT loss, compile-once, exact gradient accumulation, schedule, a real run."""

import logging
import json
import re

import nnx_posttrain  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import optax
import pytest

from nnx_posttrain import cli, config, metrics_log, model, train
from nnx_posttrain.losses.sft import sft
from nnx_posttrain.train import flops
from nnx_posttrain.algorithms import SFT
from support import equations, train_run


def test_sft_loss_hand_computed():
    logps = jnp.array([[0.0, -1.0, -2.0, -3.0], [0.0, -0.5, -7.0, -9.0]])
    mask = jnp.array([[0, 0, 1, 1], [0, 1, 0, 0]])
    total, weight, metrics = sft(logps, mask)
    assert float(total) == pytest.approx(2 + 3 + 0.5)
    assert float(weight) == 3
    s, c = metrics["loss"]
    assert float(s / c) == pytest.approx(5.5 / 3)


def test_sft_token_accuracy_counts_the_loss_tokens_predicted_exactly():
    logps = jnp.array([[0.0, -1.0, -2.0, -3.0], [0.0, -0.5, -7.0, -9.0]])
    mask = jnp.array([[0, 1, 1, 1], [0, 1, 1, 0]])
    correct = jnp.array([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])  # outside the mask: ignored
    total, weight, metrics = sft(logps, mask, correct)
    assert float(total) == pytest.approx(1 + 2 + 3 + 0.5 + 7) and float(weight) == 5
    s, c = metrics["mean_token_accuracy"]
    assert float(s) == 3 and float(c) == 5  # averaged over tokens, as TRL (not per example)
    assert "mean_token_accuracy" not in sft(logps, mask)[2]


def test_sft_prompt_tokens_carry_no_loss_and_no_gradient():
    mask = jnp.array([[0.0, 0.0, 1.0, 1.0]])
    base = jnp.array([[0.0, -1.0, -2.0, -3.0]])
    changed = base.at[0, 1].set(-40.0)  # a prompt position
    assert float(sft(base, mask)[0]) == float(sft(changed, mask)[0])
    grad = jax.grad(lambda x: sft(x, mask)[0])(base)
    np.testing.assert_array_equal(grad, [[0.0, 0.0, -1.0, -1.0]])


def _batch(rng, n, length, vocab):
    ids = rng.integers(3, vocab, size=(n, length)).astype(np.int32)
    attention = np.ones((n, length), np.int32)
    loss_mask = np.zeros((n, length), np.float32)
    for i in range(n):  # different numbers of loss tokens per example
        real = length - i % 4
        attention[i, real:] = 0
        ids[i, real:] = 0
        loss_mask[i, 2 + i % 3 : real] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def _setup(sgd=False):
    lm = model.load("gemma_micro", seed=0)
    graphdef, params, frozen = model.split(lm.module)
    tx, lr = train.optimizer(config.OptimConfig(learning_rate=1e-2, max_grad_norm=0.0, warmup_ratio=0.0), 10)
    if sgd:  # the update is the gradient itself: compares gradients, unlike Adam's sign-like step
        lr = optax.constant_schedule(1.0)
        tx = optax.sgd(lr)
    state = train.init_state(params, tx, seed=0)
    algo = SFT(SFT.Config(), logprob_chunk=8)
    step = jax.jit(train.make_train_step(graphdef, algo.loss, tx, lr), donate_argnums=(0,))
    return lm, step, state, {"model": frozen, "reference": None}


def _reshape(batch, accum):
    return {k: jnp.asarray(v.reshape(accum, v.shape[0] // accum, *v.shape[1:])) for k, v in batch.items()}


@pytest.mark.slow
def test_train_step_compiles_once_across_steps(caplog):
    """After the first step, the next ones trace and compile nothing (JAX's compile log; the
    jit's own cache size is not a witness: its LRU is shared with every other jitted function
    of the process)."""
    lm, step, state, frozen = _setup()
    rng = np.random.default_rng(0)
    state, _ = step(state, frozen, _reshape(_batch(rng, 4, 12, lm.tokenizer.vocab_size), 2))
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        for _ in range(3):
            batch = _batch(rng, 4, 12, lm.tokenizer.vocab_size)
            state, metrics = step(state, frozen, _reshape(batch, 2))
    assert int(state["step"]) == 4
    assert not [r.getMessage() for r in caplog.records if "jit(step)" in r.getMessage()]


@pytest.mark.slow
def test_the_loop_freezes_what_lives_after_its_first_step_switches_threads_promptly_and_copies_ahead(
        tmp_path, monkeypatch):
    """The garbage collector leaves alone the objects alive after the first step (a full pass
    over a real model's objects stopped the chip's loop for ~0.3 s every ~10 steps), and the
    interpreter comes back to the loop within 0.1 ms (Orbax's threads held it up to 5 ms at a
    time), only while the loop runs; a caller's own frozen objects or shorter switch interval
    are never undone by it. At a step that both logs and saves, the save's device copy is
    taken before the log reads the step's metrics (which waits for the device): its dispatch and
    host transfers overlap the step (on the chip's host ~80 ms had followed it, the device
    idle), and the save holds that copy, not a second one."""
    import gc
    import sys

    from nnx_posttrain import checkpoint
    from nnx_posttrain.train import loop
    from nnx_posttrain.train.hooks import FrozenCollector, PromptSwitches
    from support import MICRO

    seen, switches, events, one_step = [], [], [], loop.Steps.one_step
    before, copy, log = sys.getswitchinterval(), checkpoint.device_copy, loop.Steps.log_train

    def counted(self, *args):
        seen.append(gc.get_freeze_count())
        switches.append(sys.getswitchinterval())
        return one_step(self, *args)
    monkeypatch.setattr(loop.Steps, "one_step", counted)
    monkeypatch.setattr(checkpoint, "device_copy",
                        lambda state: (events.append("copy"), copy(state))[1])
    monkeypatch.setattr(loop.Steps, "log_train",
                        lambda self, info: (events.append(f"log {info.step}"), log(self, info))[1])
    assert gc.get_freeze_count() == 0
    train_run("sft", *MICRO, "--steps", "4", "--eval.every", "0", "--log-every", "2",
              "--checkpoint.every", "2", "--run-dir", tmp_path / "r")
    assert seen[0] == 0 and all(n > 0 for n in seen[1:])
    assert gc.get_freeze_count() == 0
    assert switches == [pytest.approx(1e-4)] * 4 and sys.getswitchinterval() == before
    assert events == ["copy", "log 2", "copy", "log 4"]
    with PromptSwitches(0.01):  # never longer than the caller's
        assert sys.getswitchinterval() == before
    assert sys.getswitchinterval() == before
    gc.freeze()  # the caller's
    try:
        # (the count is not exact: a frozen object another thread frees meanwhile lowers it)
        frozen = gc.get_freeze_count()
        fresh = [[] for _ in range(10_000)]  # made since: a second freeze would take them
        with FrozenCollector() as collector:
            collector.freeze()
            assert gc.get_freeze_count() < frozen + len(fresh)
        assert 0 < gc.get_freeze_count() <= frozen  # nor unfrozen at the end
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_step_flops_count_every_micro_batch_of_the_accumulation_loop():
    """XLA's cost analysis counts a scan's body once; a step's FLOPs count each micro-batch: 32
    examples in one micro-batch or in 4 of 8 cost the same (within 5%)."""
    lm, step, state, frozen = _setup()
    batch = _batch(np.random.default_rng(2), 32, 12, lm.tokenizer.vocab_size)
    counted, xla = {}, {}
    for accum in (1, 4):
        compiled = step.lower(state, frozen, _reshape(batch, accum)).compile()
        counted[accum], xla[accum] = flops.step_flops(compiled), flops.xla_flops(compiled)
        assert 4 in flops.counted_loops(compiled) or accum == 1
    assert counted[4] == pytest.approx(counted[1], rel=0.05)
    assert counted[1] >= xla[1]  # (the chunked log-probabilities' scan is counted too)
    assert xla[4] < 0.5 * xla[1]  # what XLA alone says: one micro-batch of the four


def test_step_flops_are_counted_without_a_cpu_backend_in_jax(monkeypatch):
    """JAX_PLATFORMS=tpu leaves JAX no CPU backend, and the TPU's client cannot analyse a loop's
    body ("PJRT C API does not support GetHloCostAnalysis"): the loops are still counted, by a
    CPU client of the module's own."""
    lm, step, state, frozen = _setup()
    batch = _batch(np.random.default_rng(2), 32, 12, lm.tokenizer.vocab_size)
    compiled = step.lower(state, frozen, _reshape(batch, 4)).compile()
    expected = flops.step_flops(compiled)
    devices = jax.local_devices

    def no_cpu_backend(*args, backend=None, **kwargs):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return devices(*args, backend=backend, **kwargs)

    monkeypatch.setattr(jax, "local_devices", no_cpu_backend)
    flops._analysis_client.cache_clear()
    try:
        assert flops.step_flops(compiled) == expected > 2 * flops.xla_flops(compiled)
    finally:
        flops._analysis_client.cache_clear()


# XLA's defaults for the options the suite changes (tests/conftest.py's XLA_TEST_FLAGS)
USER_XLA_OPTIONS = {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True}


def _running_sums(grad_fn, like_params, params, frozen, batch, stacks):
    """The accumulation before the single trace (what ``train.step._summed`` replaced): the
    losses and the gradients both summed in the scan's carry, which starts from zeros of an
    ``eval_shape`` of one micro-batch's forward and backward."""
    first = jax.tree.map(lambda x: x[0], batch)
    shapes = jax.eval_shape(grad_fn, params, frozen, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def accumulate(carry, micro_batch):
        p, f, carry = jax.lax.optimization_barrier((params, frozen, carry))
        loss, grads = grad_fn(p, f, micro_batch)
        grads = like_params(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    return jax.lax.scan(accumulate, (zeros[0], like_params(zeros[1])), batch)[0]


@pytest.mark.slow
def test_accumulation_traces_the_model_once_and_equals_running_sums(monkeypatch):
    """4 micro-batches: the model's loss is traced once per step (no ``eval_shape`` of it for
    the running sums' shapes), and the update and the metrics are bitwise those of the running
    sums in the scan's carry."""
    from nnx_posttrain.train import step as step_lib

    rng = np.random.default_rng(3)
    lm, _, _, _ = _setup()
    batch = _reshape(_batch(rng, 8, 12, lm.tokenizer.vocab_size), 4)
    loss, traces, results = SFT.loss, [], []
    monkeypatch.setattr(SFT, "loss", lambda *a, **kw: traces.append(1) or loss(*a, **kw))
    for summed in (step_lib._summed, _running_sums):
        monkeypatch.setattr(step_lib, "_summed", summed)
        _, step, state, frozen = _setup()
        # compiled as a user's run compiles them (XLA's default options, not the suite's
        # -O0 and older fusion emitters: under that pair alone the two programs' unoptimised
        # loops round a few gradient elements differently, by ~1e-9)
        step = step.lower(state, frozen, batch).compile(compiler_options=USER_XLA_OPTIONS)
        results.append(jax.device_get(step(state, frozen, batch)))
        traces.append(None)
    assert traces == [1, None, 1, 1, None]  # the running sums traced it twice
    (ours, ours_metrics), (sums, sums_metrics) = results
    assert ours_metrics.keys() == sums_metrics.keys()
    for name in ours_metrics:
        np.testing.assert_array_equal(ours_metrics[name], sums_metrics[name], err_msg=name)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(sums)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_large_batch():
    rng = np.random.default_rng(1)
    lm, step, state, frozen = _setup()
    batch = _batch(rng, 8, 12, lm.tokenizer.vocab_size)
    results = {}
    for accum in (1, 2, 4):
        _, step, state, frozen = _setup(sgd=True)
        new_state, metrics = step(state, frozen, _reshape(batch, accum))
        results[accum] = (jax.device_get(new_state["params"]), {k: float(v) for k, v in metrics.items()})
    ref_params, ref_metrics = results[1]
    for accum in (2, 4):
        params, metrics = results[accum]
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)

    # The loss is token-weighted: the mean of per-micro-batch means would differ here.
    algo = SFT(SFT.Config(), logprob_chunk=8)
    module = lm.module
    means = []
    for part in np.split(np.arange(8), 4):
        sub = {k: jnp.asarray(v[part]) for k, v in batch.items()}
        total, weight, _ = algo.loss(module, sub)
        means.append(float(total / weight))
    assert abs(np.mean(means) - ref_metrics["loss"]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3, 0.0])  # clipped, not clipped, no clipping
def test_train_step_applies_optax_clipping_then_adamw_to_the_mean_gradient(max_grad_norm):
    """One step (two micro-batches) against optax's own ``clip_by_global_norm`` and ``adamw`` on
    the gradient of the token-weighted mean loss, computed by hand here; the same state layout.
    eps=1 keeps the first step proportional to the gradient (with a small eps it is nearly
    sign(g) * lr, blind to clipping and sensitive to the rounding of gradients near 0)."""
    lm = model.load("gemma_micro", seed=0)
    graphdef, params, frozen = model.split(lm.module)
    cfg = config.OptimConfig(learning_rate=1e-2, max_grad_norm=max_grad_norm, weight_decay=0.1,
                             warmup_steps=0, eps=1.0)
    tx, lr = train.optimizer(cfg, 10)
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    ref_tx = optax.chain(*parts, optax.adamw(lr, eps=1.0, weight_decay=0.1))
    state = train.init_state(params, tx, seed=0)
    assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(ref_tx.init(params))
    algo = SFT(SFT.Config(), logprob_chunk=8)
    batch = _batch(np.random.default_rng(2), 4, 12, lm.tokenizer.vocab_size)
    frozen = {"model": frozen, "reference": None}
    step = jax.jit(train.make_train_step(graphdef, algo.loss, tx, lr))
    new_state, metrics = step(state, frozen, _reshape(batch, 2))

    def mean_loss(p):
        total, weight, _ = algo.loss(model.merge(graphdef, p, frozen)[0],
                                     {k: jnp.asarray(v) for k, v in batch.items()})
        return total / weight

    grads = jax.grad(mean_loss)(params)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.global_norm(grads)), rel=1e-5)
    updates, _ = ref_tx.update(grads, ref_tx.init(params), params)
    want = optax.apply_updates(params, updates)
    unclipped = optax.apply_updates(params, optax.adamw(lr, eps=1.0, weight_decay=0.1).update(
        grads, optax.adamw(lr, eps=1.0, weight_decay=0.1).init(params), params)[0])
    gap = 0.0
    for a, b, c in zip(jax.tree.leaves(new_state["params"]), jax.tree.leaves(want),
                       jax.tree.leaves(unclipped)):
        np.testing.assert_allclose(a, b, atol=1e-8, rtol=1e-6)
        gap = max(gap, float(np.abs(np.asarray(a) - np.asarray(c)).max()))
    assert (gap > 1e-5) == (0 < max_grad_norm < float(metrics["grad_norm"]))  # clipped or not


def test_clipping_reuses_the_logged_gradient_norm():
    """The global norm the step logs (and checks for a finite step) is the one clipping divides
    by: clipping adds no reduction over the gradients (it added one per weight, a program's
    worth of small reductions to compile), and clips as optax does (the test above)."""
    lm = model.load("gemma_micro", seed=0)
    graphdef, params, frozen = model.split(lm.module)
    batch = _reshape(_batch(np.random.default_rng(0), 4, 12, lm.tokenizer.vocab_size), 2)
    counts = []
    for max_grad_norm in (0.0, 1.0):
        tx, lr = train.optimizer(config.OptimConfig(max_grad_norm=max_grad_norm), 10)
        step = train.make_train_step(graphdef, SFT(SFT.Config()).loss, tx, lr)
        jaxpr = jax.make_jaxpr(step)(train.init_state(params, tx, 0),
                                     {"model": frozen, "reference": None}, batch)
        counts.append(sum(e.primitive.name == "reduce_sum" for e in equations(jaxpr.jaxpr)))
    assert counts[0] == counts[1] > len(jax.tree.leaves(params))


def test_schedule_warmup_then_cosine_to_the_floor():
    cfg = config.OptimConfig(learning_rate=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    lr = train.schedule(cfg, 110)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55, abs=1e-6)
    assert float(lr(110)) == pytest.approx(0.1)
    linear = train.schedule(config.OptimConfig(learning_rate=2.0, schedule="linear", warmup_ratio=0.0), 100)
    assert float(linear(50)) == pytest.approx(1.0)


def _sft_args(tmp_path, *extra):
    return [
        "--model", "gemma_micro", "--run-dir", str(tmp_path / "run"), "--steps", "40",
        "--log-every", "5", "--eval.every", "20", "--eval.batches", "2", "--eval.exact-match", "16",
        "--batching.batch-size", "8", "--batching.max-length", "32", "--optim.learning-rate", "3e-3",
        *extra,
    ]


@pytest.mark.slow
def test_end_to_end_sft_run_learns_and_writes_the_run_directory(tmp_path, capsys):
    result = train_run("sft", *_sft_args(tmp_path), recipe=False)
    # stderr is not a terminal here (as in a log file): the bar is drawn when it starts, around
    # the two evaluations' lines and when it closes, not every 0.1 s nor at every log (tqdm's
    # defaults drew it 15 times in this run)
    assert 2 <= capsys.readouterr().err.count("sft:") <= 6
    run = tmp_path / "run"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"] == "gemma_micro" and cfg["steps"] == 40 and cfg["algo_name"] == "SFTConfig"
    records = metrics_log.read(run)
    train_losses = [r["loss"] for r in records if r["split"] == "train"]
    assert len(train_losses) == 8
    assert train_losses[-1] < 0.6 * train_losses[0]
    first = next(r for r in records if r["split"] == "train")
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_second", "compile_seconds",
                "mean_token_accuracy", "num_tokens"):
        assert key in first
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert all(0.0 <= r["exact_match"] <= 1.0 for r in evals)
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert result.train[-1]["step"] == 40


@pytest.mark.slow
def test_eval_only_prints_json_metrics_and_logs_them(tmp_path, capsys):
    assert cli.main(["sft", *_sft_args(tmp_path, "--eval-only")]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("{") :])
    assert set(metrics) >= {"loss", "exact_match", "perplexity"}
    records = metrics_log.read(tmp_path / "run")
    assert [r["split"] for r in records] == ["eval_only"]  # not the run's own eval


@pytest.mark.slow
def test_packed_sft_batch_gives_the_same_loss_as_its_examples_unpacked():
    from nnx_posttrain import data

    lm = model.load("gemma_micro", seed=0)
    transform = data.Tokenize(lm.tokenizer, lm.chat_format, 64)
    packed = next(data.packed_train_batches(data.source("builtin", "train"), transform, 4, seed=3))
    assert packed["segment_ids"].max() >= 2  # several examples per row
    rows = {"input_ids": [], "attention_mask": [], "loss_mask": []}
    for r in range(4):  # the same examples, one per row, padded
        for seg in range(1, packed["segment_ids"][r].max() + 1):
            where = packed["segment_ids"][r] == seg
            ex = data.pad_example(list(packed["input_ids"][r][where]),
                                  list(packed["loss_mask"][r][where]), 64, lm.tokenizer.pad_id)
            for k in rows:
                rows[k].append(ex[k])
    unpacked = {k: jnp.asarray(np.stack(v)) for k, v in rows.items()}
    algo = SFT(SFT.Config(), logprob_chunk=16)
    sharded = {k: jnp.asarray(v) for k, v in packed.items() if k != "truncated"}
    total_p, weight_p, _ = algo.loss(lm.module, sharded)
    total_u, weight_u, _ = algo.loss(lm.module, unpacked)
    assert float(weight_p) == float(weight_u) > 0
    assert float(total_p) == pytest.approx(float(total_u), rel=1e-5)
    # and as the training step computes it: jitted over nnx.merge (new block objects), where the
    # attention-mask override must reach the merged blocks, not the split module's
    graphdef, params, frozen = model.split(lm.module)
    jitted = jax.jit(lambda p, f, b: algo.loss(nnx.merge(graphdef, p, f), b)[0])
    assert float(jitted(params, frozen, sharded)) == pytest.approx(float(total_u), rel=1e-5)


@pytest.mark.slow
def test_end_to_end_packed_sft_run(tmp_path):
    result = train_run("sft", *_sft_args(
        tmp_path, "--batching.packing", "--batching.max-length", "64", "--eval.exact-match", "0"),
        recipe=False)
    losses_ = [r["loss"] for r in result.train]
    assert losses_[-1] < 0.6 * losses_[0]


@pytest.mark.slow
def test_a_rerun_of_the_same_shapes_reads_its_compiled_step_from_the_cache(tmp_path):
    """--compile-cache DIR: the second run of the same settings (another run directory) writes
    nothing new to the cache: every program it needs is read back, none compiled again."""
    from nnx_posttrain.train import compile_cache
    from support import FAST_STEPS, MICRO

    before = jax.config.jax_compilation_cache_dir
    cache = tmp_path / "cache"
    args = [*MICRO, *FAST_STEPS, "--checkpoint.every", "0", "--compile-cache", cache]
    try:
        said = []
        train_run("sft", *args, "--run-dir", tmp_path / "first", echo=said.append)
        assert any(f"compilation cache: {cache}" in line for line in said)
        # the last line says the most memory the run held (here the host's peak RSS)
        done = re.fullmatch(r"done: .*; peak memory ([\d.]+) GiB \(host RSS\)", said[-1])
        assert done and 0.1 < float(done.group(1)) < 64, said[-1]
        written = sorted(p.name for p in cache.iterdir())
        assert written
        train_run("sft", *args, "--run-dir", tmp_path / "second", echo=lambda _: None)
        assert sorted(p.name for p in cache.iterdir()) == written
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compile_cache._reread()


def test_a_run_with_its_own_cache_keeps_every_program_there(tmp_path, monkeypatch):
    """With this package's cache folder, JAX's threshold (a second of compilation) is off for
    the run and JAX's default back after it; a threshold the caller chose stands."""
    from nnx_posttrain.train import compile_cache

    key = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, key)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    try:
        jax.config.update(key, 1.0)  # JAX's default
        with compile_cache.keeping_every_program(tmp_path):
            assert getattr(jax.config, key) == 0.0
        assert getattr(jax.config, key) == 1.0
        with compile_cache.keeping_every_program(None):  # the caller's cache, or none
            assert getattr(jax.config, key) == 1.0
        jax.config.update(key, 2.5)  # the caller's
        with compile_cache.keeping_every_program(tmp_path):
            assert getattr(jax.config, key) == 2.5
    finally:
        jax.config.update(key, before)


def test_the_compile_cache_lives_beside_the_run_directory_unless_jax_has_one(tmp_path):
    from nnx_posttrain.train import compile_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        import os

        saved = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        try:
            assert compile_cache.resolve("auto", tmp_path / "runs" / "sft") == (
                tmp_path / "runs" / ".jax_cache")
        finally:
            if saved is not None:
                os.environ["JAX_COMPILATION_CACHE_DIR"] = saved
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert compile_cache.resolve("auto", tmp_path / "runs" / "sft") is None  # the caller's
        assert compile_cache.resolve("none", tmp_path / "runs" / "sft") is None
        assert compile_cache.resolve(str(tmp_path / "x"), tmp_path / "r") == tmp_path / "x"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
