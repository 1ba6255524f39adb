"""Real-size models offline: tools.make_preset (real dimensions, random weights, full-size
tokenizers through KerasHub's own from_preset), the headline command / DPO / GRPO on a scaled
preset (tools.bench.smoke_real: the small version of what tools/bench/smoke_real.sh runs at full size), the
sampler on a padded embedding (Qwen), and bfloat16 weights without float32 copies across a step."""

import json

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest

from nnx_posttrain import model
from tools import make_preset
from tools.bench import smoke_real

TEXT = "<start_of_turn>user\nWhat's 12 + 30? Écrivez ☃.<end_of_turn>\n"


@pytest.mark.slow
def test_gemma_tokenizer_has_gemmas_size_and_layout():
    tok = model.Tokenizer(keras_hub.models.GemmaTokenizer(proto=make_preset.gemma_proto()))
    assert tok.vocab_size == 256_000
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.token_id("<start_of_turn>") == 106 and tok.token_id("<end_of_turn>") == 107
    assert tok.decode(tok.encode(TEXT)) == TEXT


@pytest.mark.parametrize("kind,size,specials", [
    ("llama3", 128_256, {"<|begin_of_text|>": 128_000, "<|eot_id|>": 128_009,
                         "<|start_header_id|>": 128_006}),
    ("qwen2.5", 151_665, {"<|endoftext|>": 151_643, "<|im_start|>": 151_644,
                          "<|im_end|>": 151_645}),
])
def test_byte_level_tokenizers_have_the_real_size_and_special_ids(kind, size, specials):
    keras_tok = (make_preset.llama3_tokenizer() if kind == "llama3"
                 else make_preset.qwen_tokenizer())
    tok = model.Tokenizer(keras_tok)
    assert tok.vocab_size == size
    for piece, i in specials.items():
        assert tok.token_id(piece) == i
    text = "<|im_start|>user\nWhat's 12 + 30? Écrivez ☃.<|im_end|>\n" if kind != "llama3" else (
        "<|start_header_id|>user<|end_header_id|>\n\nWhat's 12 + 30? Écrivez ☃.<|eot_id|>")
    assert tok.decode(tok.encode(text)) == text


def test_scaled_preset_keeps_heads_and_vocabulary():
    dims = make_preset.scaled(make_preset.LIKE["llama3.2_1b"][1], 0.05)
    assert dims["num_query_heads"] == 32 and dims["num_key_value_heads"] == 8
    assert dims["vocabulary_size"] == 128_256 and dims["hidden_dim"] % 32 == 0
    assert make_preset.scaled(make_preset.LIKE["gemma_2b"][1], 1.0) == make_preset.LIKE["gemma_2b"][1]


@pytest.mark.slow
def test_headline_command_and_grpo_on_a_scaled_gemma_2b(tmp_path, monkeypatch):
    """The README's headline command (experiments.simpo --model PRESET --data pairs.jsonl
    --lora.rank 8) on a gemma_2b-shaped preset (full 256k vocabulary, 8 query heads, 1 KV head)
    scaled down, then GRPO, each in its own process; timings, memory, checkpoints. (DPO's
    reference on LoRA is SimPO's path plus the LoRA-off forward: tests/test_preference_*.) The
    tool's matmul peak, two processes of their own that only its printed line reads, is a
    fixed figure here: the peak's measurement is tests/test_bench.py's."""
    monkeypatch.setattr(smoke_real, "matmul_peak",
                        lambda preset: {"peak_gflops": 50.0, "matmul_gflops": {}})
    results = smoke_real.main(["--like", "gemma_2b", "--scale", "0.02", "--work", str(tmp_path),
                               "--steps", "2", "--dtypes", "bfloat16-params",
                               "--methods", "simpo,grpo"])
    assert [r["method"] for r in results] == ["simpo", "grpo"]
    for r in results:
        assert r["seconds_per_step"] > 0 and r["peak_rss_bytes"] > 0 and r["load_seconds"] > 0
        assert 0 < r["checkpoint_bytes"] < 5e6  # LoRA factors only: the base is not saved
        # the run's own figures, printed before its first step: XLA's FLOPs and the peak estimate
        assert r["step_flops"] > 1e9 and 0.3 < r["estimated_peak_bytes"] / r["peak_rss_bytes"] < 2
        assert smoke_real.bound_percent(r, 50.0).endswith("%")
        config = json.loads((tmp_path / f"{r['method']}_bfloat16-params" / "config.json").read_text())
        assert config["init_from"] is None and config["batching"]["max_length"] == 64
        assert config["optim"]["learning_rate"] == (1e-6 if r["method"] != "sft" else 2e-5)
    preset = json.loads((tmp_path / "preset_gemma_2b_0.02" / "config.json").read_text())
    assert preset["config"]["vocabulary_size"] == 256_000
    assert preset["config"]["num_key_value_heads"] == 1
    grpo = [json.loads(l) for l in (tmp_path / "grpo_bfloat16-params" / "metrics.jsonl")
            .read_text().splitlines()]
    assert all("time/rollout" in r for r in grpo if r["split"] == "train")


@pytest.mark.slow
def test_sampler_never_emits_ids_past_the_tokenizer_of_a_padded_embedding(tmp_path):
    """Qwen 2.5's embedding has 151,936 rows for 151,665 tokens: the padding rows are never
    sampled (the tokenizer could not decode them), greedy or not, even when most likely."""
    from nnx_posttrain.sampling import sampler

    logits = jnp.zeros((64, 10)).at[:, 8].set(50.0).at[:, 3].set(1.0)  # id 8 >= the 8 tokens
    for temperature in (0.0, 1.0):
        tokens, logp = sampler._choose(logits, jax.random.key(0), jnp.float32(temperature),
                                       jnp.float32(1.0), 0, jnp.int32(8))
        assert int(tokens.max()) < 8
        # the log-probs stay the full softmax's (as the training forward computes them)
        full = jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1)
        np.testing.assert_allclose(logp, jnp.take_along_axis(full, tokens[:, None], 1)[:, 0])
        unmasked, _ = sampler._choose(logits, jax.random.key(0), jnp.float32(temperature),
                                      jnp.float32(1.0), 0)
        assert int(unmasked.max()) == 8
    make_preset.build("qwen2.5_0.5b", tmp_path / "qwen", scale=0.02, echo=lambda _: None)
    lm = model.load(str(tmp_path / "qwen"), dtype="float32")
    assert lm.chat_format == "qwen2.5" and lm.tokenizer.vocab_size == 151_665
    assert lm.module.token_embedding.embeddings.shape[0] == 151_936
    texts = sampler.sample_texts(lm, lm.module, ["Hi", "Hello"],
                                 sampler.Sampling(6, temperature=1.0, num_samples=2))
    assert [len(t) for t in texts] == [2, 2]


# ----------------------------------------------------------------------------- bfloat16 memory


def _step_memory(lm, lazy: bool):
    """(loss, grads, compiled temporary bytes) of an SFT loss and gradient over the LoRA factors."""
    from nnx_posttrain.algorithms import SFT

    model.set_remat(lm.module, False, lazy_frozen=lazy)
    algo = SFT(SFT.Config(), 16)
    ids = jnp.asarray(np.random.default_rng(0).integers(4, 500, (2, 32)), jnp.int32)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids),
             "loss_mask": jnp.ones_like(ids).at[:, :4].set(0)}
    graphdef, params, frozen = model.split(lm.module)

    def loss(p, f):
        return algo.loss(model.merge(graphdef, p, {"model": f, "reference": None})[0], batch)[0]

    fn = jax.jit(jax.value_and_grad(loss))
    temp = fn.lower(params, frozen).compile().memory_analysis().temp_size_in_bytes
    value, grads = fn(params, frozen)
    return float(value), grads, temp, sum(x.size for x in jax.tree.leaves(frozen))


@pytest.mark.slow
def test_bfloat16_frozen_weights_are_not_copied_to_float32_across_the_step():
    """XLA:CPU computes bfloat16 matmuls in float32; reading frozen weights lazily per block keeps
    those copies local (model.frozen), with the same loss and gradients."""
    model.register_builtin("deep_bf16_test", dict(
        num_layers=6, num_query_heads=4, num_key_value_heads=1, hidden_dim=256,
        intermediate_dim=4096, head_dim=64), lambda: make_preset.gemma_proto(512))
    lm = model.load("deep_bf16_test", dtype="bfloat16-params", seed=0)
    model.enable_lora(lm.module, 4)
    loss_a, grads_a, temp_a, frozen_size = _step_memory(lm, lazy=False)
    loss_b, grads_b, temp_b, _ = _step_memory(lm, lazy=True)
    assert loss_a == pytest.approx(loss_b, rel=1e-4)  # bfloat16: the same up to rounding order
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(a).max() + 1e-6
    f32_copy = 4 * frozen_size
    assert temp_a > 0.8 * f32_copy  # the float32 copies XLA makes, alive together
    assert temp_b < temp_a - 0.5 * f32_copy, (temp_a, temp_b, f32_copy)


@pytest.mark.slow
def test_presets_load_in_their_dtype_without_initialising(tmp_path, monkeypatch):
    """A preset's weights are read over zeros: no initializer runs (each would compile and draw a
    float32 sample of a tensor the file overwrites), and the weights are the file's."""
    import keras

    make_preset.build("gemma_2b", tmp_path / "g", scale=0.02, echo=lambda _: None)
    reference = keras_hub.models.CausalLM.from_preset(str(tmp_path / "g"), dtype="bfloat16")
    calls = []
    original = keras.initializers.RandomNormal.__call__
    monkeypatch.setattr(keras.initializers.RandomNormal, "__call__",
                        lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    lm = model.load(str(tmp_path / "g"), dtype="bfloat16-params")
    assert calls == []
    assert {str(v.dtype) for v in lm.module.weights} == {"bfloat16"}
    for a, b in zip(lm.module.weights, reference.backbone.weights):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


@pytest.mark.slow
def test_a_preset_quantized_while_loading_equals_one_quantized_after(tmp_path):
    """--quantize int8 on a KerasHub preset quantizes each layer as its weights are read (the
    bfloat16 model is never whole in memory): the same int8 values and scales as loading the
    model and quantizing it after."""
    make_preset.build("gemma_2b", tmp_path / "g", scale=0.02, echo=lambda _: None)
    after = model.load(str(tmp_path / "g"), dtype="bfloat16-params")
    model.quantize(after.module, "int8")
    loading = model.load(str(tmp_path / "g"), dtype="bfloat16-params", quantize="int8")
    assert len(model.quantized_layers(loading.module)) == len(model.quantized_layers(after.module))
    assert model.quantize(loading.module, "int8") == len(model.quantized_layers(after.module))
    pairs = list(zip(loading.module.weights, after.module.weights, strict=True))
    assert {str(a.dtype) for a, _ in pairs} >= {"int8"}
    for a, b in pairs:
        assert a.path == b.path and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


def test_weights_are_read_over_zeros_the_process_has_not_touched():
    """The placeholders a preset's weights are read over: zeros in fresh pages, taken by JAX
    without a copy (a copy would make the whole model resident before its first weight)."""
    from nnx_posttrain.model import lean_load

    zeros = lean_load.untouched_zeros((1024, 300), np.dtype("float32"))
    assert not zeros.any() and zeros.shape == (1024, 300)
    assert jax.device_put(zeros).unsafe_buffer_pointer() == zeros.ctypes.data


def test_a_preset_quantized_as_it_loads_is_made_on_the_host_where_the_default_is_a_chip(
        monkeypatch):
    """On a chip the variables a preset's weights are read over would hold the whole model in
    its stored dtype before the first layer is quantized (a Gemma 4 E4B-shaped preset's 14.9 GB
    of bfloat16 on a 15.7 GiB v5e: its embeddings failed to load there): quantizing as it loads,
    the model is made on the host's CPU; unquantized, or on a CPU host, where JAX puts it. In a
    run the load is under the run's mesh, which places new arrays on its devices whatever JAX's
    default device (the E4B load on the chip after the default device alone was set): the
    loading device's own mesh is in context while the model is made."""
    from jax.sharding import Mesh
    from nnx_posttrain.model import lean_load

    assert lean_load.loading_device("int8") is None  # this host: the CPU is the default
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert lean_load.loading_device("none") is None
    device = lean_load.loading_device("int8")
    assert device.platform == "cpu"
    run_mesh = Mesh(np.array(jax.devices()), ("data",))
    with jax.set_mesh(run_mesh), lean_load.made_on(device), lean_load.no_initializers():
        assert jax.sharding.get_abstract_mesh().axis_names == ("host",)
        variable = keras.Variable(keras.initializers.RandomNormal(), shape=(512, 1024))
    value = variable.value
    assert value.devices() == {device} and not np.asarray(value).any()
    with lean_load.made_on(None):
        assert jax.sharding.get_abstract_mesh().empty


def test_make_presets_largest_tensors_are_drawn_a_block_at_a_time_from_the_whole_shape(monkeypatch):
    """tools.block_init (make_preset's E4B per-layer embedding asked for a 45 GB buffer drawn
    whole): past BLOCK_BYTES a tensor is drawn a block of rows at a time, with the spread its
    initializer gives the whole shape (not a block's fans), the blocks independent."""
    from tools import block_init

    monkeypatch.setattr(block_init, "BLOCK_BYTES", 1 << 16)
    monkeypatch.setattr(block_init, "ROWS_BYTES", 1 << 12)  # 64 rows of 32 bfloat16 a block
    drawn, draw = [], block_init.draw
    monkeypatch.setattr(block_init, "draw", lambda kind, shape, *a: drawn.append(shape) or draw(
        kind, shape, *a))
    fan_in = keras.initializers.VarianceScaling(1.0, "fan_in", "untruncated_normal")
    with block_init.by_blocks(seed=0):
        big = keras.layers.Embedding(8192, 32, embeddings_initializer=fan_in, dtype="bfloat16")
        big.build()
        cut = keras.layers.Dense(16, kernel_initializer=keras.initializers.TruncatedNormal(
            stddev=0.5), dtype="float32")
        cut.build((None, 2048))
        small = keras.layers.Dense(8, kernel_initializer="ones")
        small.build((None, 8))
    assert drawn == [(8192, 32), (2048, 16)]  # the two past BLOCK_BYTES, not the small one
    w = np.asarray(big.embeddings.value, np.float32)
    assert abs(w.std() * np.sqrt(8192) - 1) < 0.02  # the whole shape's fan in: 8192 rows
    assert np.unique(w[:64]).size > 500 and not np.array_equal(w[:64], w[64:128])
    k = np.asarray(cut.kernel.value)
    assert np.abs(k).max() <= 1.0 and abs(k.std() / (0.5 * 0.8796) - 1) < 0.03  # cut at 2 std
    np.testing.assert_array_equal(np.asarray(small.kernel.value), np.ones((8, 8)))
    assert keras.backend.standardize_dtype(big.embeddings.dtype) == "bfloat16"
