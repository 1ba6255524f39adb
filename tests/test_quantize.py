"""--quantize int8: a weight-only int8 frozen base under LoRA (Keras' own quantization), trained,
sampled, used as the LoRA-off reference, resumed and exported dequantized."""

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_posttrain import export, model, runs
from support import FAST_STEPS, MICRO, losses, refusal, train_run

IDS = jnp.asarray(np.random.default_rng(0).integers(4, 300, (2, 12)), jnp.int32)
MASK = jnp.ones((2, 12), jnp.int32)


def _logits(module):
    return np.asarray(model.full_logits(module, IDS, MASK))


@pytest.mark.slow
def test_the_int8_base_computes_as_the_model_and_dequantizes_into_its_effective_weights(
        monkeypatch):
    import gc
    import weakref

    base = model.load("gemma_micro", dtype="bfloat16-params")
    lm = model.load("gemma_micro", dtype="bfloat16-params")
    kernels = [weakref.ref(v) for v in lm.module.weights if v.name in ("kernel", "embeddings")]
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    gc.disable()
    try:
        assert model.quantize(lm.module, "int8") == 15  # q, k, v, o, 3 MLP x 2 blocks, embedding
    finally:
        gc.enable()
    # each float kernel is freed as it is replaced, without the full garbage collection per
    # layer Keras runs (seconds each in a process that holds many objects)
    assert len(kernels) == 15 and [k() for k in kernels] == [None] * 15 and collections == []
    frozen = {str(v.dtype) for v in lm.module.weights if "scale" not in v.path}
    assert frozen >= {"int8"} and "float32" not in frozen
    scale = np.abs(_logits(base.module)).max()
    # weight-only int8, per output channel: the model's logits within 5% of their scale
    assert np.abs(_logits(lm.module) - _logits(base.module)).max() < 0.05 * scale
    model.enable_lora(lm.module, 4, None, "attention", factor_dtype="float32")
    _, params, _ = model.split(lm.module)
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
    for layer in lm.module._flatten_layers(include_self=False):  # a trained-looking adapter
        if getattr(layer, "lora_enabled", False):
            layer.lora_kernel_b.assign(jnp.full(layer.lora_kernel_b.shape, 0.05, jnp.float32))
            assert layer.quantization_mode == "int8"  # still computing from int8 weights
    plain = model.load("gemma_micro", dtype="float32", seed=7)  # other weights, overwritten
    assert len(model.dequantized_into(lm.module, plain.module)) == 8
    # the exported weights compute what the quantized model computed (its bfloat16 rounding)
    assert np.abs(_logits(plain.module) - _logits(lm.module)).max() < 0.02 * scale


def test_an_embedding_is_quantized_a_block_of_rows_at_a_time_to_the_same_values():
    import keras

    from nnx_posttrain.model.quantize import RowBlockQuantizer

    x = jnp.asarray(np.random.default_rng(0).normal(size=(1000, 48)), jnp.bfloat16)
    whole, whole_scale = keras.quantizers.AbsMaxQuantizer(axis=-1)(x, to_numpy=True)
    rows, rows_scale = RowBlockQuantizer(rows=64)(x, to_numpy=True)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(whole))
    assert str(rows.dtype) == "int8" and str(rows_scale.dtype) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(rows_scale, np.float32),
                                  np.asarray(whole_scale, np.float32))


@pytest.mark.slow
def test_an_untied_output_embedding_is_quantized_per_vocabulary_column_and_dequantizes():
    """Llama 3 8B, Mistral and the MoE families have an untied output table [hidden, vocab]:
    Keras quantizes it with the embedding's quantizer, one scale per vocabulary column (its own
    default), which the row-block quantizer gives too, a block of columns at a time."""
    import keras
    import keras_hub

    from nnx_posttrain.model.quantize import RowBlockQuantizer

    keras.utils.set_random_seed(0)
    make = lambda: keras_hub.models.Llama3Backbone(  # noqa: E731
        vocabulary_size=300, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, tie_word_embeddings=False)
    bb = make()
    table = bb.token_embedding.reverse_embeddings
    whole, whole_scale = keras.quantizers.AbsMaxQuantizer(axis=0)(table, to_numpy=True)
    cols, cols_scale = RowBlockQuantizer(rows=64, output_of=bb.token_embedding)(table)
    np.testing.assert_array_equal(np.asarray(cols), np.asarray(whole))
    np.testing.assert_array_equal(np.asarray(cols_scale), np.asarray(whole_scale))
    before = _logits(bb)
    assert model.quantize(bb, "int8") == 8  # q, k, v, o, 3 MLP, the embedding (both tables)
    after = _logits(bb)
    assert np.abs(after - before).max() < 0.05 * np.abs(before).max()
    plain = make()
    model.dequantized_into(bb, plain)
    np.testing.assert_allclose(_logits(plain), after, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16-params"])
def test_an_int8_vocabulary_projection_a_block_of_rows_at_a_time_is_keras_own(monkeypatch, dtype):
    import importlib

    blocks = importlib.import_module("nnx_posttrain.model.quantize")
    lm = model.load("gemma_micro", dtype=dtype)
    model.quantize(lm.module, "int8")
    embedding = lm.module.token_embedding
    vocab, width = embedding._embeddings.shape
    # 7 blocks of 48 rows (4 bytes x 48 rows x width): the last one overlaps the one before it
    monkeypatch.setattr(blocks, "VOCAB_BLOCK_BYTES", 4 * 48 * width)
    assert vocab % 48 and -(-vocab // 48) > 2
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, width)), embedding.compute_dtype)
    ours, own = model.vocabulary_logits(embedding, h), embedding(h, reverse=True)
    assert ours.shape == own.shape == (2, 5, vocab) and ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), np.asarray(own, np.float32), rtol=1e-5, atol=1e-5)
    target = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, vocab)), jnp.float32)

    def grad(project):
        return jax.grad(lambda x: jnp.sum(project(x).astype(jnp.float32) * target))(h)

    ours = np.asarray(grad(lambda x: model.vocabulary_logits(embedding, x)), np.float32)
    own = np.asarray(grad(lambda x: embedding(x, reverse=True)), np.float32)
    # the blocks' input gradients summed in the compute dtype: bfloat16's rounding, not more
    tolerance = 1e-5 if dtype == "float32" else 2**-7
    assert np.abs(ours - own).max() <= tolerance * np.abs(own).max()


def test_quantize_needs_lora(tmp_path):
    assert "--quantize int8 quantizes the frozen base under LoRA: pass --lora.rank" in refusal(
        "sft", *MICRO, *FAST_STEPS, "--run-dir", tmp_path / "run", "--quantize", "int8")


@pytest.mark.slow
def test_a_quantized_run_trains_like_the_unquantized_one_resumes_and_exports(tmp_path, capsys):
    args = [*MICRO, *FAST_STEPS, "--lora.rank", "8", "--lora.targets", "all-linear",
            "--optim.learning-rate", "1e-3"]
    train_run("sft", *args, "--run-dir", tmp_path / "plain")
    train_run("sft", *args, "--quantize", "int8", "--run-dir", tmp_path / "int8")
    assert "quantized 15 layers to int8 (weights only)" in capsys.readouterr().out
    plain, quantized = losses(tmp_path / "plain"), losses(tmp_path / "int8")
    for step in (1, 2, 3):  # the documented tolerance: 1% of the loss
        assert quantized[step] == pytest.approx(plain[step], rel=1e-2)
    assert quantized != plain  # it did run on the int8 weights
    train_run("sft", *args, "--quantize", "int8", "--run-dir", tmp_path / "cut", "--steps", "2")
    train_run("sft", *args, "--quantize", "int8", "--run-dir", tmp_path / "cut", "--resume")
    assert losses(tmp_path / "cut") == quantized
    msg = refusal("sft", *args, "--run-dir", tmp_path / "cut", "--resume", "--steps", "6")
    assert "quantize" in msg  # another base under the same adapters: refused
    loaded = runs.load(tmp_path / "int8")
    assert model.quantized_layers(loaded.module)
    expected = _logits(loaded.policy())
    export.export(tmp_path / "int8", tmp_path / "out", echo=lambda _: None)
    exported = model.load(str(tmp_path / "out"))
    assert not model.quantized_layers(exported.module)
    assert np.abs(_logits(exported.module) - expected).max() < 1e-4 * max(1, np.abs(expected).max())
    train_run("dpo", *MICRO, *FAST_STEPS, "--lora.rank", "4", "--quantize", "int8",
              "--init-from", "", "--run-dir", tmp_path / "dpo")  # the LoRA-off reference
    first = losses(tmp_path / "dpo")[1]
    assert first == pytest.approx(np.log(2), abs=1e-3)  # policy = reference at the start
