"""Identical decoder blocks as one ``jax.lax.scan`` (model/layer_scan.py, ``--scan-layers``): the
same loss and gradients as the blocks one after the other (float32), with LoRA, int8, remat,
packed rows, rotary positions and both attention paths; one block traced; where ``auto`` scans
and where ``on`` is refused."""

import logging

import keras
import keras_hub
import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp

import support
from nnx_posttrain import api, config, errors, model, train
from nnx_posttrain.algorithms import SFT
from nnx_posttrain.model import layer_scan
from nnx_posttrain.model.logprobs import hidden_states, token_logprobs
from nnx_posttrain.train import flops, memory, resume

IDS = jnp.asarray(np.random.default_rng(0).integers(3, 60, (2, 16)), jnp.int32)
PADDING = jnp.ones_like(IDS).at[1, 11:].set(0)
SEGMENTS = jnp.asarray([[1] * 6 + [2] * 7 + [0] * 3, [1] * 9 + [2] * 7], jnp.int32)
POSITIONS = jnp.asarray([list(range(8)) + list(range(4, 12)), list(range(16))], jnp.int32)


def _plain(m):
    return jnp.sum(token_logprobs(m, IDS, PADDING) * PADDING)


def _packed(m):
    return jnp.sum(token_logprobs(m, IDS, (SEGMENTS > 0).astype(jnp.int32), segment_ids=SEGMENTS))


def _rotated(m):  # a shared-prefix row's rotary positions (algorithms.shared_prompt)
    return jnp.sum(jnp.sin(hidden_states(m, IDS, PADDING, rope_positions=POSITIONS)))


def _micro(rank=0, quantize="none", remat="none", attention="xla"):
    """The micro built-in Gemma (2 identical blocks) as a run builds it."""
    m = model.load("gemma_micro", seed=0).module
    if quantize != "none":
        model.quantize(m, quantize)
    if rank:
        model.enable_lora(m, rank, targets="all-linear", seed=0)
        for v in m.weights:  # B starts at 0: give it values, so that A's gradient is not 0
            if "lora_kernel_b" in v.path:
                v.assign(np.random.default_rng(1).normal(size=v.shape).astype("float32") * 0.1)
    model.set_remat(m, remat != "none", lazy_frozen=remat == "lazy_frozen")
    model.set_attention(m, attention)
    return m


def _loss_and_grads(m, loss, mode):
    assert model.set_scan(m, mode).startswith(f"layer scan: {mode}")
    graphdef, params, frozen = model.split(m)
    return jax.jit(jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p, frozen))))(params)


def _assert_same(got, want):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want[1])]
    for path, a, b in zip(paths, jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=path)


CASES = {
    "full": (dict(), _plain),
    "full, remat, keras attention": (dict(remat="blocks", attention="keras"), _plain),
    "full, packed rows": (dict(remat="blocks"), _packed),
    "full, packed rows, keras mask": (dict(attention="keras"), _packed),
    "lora, rotary positions": (dict(rank=2, remat="blocks"), _rotated),
    "lora, int8, packed rows": (dict(rank=2, quantize="int8", remat="blocks"), _packed),
    "lora, lazily read frozen blocks": (dict(rank=2, remat="lazy_frozen"), _plain),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_scan_equals_the_blocks_one_after_the_other(case):
    settings, loss = CASES[case]
    m = _micro(**settings)
    _assert_same(_loss_and_grads(m, loss, "on"), _loss_and_grads(m, loss, "off"))


SCANNABLE = [f for f in support.KERNEL_FAMILIES if f in (
    "gemma", "gemma3", "llama2", "llama3", "mistral", "qwen2", "qwen3", "phi3")]


@pytest.mark.slow
@pytest.mark.parametrize("family", SCANNABLE)
@pytest.mark.parametrize("attention", ["keras", "xla"])
def test_every_family_with_identical_blocks_scans_to_the_same_gradients(family, attention):
    bb = support.tiny_backbone(family)
    assert layer_scan.problem(bb) is None
    model.set_attention(bb, attention)
    _assert_same(_loss_and_grads(bb, _plain, "on"), _loss_and_grads(bb, _plain, "off"))


@pytest.mark.slow
def test_one_block_is_traced(monkeypatch):
    m = _micro(rank=2, remat="blocks")
    kind = type(model.decoder_blocks(m)[0])
    calls = []
    original = kind.call
    monkeypatch.setattr(kind, "call", lambda self, *a, **kw: calls.append(self.name)
                        or original(self, *a, **kw))
    for mode, traced in (("off", ["decoder_block_0", "decoder_block_1"]),
                         ("on", ["decoder_block_0"])):
        calls.clear()
        model.set_scan(m, mode)
        graphdef, params, frozen = model.split(m)
        jax.make_jaxpr(jax.grad(lambda p: _plain(nnx.merge(graphdef, p, frozen))))(params)
        assert calls == traced, mode


def _two_micro_batches() -> dict:
    ids = np.random.default_rng(0).integers(3, 60, (8, 12)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "loss_mask": np.ones(ids.shape, np.float32)}
    return {k: jnp.asarray(v.reshape(2, 4, 12)) for k, v in batch.items()}


def _sft_step(m, mode):
    """(the SFT training step of ``m`` with its blocks scanned or not, its state, its frozen
    variables) as a run builds them."""
    model.set_scan(m, mode)
    graphdef, params, frozen = model.split(m)
    tx, lr = train.optimizer(config.OptimConfig(warmup_ratio=0.0), 10)
    step = train.make_train_step(graphdef, SFT(SFT.Config()).loss, tx, lr)
    return step, train.init_state(params, tx, seed=0), {"model": frozen, "reference": None}


def _stacks(jaxpr) -> int:
    """How many stacks ``jaxpr`` makes (``jnp.stack``), its inner programs included."""
    return sum(e.primitive.name in ("stack", "concatenate") for e in support.equations(jaxpr))


@pytest.mark.slow
def test_the_frozen_blocks_are_stacked_once_a_step_not_in_each_micro_batch(monkeypatch):
    """With LoRA, a scanned step stacks the blocks' frozen weights before its loop over
    micro-batches, not in each (as it did: ``frozen_stacks`` giving nothing); its update is the
    unrolled step's."""
    m = _micro(rank=2, remat="blocks")
    batch = _two_micro_batches()
    counted, out = {}, {}
    for mode, hoisted in (("off", True), ("on", True), ("on", False)):
        if not hoisted:
            monkeypatch.setattr(model, "frozen_stacks", lambda modules, frozen: {})
        step, state, frozen = _sft_step(m, mode)
        jaxpr = jax.make_jaxpr(step)(state, frozen, batch).jaxpr
        [loop] = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]  # micro-batches'
        inside = _stacks(loop.params["jaxpr"].jaxpr)
        counted[mode, hoisted] = (inside, _stacks(jaxpr) - inside)
        new_state, metrics = jax.jit(step)(state, frozen, batch)
        out[mode, hoisted] = (metrics["loss"], new_state["params"])
    weights = model.decoder_blocks(m)[0].weights
    frozen_weights = sum("lora_kernel" not in v.path for v in weights)
    assert 0 < frozen_weights < len(weights)
    assert counted["on", True] == (counted["on", False][0] - frozen_weights, frozen_weights)
    assert counted["off", True][1] == 0
    _assert_same(out["on", True], out["off", True])
    _assert_same(out["on", True], out["on", False])


@pytest.mark.slow
def test_the_scanned_step_compiles_once_and_counts_every_blocks_flops(caplog):
    """The training step with the blocks scanned traces and compiles once (the first call), and
    its FLOPs count the scan's body once per block, inside the accumulation loop: those of the
    unrolled step."""
    m = model.load("gemma_micro", seed=0).module
    batch = _two_micro_batches()
    counted = {}
    for mode in ("off", "on"):
        step, state, frozen = _sft_step(m, mode)
        step = jax.jit(step)
        state, _ = step(state, frozen, batch)
        counted[mode] = flops.step_flops(step.lower(state, frozen, batch).compile())
        with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
            for _ in range(2):
                state, _ = step(state, frozen, batch)
        assert not [r.getMessage() for r in caplog.records if "jit(step)" in r.getMessage()]
    assert counted["on"] == pytest.approx(counted["off"], rel=0.02)


LORA = ["--lora.rank", "2", "--lora.targets", "attention", "--optim.learning-rate", "1e-2"]


@pytest.mark.slow  # two runs of the micro model (the shared one, if no other test built it)
@pytest.mark.parametrize("shared, extra", [("sft", []), ("sft_lora", LORA)])
def test_training_steps_equal(shared, extra, shared_run, tmp_path):
    """Four SFT steps of the micro model, full and LoRA, scanned: the losses of the shared
    unrolled run of the same command (conftest.SHARED_RUNS)."""
    lines = []
    support.train_run("sft", *support.MICRO, *support.FAST_STEPS, *extra, "--scan-layers", "on", "--run-dir", tmp_path / "run",
                      echo=lines.append)
    assert "layer scan: on (on: 2 identical blocks)" in lines
    got, want = support.losses(tmp_path / "run"), support.losses(shared_run(shared))
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)],
                               rtol=1e-5)


def test_auto_leaves_short_stacks_unrolled_and_scans_long_identical_ones():
    micro = model.load("gemma_micro", seed=0).module
    assert model.set_scan(micro, "auto") == "layer scan: off (auto: 2 blocks, fewer than 8)"
    assert not model.scanning(micro)
    assert api.config_type("sft")().scan_layers == "off"  # the default of a run: slower steps
    long = _long_stack()
    assert model.set_scan(long, "auto") == "layer scan: on (auto: 8 identical blocks)"
    assert model.scanning(long)
    assert model.set_scan(long, "off") == "layer scan: off (requested)"
    assert not model.scanning(long)


def _long_stack():
    keras.utils.set_random_seed(0)
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=layer_scan.MIN_BLOCKS, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8, dtype="float32")


def test_the_memory_estimate_counts_the_stacked_copy_and_names_the_fix():
    long = _long_stack()
    cfg = support.bare_config("sft")
    params = model.split(long)[1]
    assert "stacked blocks" not in memory.estimate(cfg, long, params, 1, False, {"data": 1})
    model.set_scan(long, "on")
    parts = memory.estimate(cfg, long, params, 1, False, {"data": 1})
    blocks = [v for block in model.decoder_blocks(long) for v in block.weights]
    assert parts["stacked blocks"] == sum(v.value.nbytes for v in blocks)
    assert memory.fixes(cfg, scanning=True)[0].startswith("--scan-layers off")
    assert not any("scan" in fix for fix in memory.fixes(cfg))


@pytest.mark.parametrize("family, why", [("gemma2", "its blocks differ"),
                                         ("mixtral", "mixture of experts")])
def test_blocks_that_differ_stay_unrolled_and_on_names_why(family, why):
    bb = support.tiny_backbone(family)
    assert model.set_scan(bb, "auto").startswith("layer scan: off (auto: ")  # 2 blocks: short
    assert why in layer_scan.problem(bb)
    with pytest.raises(errors.ConfigError, match=f"--scan-layers on: .*{why}"):
        model.set_scan(bb, "on")
    assert not model.scanning(bb)


def test_a_graph_that_reads_a_block_output_twice_is_not_a_chain():
    inputs = keras.Input((4,))
    first, second = keras.layers.Dense(4, name="b0"), keras.layers.Dense(4, name="b1")
    x0 = first(inputs)
    x1 = second(x0)
    chain = keras.Model(inputs, x1)
    assert layer_scan._chain_problem(chain, [first, second]) is None
    first, second = keras.layers.Dense(4, name="c0"), keras.layers.Dense(4, name="c1")
    x0 = first(inputs)
    skip = keras.Model(inputs, keras.layers.Add()([second(x0), x0]))
    assert "the output of c0 is read by" in layer_scan._chain_problem(skip, [first, second])


def test_the_option_is_announced_on_resume_and_checked():
    assert resume.classify("scan_layers") == ("announced", "")
    with pytest.raises(errors.ConfigError, match="--scan-layers must be one of"):
        model.set_scan(model.load("gemma_micro", seed=0).module, "yes")
