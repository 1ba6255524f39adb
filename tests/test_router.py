"""Mixture of experts: the router load-balancing loss (``losses.router``) equals transformers
5.24's ``load_balancing_loss_func`` on the same router logits, and ``model.router`` captures
every MoE layer's logits of a forward pass (as the router layers compute them), under remat too
(Qwen 3.5 MoE's, with its shared expert: the logits and the aux loss of transformers' model);
SFT and DPO on a tiny Qwen3-MoE / Mixtral add it (``--algo.router-aux-loss-coef``, default the
family's) and log ``aux_loss`` and the tokens per expert; so do KTO, reward modelling, RLOO, PPO,
online DPO and distillation (loss calls)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

import support
from nnx_posttrain import errors, families, model
from nnx_posttrain.model.blocks import backbone_inputs
from nnx_posttrain.losses.router import RouterOptions, load_balancing, with_router_aux

torch = pytest.importorskip("torch")


def _transformers(logits, top_k, mask=None):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gate = tuple(torch.from_numpy(np.asarray(x)) for x in logits)
    m = None if mask is None else torch.from_numpy(np.asarray(mask))
    return float(load_balancing_loss_func(gate, logits.shape[-1], top_k, m))


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 2), (32, 4), (128, 8)])
def test_load_balancing_equals_transformers(experts, top_k, masked):
    """3 layers, a batch of 2 x 7 positions (rows batch-major, as [B * T, E])."""
    rng = np.random.default_rng(experts + top_k)
    logits = rng.normal(size=(3, 14, experts)).astype(np.float32) * 2
    mask = np.ones((2, 7), np.int64)
    mask[1, :3] = 0
    ours, tokens = load_balancing(jnp.asarray(logits), top_k,
                                  jnp.asarray(mask.reshape(-1)) if masked else None)
    theirs = _transformers(logits, top_k, mask if masked else None)
    assert float(ours) == pytest.approx(theirs, rel=1e-5)
    assert float(tokens.sum()) == pytest.approx(top_k, rel=1e-5)  # shares of the routed tokens


def test_the_aux_term_is_added_to_the_mean_and_logged():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 4)), jnp.float32)
    routed = model.router.Routed(logits, jnp.ones(6), 2, 0.5)
    total, weight, metrics = with_router_aux((jnp.float32(3.0), jnp.float32(2.0), {}), routed)
    aux, _ = load_balancing(logits, 2)
    assert float(total / weight) == pytest.approx(1.5 + 0.5 * float(aux), rel=1e-6)
    assert float(metrics["aux_loss"][0]) == pytest.approx(float(aux))
    assert {f"moe/tokens_per_expert/{e}" for e in range(4)} <= set(metrics)
    assert with_router_aux((1.0, 1.0, {}), None) == (1.0, 1.0, {})
    with pytest.raises(errors.ConfigError, match="router-aux-loss-coef"):
        RouterOptions(router_aux_loss_coef=-1.0).check()


# the tiny configurations with experts (Gemma 4's dense ones have none)
MOE = [v for f in families.FAMILIES.values() if f.moe for v, kw in f.tiny.items()
       if kw.get("num_experts")]


# Qwen 3.5 MoE's (a shared expert beside the routed ones): the full suite's
@pytest.fixture(scope="module", params=[pytest.param(v, marks=pytest.mark.slow)
                                        if v == "qwen3_5_moe" else v for v in MOE])
def moe(request):
    return support.tiny_backbone(request.param)


def _router_outputs(bb, x):
    """Each router layer's output, computed by the layer itself on its block's input, the
    backbone's forward as one jitted program (``support.jitted``; op by op, Gemma 4's MoE
    forward took ~8 s compiling each operation of a new shape on its own)."""

    def forward(bb, x):
        family = families.of(bb)
        outs = []

        def keep(layer, original):
            def call(*a, **k):
                y = original(*a, **k)
                outs.append(y)
                return y
            return call

        routers = [family.moe.router(b) for b in model.decoder_blocks(bb)]
        # Qwen 3.5 MoE's Gated DeltaNet as the package's forward runs it
        with model.blocks.shadowed(routers, "call", keep), model.blocks.recurrent_calls(bb):
            bb(backbone_inputs(bb, x, jnp.ones_like(x)))
        return outs

    return [np.asarray(y) for y in support.jitted(forward, bb)(x)]


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_the_capture_holds_every_layers_router_logits_inside_jit(moe, remat):
    x = jnp.asarray(np.random.default_rng(0).integers(1, 60, (2, 9)), jnp.int32)
    want = _router_outputs(moe, x)
    model.set_remat(moe, remat)
    graphdef, params, rest = model.split(moe)

    def captured(params):
        m = nnx.merge(graphdef, params, rest)
        with model.routers_captured(m) as capture:
            model.hidden_states(m, x, jnp.ones_like(x))
        routed = capture.routed()
        return routed.logits, routed.mask

    assert ("remat" in str(jax.make_jaxpr(captured)(params))) == remat
    logits, mask = jax.jit(captured)(params)
    model.set_remat(moe, False)
    assert logits.shape == (len(want), 18, want[0].shape[-1]) and float(mask.sum()) == 18
    for got, ref in zip(logits, want):
        np.testing.assert_allclose(got, ref.reshape(18, -1), atol=1e-5)


@pytest.mark.parametrize("variant", MOE)
def test_all_linear_lora_leaves_the_routers(variant):
    bb = support.TINY_FAMILIES[variant]()
    family = families.of(bb)
    routers = [r.path for r in map(family.moe.router, model.decoder_blocks(bb)) if r is not None]
    adapted = model.enable_lora(bb, 2, targets="all-linear")
    assert routers and adapted and not set(routers) & set(adapted)
    assert not [v.path for v in bb.weights if "/lora_" in v.path  # PEFT's: no stacked experts
                and "/lora_kernel_" not in v.path]
    other = support.TINY_FAMILIES[variant]()  # mlp: the experts (per-expert factors) too
    adapted = model.enable_lora(other, 2, targets="mlp")
    kernels = tuple(f"/{k}" for k in family.moe.expert_layer.kernels)
    assert not set(routers) & set(adapted) and any(p.endswith(kernels) for p in adapted)


@pytest.mark.slow
def test_qwen3_5_moes_router_logits_and_aux_loss_are_transformers(tmp_path):
    """Qwen 3.5 MoE (a shared expert beside the routed ones, outside the routing): exported,
    transformers 5.24's ``Qwen3_5MoeForCausalLM`` computes the same router logits per layer as
    the captured ones and the same ``aux_loss`` as ``losses.router`` (left padding masked)."""
    from transformers import AutoModelForCausalLM

    from nnx_posttrain.export import hf

    bb = support.tiny_backbone("qwen3_5_moe")
    hf.export_model(type("Task", (), {"backbone": bb, "preprocessor": None})(), tmp_path,
                    "float32")
    ids = np.random.default_rng(0).integers(1, 60, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    graphdef, params, rest = model.split(bb)

    def captured(params):
        m = nnx.merge(graphdef, params, rest)
        with model.routers_captured(m) as capture:
            model.hidden_states(m, jnp.asarray(ids), jnp.asarray(mask))
        routed = capture.routed()
        return routed.logits, routed.mask, load_balancing(routed.logits, routed.top_k,
                                                          routed.mask)[0]

    logits, _, ours = jax.jit(captured)(params)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        out = theirs(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                     output_router_logits=True)
    real = mask.reshape(-1) == 1  # padding rows carry no loss (their logits may differ)
    for got, want in zip(logits, out.router_logits):
        np.testing.assert_allclose(np.asarray(got)[real], want.numpy()[real], atol=1e-5)
    assert float(ours) == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert families.of(bb).moe.aux_coef(bb) == theirs.config.router_aux_loss_coef == 0.001


def test_a_dense_model_captures_nothing(micro):
    with model.routers_captured(micro.module) as capture:
        pass
    assert capture.routed() is None


# ----------------------------------------------------------------------------- micro presets

# two steps on 8 records of the built-in task (``data``) with the built-in recipes' remat and
# accumulation: no eval data, so no evaluation
STEPS = ["--steps", "2", "--log-every", "1", "--eval.every", "0", "--checkpoint.every", "0",
         "--batching.batch-size", "2", "--batching.max-length", "48", "--eval.exact-match", "0",
         "--remat", "none", "--batching.grad-accum", "1"]


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    from tools import make_preset

    out = {}
    for name in ("qwen3_moe", "mixtral"):
        family = families.FAMILIES[name]
        path = tmp_path_factory.mktemp(name)
        make_preset._task(name, dict(family.tiny[name], vocabulary_size=1024), 1024,
                          "float32").save_to_preset(str(path))
        out[name] = path
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """{format: a file of the built-in task's first 8 training records in it}."""
    out = tmp_path_factory.mktemp("data")
    return {kind: support.builtin_file(out / f"{kind}.jsonl", kind)
            for kind in ("sft", "preference", "unpaired_preference")}


@pytest.mark.slow
def test_sft_on_a_moe_model_logs_the_aux_loss_with_the_familys_coefficient(presets, data,
                                                                            tmp_path):
    """Qwen3-MoE: coefficient 0.001 by default (its config); the loss is the NLL plus it."""
    support.train_run("sft", "--model", presets["qwen3_moe"], "--data", data["sft"], *STEPS,
                      "--run-dir", tmp_path / "a", echo=lambda *_: None)
    first = support.records(tmp_path / "a")[0]
    assert 1.0 <= first["aux_loss"] <= 4.0  # k = 2 balanced; at most k x E / k
    assert first["moe/min_tokens_per_expert"] <= 0.5 <= first["moe/max_tokens_per_expert"]
    support.train_run("sft", "--model", presets["qwen3_moe"], "--data", data["sft"], *STEPS,
                      "--run-dir", tmp_path / "b", "--algo.router-aux-loss-coef", "0",
                      echo=lambda *_: None)
    off = support.records(tmp_path / "b")[0]
    assert off["aux_loss"] == pytest.approx(first["aux_loss"], rel=1e-5)
    assert first["loss"] == pytest.approx(off["loss"], rel=1e-5)  # the NLL is logged as loss


@pytest.mark.slow
def test_dpo_on_a_moe_model_adds_the_policys_aux_loss(presets, data, tmp_path):
    support.train_run("dpo", "--model", presets["mixtral"], "--data", data["preference"], *STEPS,
                      "--lora.rank", "2", "--run-dir", tmp_path, echo=lambda *_: None)
    first = support.records(tmp_path)[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-3) and first["aux_loss"] > 1.0


@pytest.mark.slow
def test_simpo_on_a_moe_model_adds_the_aux_loss(presets, data, tmp_path):
    support.train_run("simpo", "--model", presets["qwen3_moe"], "--data", data["preference"],
                      *STEPS, "--lora.rank", "2", "--algo.router-aux-loss-coef", "0.5",
                      "--run-dir", tmp_path, echo=lambda *_: None)
    assert support.records(tmp_path)[0]["aux_loss"] > 1.0


# ----------------------------------------------------------------------------- every algorithm
# KTO, reward modelling, RLOO, PPO, online DPO and distillation add the trainable model's aux
# loss too (a loss call on the tiny Qwen3-MoE: total / weight with coefficient c is the one with
# coefficient 0 plus c x the logged aux_loss)

ROWS, WIDTH, CHUNK = 4, 10, 8


def _rows(seed, rows=ROWS):
    """(ids, attention, loss mask) [rows, WIDTH]: a padded row, the first 4 tokens a prompt."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 60, (rows, WIDTH)).astype(np.int32)
    att = np.ones_like(ids)
    att[0, -3:] = 0
    ids[att == 0] = 0
    loss = att.copy()
    loss[:, :4] = 0
    return ids, att, loss


def _pairs():
    (ci, ca, cl), (ri, ra, rl) = _rows(1), _rows(2)
    return dict(chosen_input_ids=ci, chosen_attention_mask=ca, chosen_loss_mask=cl,
                rejected_input_ids=ri, rejected_attention_mask=ra, rejected_loss_mask=rl)


def _kto(algorithm, bb):
    ids, att, loss = _rows(3)
    batch = algorithm.prepare(dict(input_ids=ids, attention_mask=att, loss_mask=loss,
                                   label=np.array([1, 0, 1, 0], np.int32)))
    algorithm.reference_mode = "copy"
    return bb, batch, bb


def _reward(algorithm, bb):
    from nnx_posttrain.model.heads import RewardModel

    return RewardModel(bb), _pairs(), None


def _rloo(algorithm, bb):
    ids, att, loss = _rows(4)
    adv = np.linspace(-1, 1, ROWS).astype(np.float32)
    return bb, dict(input_ids=ids, attention_mask=att, loss_mask=loss, advantages=adv), None


def _ppo(algorithm, bb):
    from nnx_posttrain.model.heads import PolicyWithValue

    ids, att, loss = _rows(5)
    rng = np.random.default_rng(5)
    per_token = lambda: rng.normal(size=ids.shape).astype(np.float32)  # noqa: E731
    return PolicyWithValue(bb), dict(
        input_ids=ids, attention_mask=att, loss_mask=loss, old_logps=per_token() - 4.0,
        advantages=per_token(), returns=per_token(), old_values=per_token()), None


def _online_dpo(algorithm, bb):
    algorithm.reference_mode = "copy"
    scores = dict(chosen_score=np.ones(ROWS, np.float32), rejected_score=np.zeros(ROWS, np.float32))
    return bb, dict(_pairs(), **scores), bb


def _distill(algorithm, bb):
    algorithm.teacher_graphdef, teacher = nnx.split(support.tiny_backbone("qwen3_moe"))
    ids, att, loss = _rows(6)
    return bb, dict(input_ids=ids, attention_mask=att, loss_mask=loss), teacher


CALLS = dict(kto=_kto, reward=_reward, rloo=_rloo, ppo=_ppo, online_dpo=_online_dpo,
             distill=_distill)


@pytest.fixture(scope="module")
def qwen3_moe():
    return support.tiny_backbone("qwen3_moe")


def _loss(name, bb, coef):
    from nnx_posttrain import algorithms

    cls = algorithms.get(name)
    online = dict(rewards="length") if name in ("rloo", "ppo", "online_dpo") else {}
    algorithm = cls(cls.Config(router_aux_loss_coef=coef, **online), CHUNK)
    module, batch, third = CALLS[name](algorithm, bb)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    # one jitted program (op by op, a MoE forward compiles hundreds of operations on their own)
    total, weight, metrics = nnx.jit(algorithm.loss)(module, batch, third)
    return float(total / weight), float(metrics["aux_loss"][0]), metrics


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CALLS))
def test_every_algorithm_adds_the_policys_aux_loss(qwen3_moe, name):
    on, aux, metrics = _loss(name, qwen3_moe, 0.5)
    off, aux_off, _ = _loss(name, qwen3_moe, 0.0)
    assert 1.0 <= aux <= 4.0 and aux_off == pytest.approx(aux, rel=1e-6)  # k = 2 of 4 experts
    assert on == pytest.approx(off + 0.5 * aux, rel=1e-5, abs=1e-6)
    assert {"moe/max_tokens_per_expert", "moe/min_tokens_per_expert"} <= set(metrics)


@pytest.mark.slow
def test_ktos_aux_loss_is_the_examples_not_the_kl_rows(qwen3_moe):
    """As TRL's KTOTrainer: the aux loss of the examples' forward (the KL rows' and the
    reference's forwards add nothing)."""
    ids, att, loss = _rows(3)

    def examples_aux(bb, ids, att):
        with model.routers_captured(bb, 0.5) as capture:
            model.hidden_states(bb, ids, att)
        routed = capture.routed()
        return load_balancing(routed.logits, routed.top_k, routed.mask)[0]

    want = support.jitted(examples_aux, qwen3_moe)(jnp.asarray(ids), jnp.asarray(att))
    assert _loss("kto", qwen3_moe, 0.5)[1] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.slow
def test_kto_on_a_moe_model_adds_the_examples_aux_loss(presets, data, tmp_path):
    """Inside the compiled step, with its KL rows (the aux loss of the examples' rows only)."""
    support.train_run("kto", "--model", presets["qwen3_moe"], "--data",
                      data["unpaired_preference"], *STEPS, "--lora.rank", "2",
                      "--run-dir", tmp_path, echo=lambda *_: None)
    first = support.records(tmp_path)[0]
    assert 1.0 <= first["aux_loss"] <= 4.0 and "moe/max_tokens_per_expert" in first
