"""The KerasHub adapter: NNX state of tasks, trainable filter, LoRA, chunked log-probs, loading."""

import json

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest
from flax import nnx

from nnx_posttrain import model
from nnx_posttrain.tasks import tokenizer

IDS = jnp.array([[2, 17, 30, 41, 52, 63, 74, 85, 96, 11, 12, 13, 14], [2, 9, 8, 7, 6, 5, 4, 0, 0, 0, 0, 0, 0]])
MASK = (IDS != 0).astype(jnp.int32).at[:, 0].set(1)


def test_nnx_state_of_a_kerashub_task_works_after_the_adapter(micro):
    raw = keras_hub.models.GemmaCausalLM(
        backbone=keras_hub.models.GemmaBackbone(
            vocabulary_size=64, dtype="float32", **model.TINY["gemma_micro"]
        )
    )
    with pytest.raises(TypeError, match="not supported between instances"):
        nnx.state(raw)  # the trap the adapter works around
    state = nnx.state(micro.task)
    assert model.count_params(state) == model.count_params(nnx.state(micro.module)) > 0
    assert isinstance(micro.module, nnx.Module)


def test_param_filter_selects_nothing_but_ours_selects_every_weight(micro):
    assert not jax.tree_util.tree_leaves(nnx.state(micro.module, nnx.Param))
    _, trainable, frozen = model.split(micro.module)
    assert model.count_params(trainable) == model.count_params(nnx.state(micro.module))
    assert not jax.tree_util.tree_leaves(frozen)


def _trainable_paths(module):
    return sorted(v.path for v in module.weights if v.trainable)


@pytest.mark.parametrize(
    "targets, per_layer",
    [("qv", 2), ("attention", 4), ("all-linear", 7), ("query,ffw_linear", 2)],
)
def test_lora_targets_select_the_right_layers(targets, per_layer):
    lm = model.load("gemma_micro", seed=0)
    layers = lm.module.num_layers
    adapted = model.enable_lora(lm.module, rank=4, alpha=8.0, targets=targets)
    assert len(adapted) == per_layer * layers
    paths = _trainable_paths(lm.module)
    assert len(paths) == 2 * per_layer * layers
    assert all(p.endswith(("lora_kernel_a", "lora_kernel_b")) for p in paths)
    _, trainable, frozen = model.split(lm.module)
    assert model.count_params(trainable) < model.count_params(frozen)


def test_lora_alpha_and_zero_init_keep_outputs_then_scale_updates():
    lm = model.load("gemma_micro", seed=0)
    before = model.full_logits(lm.module, IDS, MASK)
    model.enable_lora(lm.module, rank=4, alpha=16.0, targets="attention")
    after = model.full_logits(lm.module, IDS, MASK)
    np.testing.assert_allclose(before, after, atol=1e-6)  # B is zero-initialised
    query = lm.module.transformer_layers[0].attention.query_dense
    assert query.lora_alpha == 16.0 and query.lora_rank == 4


def test_lora_with_unknown_target_fails_loudly(micro):
    lm = model.load("gemma_micro", seed=0)
    with pytest.raises(ValueError, match="matched no Dense/EinsumDense"):
        model.enable_lora(lm.module, rank=2, targets="no_such_layer")


def test_split_refuses_a_module_with_nothing_trainable():
    lm = model.load("gemma_micro", seed=0)
    lm.module.trainable = False
    with pytest.raises(ValueError, match="selected no variable"):
        model.split(lm.module)


def _naive_logps(module, ids, mask):
    logits = model.full_logits(module, ids, mask)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma_micro", "gemma2_tiny"])  # gemma2: final-logit soft cap
@pytest.mark.parametrize("chunk", [1, 5, 64, None])  # None: the default, by the logits' size
def test_chunked_logprobs_equal_naive_full_logits(name, chunk):
    lm = model.load(name, seed=0)
    chunked = model.token_logprobs(lm.module, IDS, MASK, model.Projection(chunk))
    assert chunked.shape == IDS.shape and chunked.dtype == jnp.float32
    np.testing.assert_allclose(chunked, _naive_logps(lm.module, IDS, MASK), atol=1e-5)
    assert np.all(np.asarray(chunked[:, 0]) == 0)


def test_default_chunking_keeps_small_logits_and_chunks_large_ones(monkeypatch):
    """Kept (0: all at once, nothing recomputed) up to the budget of float32 logits (256 MiB on a
    CPU host, a sixteenth of an accelerator's memory), else chunks of positions whose logits fit
    the budget (a multiple of 128, at least 128); an explicit --logprob-chunk is taken as given."""
    import jax

    from nnx_posttrain.model import logprobs
    from nnx_posttrain.model.logprobs import chunk_positions

    assert logprobs.logits_budget() == 256 * 2**20  # the CPU host
    assert chunk_positions(None, 4, 256, 32_000) == 0  # the medium benchmark's SFT: 131 MB
    assert chunk_positions(None, 8, 1024, 256_000) == 128  # gemma_2b's vocabulary: 8.4 GB
    assert chunk_positions(None, 1, 262_144, 256) == 0
    assert chunk_positions(None, 1, 262_145, 256) == 262_144  # 256 MiB a chunk
    assert chunk_positions(2, 4, 256, 32_000) == 2 and chunk_positions(0, 8, 1024, 256_000) == 0

    class Chip:  # a 16 GiB accelerator
        def memory_stats(self):
            return {"bytes_limit": 16 * 2**30}

    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [Chip()])
    assert logprobs.logits_budget() == 2**30
    assert chunk_positions(None, 2, 2047, 256_000) == 512  # the ~1 B TPU benchmark: 4 chunks
    assert chunk_positions(None, 1, 1000, 256_000) == 0  # 1 GB of logits: kept
    with logprobs.assume_device_memory(32 * 2**30):  # plan, for a 32 GiB chip, on this host
        assert chunk_positions(None, 2, 2047, 256_000) == 1024
    assert logprobs.logits_budget() == 2**30


@pytest.mark.slow
def test_chunked_logprob_gradients_equal_naive(micro):
    graphdef, params, frozen = model.split(micro.module)
    weights = jnp.where(MASK > 0, 1.0, 0.0)

    def loss(p, fn):
        m = nnx.merge(graphdef, p, frozen)
        return jnp.sum(fn(m) * weights)

    g1 = jax.grad(loss)(params, lambda m: model.token_logprobs(m, IDS, MASK, model.Projection(4)))
    g2 = jax.grad(loss)(params, lambda m: _naive_logps(m, IDS, MASK))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_16_bit_logits_are_kept_for_the_backward_pass_with_the_same_gradients():
    """A bfloat16 model's chunked projection keeps its chunks' bf16 logits for the backward pass
    (the projection is not recomputed: three matmuls over the vocabulary, not four) while they
    fit the logits budget; float32 logits, or more than that, are recomputed. Either way
    the gradients are the same values."""
    from nnx_posttrain.model import logprobs

    lm = model.load("gemma_micro", seed=0, dtype="bfloat16")
    emb = lm.module.token_embedding
    assert logprobs._recomputation(emb, 2 * 2048, 32_000) is not None  # 250 MiB: kept
    assert logprobs._recomputation(emb, 2 * 2048, 256_000) is None  # 2 GB: over this host's
    with logprobs.assume_device_memory(16 * 2**30):
        assert logprobs._recomputation(emb, 2 * 2048, 256_000) is None  # and a v5e's 1 GiB
    with logprobs.assume_device_memory(32 * 2**30):
        assert logprobs._recomputation(emb, 2 * 2048, 256_000) is not None  # but a v5p's
    float32 = model.load("gemma_micro", seed=0).module.token_embedding
    assert logprobs._recomputation(float32, 2, 8) is None  # recomputed, as before
    graphdef, params, frozen = model.split(lm.module)

    def grads():
        def loss(p):
            m = nnx.merge(graphdef, p, frozen)
            return jnp.sum(model.token_logprobs(m, IDS, MASK, model.Projection(4)))
        program = str(jax.make_jaxpr(jax.grad(loss))(params)).splitlines()
        vocab = f",{emb.input_dim}]"
        projections = sum("dot_general" in line and vocab in line for line in program)
        return jax.jit(jax.grad(loss))(params), projections

    kept, kept_projections = grads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logprobs, "_recomputation", lambda *a: None)
        recomputed, recomputed_projections = grads()
    assert kept_projections == recomputed_projections - 1  # the recomputation is gone
    for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(recomputed)):
        np.testing.assert_array_equal(a, b)


def test_scored_positions_lists_the_loss_positions_in_one_bucketed_width():
    a = np.zeros((2, 16), np.float32)
    a[0, 10:13] = 1
    a[1, 0] = 1  # position 0 has no prediction: never scored
    a[1, 15] = 1
    b = np.zeros((2, 16), np.float32)
    b[0, 4:7] = 1
    pa, pb = model.scored_positions(a, b)  # 3 needed -> 16/8 = 2 is too few, 16/4 = 4
    assert pa.dtype == np.int32 and pa.shape == pb.shape == (2, 4)
    np.testing.assert_array_equal(pa, [[10, 11, 12, 16], [15, 16, 16, 16]])  # 16 = nothing
    np.testing.assert_array_equal(pb, [[4, 5, 6, 16], [16, 16, 16, 16]])
    a[0, 2:12] = 1  # 11 needed, more than half of 16: project everything
    assert model.scored_positions(a, b) is None


@pytest.mark.slow
def test_logprobs_at_scored_positions_equal_the_full_ones_with_their_gradients(micro):
    graphdef, params, frozen = model.split(micro.module)
    loss_mask = np.zeros(IDS.shape, np.float32)
    loss_mask[0, 9:12] = 1
    loss_mask[1, 3:6] = 1
    (positions,) = model.scored_positions(loss_mask)
    assert positions.shape[1] < IDS.shape[1] - 1

    def loss(p, positions):
        m = nnx.merge(graphdef, p, frozen)
        logp = model.token_logprobs(m, IDS, MASK, model.Projection(2), positions=positions)
        return jnp.sum(logp * loss_mask), logp

    (full_loss, full), g_full = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                        static_argnums=1)(params, None)
    (part_loss, part), g_part = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, positions)
    np.testing.assert_allclose(part, np.where(loss_mask > 0, full, 0.0), atol=1e-6)
    np.testing.assert_allclose(part_loss, full_loss, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_part), jax.tree_util.tree_leaves(g_full)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_entropy_matches_the_full_distribution(micro):
    _, entropy = model.token_logprobs(micro.module, IDS, MASK,
                                      model.Projection(3, entropy=True))
    logits = model.full_logits(micro.module, IDS, MASK)[:, :-1]
    p = jax.nn.softmax(logits, -1)
    expected = -jnp.sum(p * jax.nn.log_softmax(logits, -1), -1)
    np.testing.assert_allclose(entropy[:, 1:], expected, atol=1e-5)


@pytest.mark.parametrize("chunk", [3, None])
def test_correct_marks_the_tokens_the_model_ranks_first(micro, chunk):
    """SFT's mean_token_accuracy: 1 where the token is the argmax of the logits before it."""
    first = jnp.argmax(model.full_logits(micro.module, IDS, MASK), -1)
    ids = IDS.at[0, 6].set(first[0, 5]).at[0, 9].set(first[0, 8])  # two tokens the model predicts
    logits = model.full_logits(micro.module, ids, MASK)
    expected = np.asarray(jnp.argmax(logits[:, :-1], -1) == ids[:, 1:], np.float32)
    logp, correct = model.token_logprobs(micro.module, ids, MASK,
                                         model.Projection(chunk, correct=True))
    np.testing.assert_array_equal(correct[:, 1:], expected)
    assert correct[0, 6] == correct[0, 9] == 1 and float(correct.sum()) < ids.size / 2
    np.testing.assert_array_equal(logp, model.token_logprobs(micro.module, ids, MASK,
                                                                model.Projection(chunk)))


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_weights_and_logprobs():
    lm = model.load("gemma_micro", dtype="bfloat16", seed=0)
    assert all(v.dtype == "float32" for v in lm.module.weights)
    logps = model.token_logprobs(lm.module, IDS, MASK)
    assert logps.dtype == jnp.float32
    ref = model.token_logprobs(model.load("gemma_micro", seed=0).module, IDS, MASK)
    np.testing.assert_allclose(logps, ref, atol=0.1)


def test_offline_named_preset_fails_with_one_clear_message():
    with pytest.raises(model.ModelLoadError) as info:
        model.load("gemma_2b")
    message = str(info.value)
    assert "gemma_2b_en" in message and "credentials" in message and "local directory" in message


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(model.ModelLoadError, match="unknown model 'not_a_model'.*gemma_tiny"):
        model.load("not_a_model")


def test_local_kerashub_preset_round_trips(micro, tmp_path):
    micro.task.save_to_preset(str(tmp_path / "preset"))
    loaded = model.load(str(tmp_path / "preset"))
    assert loaded.chat_format == "gemma"
    np.testing.assert_allclose(
        model.full_logits(loaded.module, IDS, MASK), model.full_logits(micro.module, IDS, MASK), atol=1e-6
    )
    assert loaded.tokenizer.encode("What is 1 + 2?") == micro.tokenizer.encode("What is 1 + 2?")


def test_a_preset_whose_weights_do_not_fit_its_config_names_keras_reason(micro, tmp_path):
    """Keras collects the layers it could not load into one error whose first line names only
    how many; the message carries its example error too (the reason: here the shapes)."""
    micro.task.save_to_preset(str(tmp_path / "preset"))
    for name in ("config.json", "task.json"):  # the backbone's config, and the task's copy
        text = (tmp_path / "preset" / name).read_text()
        assert '"intermediate_dim": 64' in text
        (tmp_path / "preset" / name).write_text(text.replace('"intermediate_dim": 64',
                                                             '"intermediate_dim": 128'))
    with pytest.raises(model.ModelLoadError) as info:
        model.load(str(tmp_path / "preset"))
    message = str(info.value)
    assert "could not be loaded" in message and "shape" in message, message


def test_local_hugging_face_checkpoint_is_converted_by_kerashub(micro, tmp_path):
    hf = tmp_path / "hf"
    micro.task.export_to_transformers(str(hf))
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]  # as in every checkpoint on the Hub
    (hf / "config.json").write_text(json.dumps(cfg))
    loaded = model.load(str(hf))
    np.testing.assert_allclose(
        model.full_logits(loaded.module, IDS, MASK), model.full_logits(micro.module, IDS, MASK), atol=1e-5
    )


def test_builtin_tokenizer_is_deterministic_and_gemma_compatible():
    assert tokenizer.builtin_proto() == tokenizer.builtin_proto.__wrapped__()
    tok = model.Tokenizer(keras_hub.models.GemmaTokenizer(proto=tokenizer.builtin_proto()))
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.token_id("<start_of_turn>") is not None and tok.token_id("<end_of_turn>") is not None
    assert tok.encode("12") == [tok.token_id("1"), tok.token_id("2")]  # digits split
    text = "<start_of_turn>user\nWhat is 7 + 5?<end_of_turn>\n"
    assert tok.decode(tok.encode(text)) == text
    assert isinstance(keras.ops.convert_to_numpy(tok.keras_tokenizer.tokenize("hi")), np.ndarray)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma_micro", "gemma2_tiny"])
def test_a_packed_row_gives_the_same_per_example_logprobs_as_separate_rows(name):
    lm = model.load(name, seed=0)
    a = [2, 17, 30, 41, 52, 63, 74]
    b = [2, 9, 8, 7, 6]
    width = 16
    packed = np.zeros((1, width), np.int32)
    segments = np.zeros((1, width), np.int32)
    packed[0, : len(a)] = a
    packed[0, len(a) : len(a) + len(b)] = b
    segments[0, : len(a)] = 1
    segments[0, len(a) : len(a) + len(b)] = 2
    lp_packed = model.token_logprobs(
        lm.module, jnp.asarray(packed), jnp.asarray(segments > 0, jnp.int32), model.Projection(4),
        segment_ids=jnp.asarray(segments),
    )[0]
    separate = np.zeros((2, width), np.int32)
    separate[0, : len(a)], separate[1, : len(b)] = a, b
    lp_separate = model.token_logprobs(
        lm.module, jnp.asarray(separate), jnp.asarray(separate > 0, jnp.int32), model.Projection(4)
    )
    # position 0 of each example has no prediction; compare the predicted tokens
    np.testing.assert_allclose(lp_packed[1 : len(a)], lp_separate[0, 1 : len(a)], atol=2e-5)
    np.testing.assert_allclose(
        lp_packed[len(a) + 1 : len(a) + len(b)], lp_separate[1, 1 : len(b)], atol=2e-5
    )
    assert np.all(np.isfinite(np.asarray(lp_packed)))
    # and the override is gone afterwards: the plain forward is unchanged
    again = model.token_logprobs(lm.module, jnp.asarray(separate), jnp.asarray(separate > 0, jnp.int32))
    np.testing.assert_allclose(again, lp_separate, atol=1e-6)


def test_block_override_is_set_on_every_block_and_removed_on_exit_also_on_error(micro):
    module = micro.module
    blocks = model.decoder_blocks(module)
    calls = []

    def make(block, original):
        def wrapped(*args, **kwargs):
            calls.append(block)
            return original(*args, **kwargs)
        return wrapped

    with model.override_blocks(module, "call", make) as yielded:
        assert yielded == blocks and all("call" in vars(b) for b in blocks)
        model.full_logits(module, IDS, MASK)
    assert calls == blocks  # each block's override ran once, in order
    assert not any("call" in vars(b) for b in blocks)
    with pytest.raises(RuntimeError, match="inside"):
        with model.override_blocks(module, "call", make):
            raise RuntimeError("inside")
    assert not any("call" in vars(b) for b in blocks)


def test_a_registered_builtin_config_loads_under_its_name():
    config = dict(model.TINY["gemma_micro"], num_layers=1)
    model.register_builtin("gemma_nano_test", config, tokenizer.builtin_proto)
    try:
        lm = model.load("gemma_nano_test", seed=0)
        assert lm.module.num_layers == 1 and lm.chat_format == "gemma" and lm.name == "gemma_nano_test"
    finally:
        model.TINY.pop("gemma_nano_test")


def test_an_abstract_task_keeps_its_preprocessor_out_of_the_trace():
    """``model.eval_shape_task``: the backbone abstract, the preprocessor the one built (NNX
    neither flattened its tokenizer's vocabulary nor rebuilt it), back among the task's layers."""
    from tools import make_preset

    built = []

    def make():
        task = make_preset._task("gemma", dict(num_layers=1, num_query_heads=2,
                                               num_key_value_heads=1, hidden_dim=8,
                                               intermediate_dim=16, head_dim=4, vocabulary_size=512),
                                 512, "float32")
        model.nnx_ready(task)
        built.append(task.preprocessor)
        return task, task.backbone

    task, backbone = model.eval_shape_task(make)
    assert task.preprocessor is built[0] and built[0] in task._layers
    assert task.backbone is backbone
    assert all(isinstance(v.value, jax.ShapeDtypeStruct) for v in backbone.weights)
    assert task.preprocessor.tokenizer.vocabulary_size() == 512
