"""Distillation: the generalized JSD equals TRL 1.16's, the two models' projections are chunked
without changing a value or a gradient, and a run distils a teacher (a run of ours, or a model
by name) into the student on its own samples and the data's, resuming exactly."""

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_posttrain import errors, model, runs
from nnx_posttrain.algorithms import distill
from nnx_posttrain.losses.distill import DistillOptions, divergence, gkd
from support import FAST_STEPS, MICRO, jitted, losses, records, refusal, train_run


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (2.0, None), (0.7, 3.0)])
def test_divergence_entropy_and_gradients_equal_trls_chunked_divergence(beta, temperature, softcap):
    """Against TRL 1.16's own ChunkedDivergenceFunction (its CPU path), on random hidden states
    and heads, with masked positions: the per-token values, the entropy, and the gradient of the
    masked mean with respect to the student's hidden states and head."""
    torch = pytest.importorskip("torch")
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    rng = np.random.default_rng(0)
    h_s, h_t = rng.normal(size=(6, 8)), rng.normal(size=(6, 12))
    w_s, w_t = rng.normal(size=(50, 8)), rng.normal(size=(50, 12))
    mask = np.asarray([1, 1, 0, 1, 0, 1], np.float32)
    t = lambda x: torch.tensor(x, dtype=torch.float32, requires_grad=True)
    ths, tws = t(h_s), t(w_s)
    want_div, want_ent = ChunkedDivergenceFunction.apply(
        ths, tws, None, t(h_t), t(w_t), None, beta, temperature, 1.0, softcap, 1.0, softcap)
    (want_div * torch.tensor(mask)).sum().div(mask.sum()).backward()

    def capped(x):
        return x if softcap is None else softcap * jnp.tanh(x / softcap)

    def ours(h, w):
        div, ent = divergence(capped(h @ w.T), capped(jnp.asarray(h_t @ w_t.T, jnp.float32)),
                              DistillOptions(beta, temperature))
        return jnp.sum(div * mask) / mask.sum(), (div, ent)

    args = jnp.asarray(h_s, jnp.float32), jnp.asarray(w_s, jnp.float32)
    (_, (div, ent)), (g_h, g_w) = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(*args)
    np.testing.assert_allclose(div, want_div.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ent, want_ent.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_h, ths.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_w, tws.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_gkd_is_the_token_mean_over_the_completion_tokens_with_trls_metrics():
    per_token, entropy = jnp.asarray([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]]), jnp.ones((2, 3))
    total, weight, metrics = gkd(per_token, entropy, jnp.asarray([[0, 1, 1], [0, 1, 0]]))
    assert float(total) == 6.0 and float(weight) == 3.0
    assert {k: (float(s), float(c)) for k, (s, c) in metrics.items()} == {
        "loss": (6.0, 3.0), "entropy": (3.0, 3.0)}


@pytest.mark.slow
def test_the_two_projections_in_chunks_and_at_scored_positions_change_nothing(micro):
    teacher = model.load("gemma2_tiny", seed=1).module  # wider, with Gemma 2's final soft cap
    student = micro.module
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 300, size=(2, 10)), jnp.int32)
    pad = jnp.ones((2, 10), jnp.int32)
    loss_mask = np.zeros((2, 10), np.int32)
    loss_mask[:, 6:] = 1
    options = DistillOptions(beta=0.5, temperature=1.5)
    fn = lambda s, t: divergence(s, t, options)
    # each forward, divergence and gradient one jitted program, not an operation at a time
    full = jitted(model.full_logits, teacher)(ids, pad)
    assert float(jnp.max(jnp.abs(full))) <= 30.0  # the final soft cap is in the teacher's logits
    want = jax.jit(fn)(jitted(model.full_logits, student)(ids, pad)[:, :-1], full[:, :-1])
    graphdef, params, rest = nnx.split(student, model.trainable_filter, ...)
    teacher_graphdef, teacher_state = nnx.split(teacher)

    def value_and_grad(chunk, positions=None):
        def total(p, teacher_state):
            s, t = nnx.merge(graphdef, p, rest), nnx.merge(teacher_graphdef, teacher_state)
            div, ent = model.paired_terms((s, t), ids, pad, fn, chunk, positions=positions)
            return jnp.sum(div * loss_mask), (div, ent)
        return jax.jit(jax.value_and_grad(total, has_aux=True))(params, teacher_state)

    (v0, (div0, ent0)), g0 = value_and_grad(0)
    np.testing.assert_allclose(div0[:, 1:], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent0[:, 1:], want[1], rtol=1e-5, atol=1e-6)
    positions = jnp.asarray(model.scored_positions(loss_mask)[0])
    for chunk, pos in ((2, positions),):  # chunks of 2 of the 4 scored positions
        (v, (div, _)), g = value_and_grad(chunk, pos)
        np.testing.assert_allclose(v, v0, rtol=1e-5)
        np.testing.assert_allclose(div * loss_mask, div0 * loss_mask, rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def _distill(run_dir, *extra):
    return train_run("distill", *MICRO, *FAST_STEPS, "--run-dir", run_dir, "--init-from", "",
                     "--log-every", "1", "--algo.max-completion-length", "6", *extra)


@pytest.mark.slow
def test_a_run_teaches_the_student_on_its_samples_and_the_datas_and_resumes_exactly(
        shared_run, tmp_path, capsys):
    teacher = shared_run("sft")
    args = ["--algo.teacher", teacher, "--seed", "3", "--algo.lmbda", "0.5",
            "--optim.learning-rate", "3e-3", "--steps", "6"]
    _distill(tmp_path / "run", *args)
    assert f"teacher: {teacher} checkpoint 4" in capsys.readouterr().out
    rows = records(tmp_path / "run")
    assert {r["on_policy"] for r in rows} == {0.0, 1.0}  # both kinds of batch drawn
    sampled = [r for r in rows if r["on_policy"] == 1.0]
    assert all(1 <= r["completions/mean_length"] <= 6 for r in sampled)
    assert all(r["entropy"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # toward the teacher
    _distill(tmp_path / "cut", *args[:-1], "3")
    _distill(tmp_path / "cut", *args, "--resume")
    assert losses(tmp_path / "cut") == losses(tmp_path / "run")  # the same draws, the same samples


@pytest.mark.slow
def test_sequence_level_kd_trains_on_the_teachers_greedy_completions(shared_run, tmp_path,
                                                                      monkeypatch):
    generated = []
    real = distill.MixedBatches._completed

    def completed(self, batch, generate_from):
        out = real(self, batch, generate_from)
        generated.append((batch, out))
        return out

    monkeypatch.setattr(distill.MixedBatches, "_completed", completed)
    teacher = shared_run("sft")
    _distill(tmp_path / "run", "--algo.teacher", teacher, "--algo.seq-kd", "--algo.lmbda", "0",
             "--steps", "2", "--algo.top-k", "3")
    rows = records(tmp_path / "run")
    assert [r["on_policy"] for r in rows] == [0.0, 0.0]
    assert all(1 <= r["completions/mean_length"] <= 6 for r in rows)
    assert len(generated) == 2
    # Every completion token is the teacher's most likely next token (its greedy answer); the
    # prompts are the data's.
    module = runs.load(teacher).policy()
    for before, after in generated:
        ids, mask = np.asarray(after["input_ids"]), np.asarray(after["loss_mask"])
        starts = mask.argmax(axis=1)
        assert all((ids[i, :s] == np.asarray(before["input_ids"])[i, :s]).all()
                   for i, s in enumerate(starts))
        best = np.asarray(model.full_logits(module, ids, after["attention_mask"]).argmax(-1))
        scored = mask[:, 1:].astype(bool)
        assert scored.sum() > 0 and (ids[:, 1:][scored] == best[:, :-1][scored]).all()


@pytest.mark.slow
def test_a_teacher_by_name_in_bfloat16_and_what_is_refused(tmp_path, capsys, monkeypatch):
    _distill(tmp_path / "run", "--algo.teacher", "gemma2_tiny", "--steps", "2", "--algo.lmbda", "0")
    assert "teacher: gemma2_tiny: GemmaBackbone" in capsys.readouterr().out
    assert "--algo.teacher is required" in refusal("distill", *MICRO, "--run-dir", tmp_path / "a",
                                                   recipe=False)
    monkeypatch.chdir(tmp_path)  # no runs/grpo (the recipe's teacher) here
    assert "`python -m experiments.grpo` first" in refusal(
        "distill", *MICRO, "--run-dir", tmp_path / "a", "--init-from", "")
    msg = refusal("distill", *MICRO, "--run-dir", tmp_path / "b", "--algo.teacher", "x",
                  "--algo.beta", "2", "--algo.lmbda", "-1")
    assert "--algo.beta must be in [0, 1], got 2.0" in msg and "--algo.lmbda must be in [0, 1]" in msg
    student = model.load("gemma_micro")
    with pytest.raises(errors.ModelError, match="its chat format is llama3, the student's gemma"):
        distill._check_chat_formats(student.chat_format, "llama3", "other")


def test_a_teacher_with_another_tokenizer_is_refused_before_its_weights_load(tmp_path):
    from tools import make_preset

    teacher = tmp_path / "llama_tokenizer_only"  # a preset's tokenizer, no weights at all
    make_preset.llama3_tokenizer(4096).save_to_preset(str(teacher))
    (teacher / "config.json").write_text(json.dumps(
        {"module": "keras_hub.src.models.llama3.llama3_backbone", "class_name": "Llama3Backbone",
         "config": {}, "registered_name": "keras_hub>Llama3Backbone"}))
    msg = refusal("distill", *MICRO, *FAST_STEPS, "--run-dir", tmp_path / "run", "--init-from", "",
                  "--algo.teacher", str(teacher), error=errors.ModelError)
    assert "its tokenizer is not the student's (vocabularies of 4,096 and 314 tokens" in msg
    (teacher / "config.json").write_text(json.dumps(  # a Qwen directory: another chat format
        {"module": "keras_hub.src.models.qwen.qwen_backbone", "class_name": "QwenBackbone",
         "config": {}, "registered_name": "keras_hub>QwenBackbone"}))
    msg = refusal("distill", *MICRO, *FAST_STEPS, "--run-dir", tmp_path / "run", "--init-from", "",
                  "--algo.teacher", str(teacher), error=errors.ModelError)
    assert "its chat format is qwen2.5, the student's gemma" in msg


def test_a_teacher_too_big_for_the_memory_is_refused_before_it_loads(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(
        {"class_name": "GemmaBackbone", "config": {"dtype": {"config": {"name": "bfloat16"}}}}))
    with open(teacher / "model.weights.h5", "wb") as f:  # sparse: 1 TiB of bfloat16 weights
        f.truncate(2**40)
    assert model.weights_bytes(str(teacher), "bfloat16-params") == 2**40
    assert model.weights_bytes(str(teacher), "bfloat16") == 2**41  # float32 weights, 16-bit compute
    assert model.weights_bytes(str(teacher), "float32") == 2**41
    msg = refusal("distill", *MICRO, *FAST_STEPS, "--run-dir", tmp_path / "run",
                  "--init-from", "", "--algo.teacher", str(teacher), "--algo.teacher-dtype", "float32")
    assert "the distill partner model needs 2,048.00 GiB for its weights" in msg
