"""The TRL 1.16 variants through the model and the loop: the per-token inputs the algorithms pass
(WPO's log sum p^2, ORPO's prompt-and-completion NLL), TRL's token-mean NLL terms staying exact
under gradient accumulation through the jitted step, and 2-step runs of the new command-line
options on the micro model."""

import json
import math

import nnx_posttrain  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nnx_posttrain import data, errors, model, train
from nnx_posttrain.algorithms import CPO, DPO, KTO, ORPO, SimPO
from support import MICRO, records, train_run

CHUNK = 8
UNEVEN = [
    {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "twenty-two"},
    {"prompt": "What is 10 + 15?", "chosen": "It is 25.", "rejected": "5"},
    {"prompt": [{"role": "user", "content": "What is 7 + 8?"}],
     "chosen": [{"role": "assistant", "content": "15 exactly"}],
     "rejected": [{"role": "assistant", "content": "1"}]},
    {"prompt": "1 + 1 =", "chosen": " 2, of course, two", "rejected": " 11 or 2"},
]


@pytest.fixture(scope="module")
def lm():
    return model.load("gemma_micro", seed=0)


def _host_batch(lm, recs, max_length=24):
    src = data.ListSource(recs, "test")
    transform = data.make_transform(src, lm, max_length)
    examples = [transform(src[i]) for i in range(len(src))]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0] if k != "truncated"}


@pytest.mark.slow
def test_log_sum_sq_is_log_sum_of_squared_probabilities(lm):
    """WPO's per-token input (TRL's fused LM head ``log_sum_sq_probs``), chunked and at scored
    positions only, equals log sum_v softmax(logits)_v^2 of the full logits."""
    batch = _host_batch(lm, UNEVEN)
    ids, att = jnp.asarray(batch["chosen_input_ids"]), jnp.asarray(batch["chosen_attention_mask"])
    logits = model.full_logits(lm.module, ids, att)
    logp = jax.nn.log_softmax(logits, axis=-1)
    want = jax.nn.logsumexp(2 * logp, axis=-1)[:, :-1]
    positions = model.scored_positions(batch["chosen_loss_mask"])
    for pos in (None, jnp.asarray(positions[0]) if positions else None):
        tok, lss = model.token_logprobs(lm.module, ids, att,
                                        model.Projection(CHUNK, log_sum_sq=True), positions=pos)
        m = batch["chosen_loss_mask"][:, 1:] > 0
        np.testing.assert_allclose(np.asarray(lss)[:, 1:][m], np.asarray(want)[m], rtol=1e-5,
                                   atol=1e-5)
        picked = np.take_along_axis(np.asarray(logp)[:, :-1], np.asarray(ids)[:, 1:, None], -1)[..., 0]
        np.testing.assert_allclose(np.asarray(tok)[:, 1:][m], picked[m], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_orpo_nll_covers_prompt_and_completion_as_trl(lm):
    """trl/experimental/orpo/orpo_trainer.py, ORPOTrainer.concatenated_forward: labels = input ids
    where attended ("orpo chosen nll loss is computed over the full prompt and response"), the
    token-mean cross-entropy; ``nll_tokens completion`` keeps to the answer."""
    host = _host_batch(lm, UNEVEN)
    ids = jnp.asarray(host["chosen_input_ids"])
    att = host["chosen_attention_mask"]
    logp = jax.nn.log_softmax(model.full_logits(lm.module, ids, jnp.asarray(att)), axis=-1)
    picked = np.take_along_axis(np.asarray(logp)[:, :-1], np.asarray(ids)[:, 1:, None], -1)[..., 0]
    full = -picked[att[:, 1:] > 0].mean()
    answer = -picked[host["chosen_loss_mask"][:, 1:] > 0].mean()
    for tokens, want in (("prompt_and_completion", full), ("completion", answer)):
        algo = ORPO(ORPO.Config(nll_tokens=tokens), CHUNK)
        algo.setup(lm.module)
        batch = {k: jnp.asarray(v) for k, v in algo.prepare(dict(host)).items()}
        _, _, metrics = algo.loss(lm.module, batch)
        s, c = metrics["nll_loss"]
        assert float(s / c) == pytest.approx(want, rel=1e-5), tokens
    assert abs(full - answer) > 1e-2


def _step_results(algo, lm, host, accum):
    graphdef, params, frozen_model = model.split(lm.module)
    lr = lambda step: 1.0
    tx = optax.sgd(lr)  # the update is the gradient (AdamW's first step is sign-like)
    frozen = {"model": frozen_model,
              "reference": jax.tree.map(jnp.copy, params) if algo.reference_mode == "copy" else None}
    state = train.init_state(jax.tree.map(jnp.copy, params), tx, seed=0)
    step = jax.jit(train.make_train_step(graphdef, algo.loss, tx, lr))
    batch = algo.prepare(dict(host))  # on the whole batch, as the loop does
    stacked = {k: jnp.asarray(np.asarray(v).reshape(accum, -1, *np.shape(v)[1:]))
               for k, v in batch.items()}
    new_state, metrics = step(state, frozen, stacked)
    return jax.device_get(new_state["params"]), {k: float(v) for k, v in metrics.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo_sft", "orpo"])  # CPO / SimPO share DPO's NLL path
def test_token_mean_nll_accumulates_exactly_through_the_step(lm, name):
    """A combined loss (per-pair preference term + per-token NLL term) over 2 micro-batches of
    unequal token counts gives the same loss, metrics and update as the one batch: the NLL
    terms are scaled by the whole batch's pairs / tokens, computed on the host (``nll_scale``)."""
    algo = {
        "dpo_sft": lambda: DPO(DPO.Config(loss_type="sigmoid,sft", beta=0.5), CHUNK),
        "cpo": lambda: CPO(CPO.Config(), CHUNK),
        "simpo_nll": lambda: SimPO(SimPO.Config(nll_weight=0.7), CHUNK),
        "orpo": lambda: ORPO(ORPO.Config(), CHUNK),
    }[name]()
    algo.setup(lm.module)
    host = _host_batch(lm, UNEVEN)
    assert len({int(host["chosen_loss_mask"][:2].sum()), int(host["chosen_loss_mask"][2:].sum())}) == 2
    p1, m1 = _step_results(algo, lm, host, 1)
    p2, m2 = _step_results(algo, lm, host, 2)
    for key in ("loss", "grad_norm") + (("nll_loss",) if "nll_loss" in m1 else ()):
        assert m2[key] == pytest.approx(m1[key], rel=2e-5), key
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


def test_dpo_options_are_checked_before_training(lm):
    for cfg, match in ((dict(loss_type="exo_pair"), "exo_pair"),
                       (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), "only applies"),
                       (dict(loss_type="aot", use_weighting=True), "aot"),
                       (dict(ld_alpha=1.5), "ld-alpha")):
        with pytest.raises(errors.ConfigError, match=match):
            DPO(DPO.Config(**cfg), CHUNK).setup(lm.module)
    with pytest.raises(errors.ConfigError, match="precompute"):
        KTO(KTO.Config(reference="precompute"), CHUNK).setup(lm.module)
    KTO(KTO.Config(reference="precompute", loss_type="apo_zero_unpaired"), CHUNK).setup(lm.module)


# ----------------------------------------------------------------------------- 2-step runs


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("variant_data")
    out = {}
    for kind, n in (("preference", 8), ("unpaired_preference", 8), ("prompt_only", 16)):
        recs = {split: [{k: v for k, v in data.source("builtin", split, builtin=kind)[i].items()
                         if not k.startswith("_")} for i in range(n)] for split in ("train", "eval")}
        out[kind] = (_write(d / f"{kind}_train.jsonl", recs["train"]),
                     _write(d / f"{kind}_eval.jsonl", recs["eval"][:4]))
    return out


COMMON = [*MICRO, "--init-from", "", "--steps", "2", "--log-every", "1", "--checkpoint.every", "0",
          "--eval.every", "0", "--eval.batches", "1", "--eval.exact-match", "0"]

RUNS = {
    "dpo_exo_pair": ("dpo", "preference", ["--algo.loss-type", "exo_pair",
                                           "--algo.label-smoothing", "0.001"]),
    "dpo_aot_discopop": ("dpo", "preference", ["--algo.loss-type", "aot,aot_unpaired,discopop,cdpo",
                                               "--algo.label-smoothing", "0.1"]),
    "dpo_wpo_ld_fdiv_precompute": ("dpo", "preference", [
        "--algo.loss-type", "sigmoid,sft", "--algo.use-weighting", "--algo.ld-alpha", "0.5",
        "--algo.f-divergence-type", "alpha_divergence", "--algo.f-alpha-divergence-coef", "0.3",
        "--algo.reference", "precompute", "--batching.grad-accum", "2"]),
    "cpo_alphapo": ("cpo", "preference", ["--algo.loss-type", "alphapo", "--algo.alpha", "0.5"]),
    "orpo_completion_nll": ("orpo", "preference", ["--algo.nll-tokens", "completion"]),
    "kto_apo_zero_unpaired": ("kto", "unpaired_preference", ["--algo.loss-type",
                                                             "apo_zero_unpaired"]),
    "grpo_gspo_cispo": ("grpo", "prompt_only", [
        "--algo.loss-type", "cispo", "--algo.importance-sampling-level", "sequence",
        "--algo.epsilon-high", "5.0", "--algo.num-iterations", "2", "--algo.rewards", "exact_match"]),
    "grpo_sapo_entropy_kl": ("grpo", "prompt_only", [
        "--algo.loss-type", "sapo", "--algo.top-entropy-quantile", "0.5", "--algo.beta", "0.04",
        "--algo.off-policy-mask-threshold", "0.5", "--algo.rewards", "exact_match"]),
    "grpo_vespo_gdpo_delta": ("grpo", "prompt_only", [
        "--algo.loss-type", "vespo", "--algo.rewards", "length,format",
        "--algo.multi-objective-aggregation", "normalize_then_sum", "--algo.delta", "1.5"]),
    "rloo_clip_normalize": ("rloo", "prompt_only", [
        "--algo.reward-clip-range", "-0.5", "0.5", "--algo.normalize-advantages",
        "--algo.num-generations", "2", "--algo.num-iterations", "2", "--algo.rewards", "exact_match"]),
    "ppo_k3_whiten": ("ppo", "prompt_only", ["--algo.kl-estimator", "k3",
                                             "--algo.whiten-rewards", "--algo.rewards", "exact_match"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(RUNS))
def test_new_options_train_from_the_command_line(tmp_path, files, run):
    name, kind, extra = RUNS[run]
    train_file, eval_file = files[kind]
    batch = ["--batching.batch-size", "8" if kind == "prompt_only" else "4"]
    if kind == "prompt_only":
        batch += ["--algo.max-completion-length", "4"]
        if name == "grpo":
            batch += ["--algo.num-generations", "4"]
    train_run(name, *COMMON, "--data", train_file, "--eval-data", eval_file, "--run-dir",
              tmp_path / run, *batch, *extra)
    rows = records(tmp_path / run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
    if name == "grpo" and "--algo.beta" in extra:
        assert all(math.isfinite(r["kl"]) for r in rows)
