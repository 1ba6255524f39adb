"""SmolLM3's Hugging Face export (transformers' ``SmolLM3ForCausalLM``), on the micro SmolLM3
preset (the family's tiny configuration, its layer 1 a NoPE layer, with a synthetic SmolLM3
tokenizer of 1,024 tokens: tests/test_newer_families.py's) loaded as a run loads it: the export's
logits equal transformers' on the same weights; a mis-mapped tensor or a wrong NoPE layer list
moves them far past that tolerance; its tokenizer files give our ids; LoRA merged, and the
adapters alone in PEFT's layout, give the LoRA model's logits. The generic round trip and the
read-back through KerasHub's converter are tests/test_hf_export.py's (``smollm3``)."""

import json

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import keras_hub
import numpy as np
import pytest

from nnx_posttrain import families, inspection, model
from nnx_posttrain.export import hf as hf_export

from test_hf_export import (IDS, MASK, exported_micro, hf_logits, loaded_randomized,
                              micro_preset, randomized, with_adapters)

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.numpy")
TOLERANCE = 1e-4  # the round trip's (tests/test_hf_export.py)
TOKENS = 1024
TINY = families.FAMILIES["smollm3"].tiny["smollm3"]


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_preset(tmp_path_factory, "smollm3", TOKENS)


@pytest.fixture(scope="module")
def exported(micro, tmp_path_factory):
    """(the model, our logits, its export with the chat template, transformers' logits)."""
    return exported_micro(micro, tmp_path_factory)


@pytest.mark.slow
def test_the_micro_presets_export_gives_transformers_logits(exported):
    lm, ours, directory, theirs = exported
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["SmolLM3ForCausalLM"] and config["model_type"] == "smollm3"
    assert config["no_rope_layers"] == [1, 0] and config["no_rope_layer_interval"] == 2
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == TINY["rope_theta"]
    assert config["tie_word_embeddings"] and config["vocab_size"] == TOKENS
    keys = set(safetensors.load_file(directory / "model.safetensors"))
    assert "lm_head.weight" not in keys and not any("inv_freq" in k for k in keys)
    assert np.abs(ours).max() > 1.0  # a scale at which a wrong mapping shows
    np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)


def _heads_reversed(t, head_dim=TINY["hidden_dim"] // TINY["num_attention_heads"]):
    """A q / k / v projection's rows [heads x head_dim, in] with its heads in reverse order."""
    return t.reshape(-1, head_dim, t.shape[1])[::-1].reshape(t.shape)


def _halves_swapped(t, head_dim=TINY["hidden_dim"] // TINY["num_attention_heads"]):
    """Each head's rows with their two halves swapped (the other rotary convention)."""
    heads = t.reshape(-1, 2, head_dim // 2, t.shape[1])[:, ::-1]
    return np.ascontiguousarray(heads).reshape(t.shape)


def _o_proj_heads_minor(t, heads=TINY["num_attention_heads"]):
    """o_proj's columns read as [head_dim, heads] rather than [heads, head_dim]."""
    hidden, inner = t.shape
    return t.reshape(hidden, inner // heads, heads).transpose(0, 2, 1).reshape(hidden, inner)


MISMAPPED = [
    ("model.layers.0.self_attn.q_proj.weight", _halves_swapped),  # the rotating layer
    ("model.layers.1.self_attn.k_proj.weight", _heads_reversed),  # the NoPE layer
    ("model.layers.1.self_attn.o_proj.weight", _o_proj_heads_minor),
    ("model.layers.0.mlp.gate_proj.weight", lambda t: t[::-1]),
    ("model.layers.1.input_layernorm.weight", lambda t: t[::-1]),
]


def _copy(directory, target, tensors=None, config=None):
    """A copy of the export at ``target`` (weights and config only), with ``tensors`` /
    ``config`` instead of its own."""
    target.mkdir()
    if tensors is None:
        (target / "model.safetensors").symlink_to(directory / "model.safetensors")
    else:
        safetensors.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = config or json.loads((directory / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.slow
def test_a_mis_mapped_tensor_fails_the_round_trip(exported, tmp_path):
    _, ours, directory, _ = exported
    for i, (name, change) in enumerate(MISMAPPED):
        tensors = safetensors.load_file(directory / "model.safetensors")
        assert change(tensors[name]).shape == tensors[name].shape
        tensors[name] = np.ascontiguousarray(change(tensors[name]))
        wrong, _ = hf_logits(_copy(directory, tmp_path / str(i), tensors=tensors))
        assert np.abs(wrong - ours).max() > 100 * TOLERANCE, name


@pytest.mark.slow
def test_a_wrong_nope_layer_list_fails_the_round_trip(exported, tmp_path):
    """The NoPE layers are what the config says: every layer rotating, the wrong one NoPE, or
    the list left out (transformers' interval 4 then rotates both layers) moves the logits."""
    _, ours, directory, _ = exported
    config = json.loads((directory / "config.json").read_text())
    without = {k: v for k, v in config.items() if k not in ("no_rope_layers",
                                                            "no_rope_layer_interval")}
    for i, changed in enumerate([dict(config, no_rope_layers=[1, 1]),
                                 dict(config, no_rope_layers=[0, 1]), without]):
        wrong, _ = hf_logits(_copy(directory, tmp_path / str(i), config=changed))
        assert np.abs(wrong - ours).max() > 100 * TOLERANCE, changed.get("no_rope_layers")


@pytest.mark.slow
def test_every_fourth_layer_nope_with_mlp_biases(tmp_path):
    """SmolLM3-3B's pattern (every 4th layer NoPE: ``no_rope_layer_interval`` 4) and rotary
    base, with the MLP biases transformers' ``mlp_bias`` adds."""
    dims = dict(TINY, num_layers=4, rope_layer_enabled_list=[True, True, True, False],
                layer_types=["attention"] * 4, mlp_bias=True, rope_theta=5_000_000.0,
                vocabulary_size=512)
    backbone = randomized(families.prepare(keras_hub.models.SmolLM3Backbone(**dims)))
    ours = np.asarray(model.full_logits(backbone, IDS, MASK))
    task = type("Task", (), {"backbone": backbone, "preprocessor": None})()
    hf_export.export_model(task, tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["no_rope_layers"] == [1, 1, 1, 0] and config["no_rope_layer_interval"] == 4
    assert config["mlp_bias"] and "pad_token_id" not in {k for k, v in config.items() if v}
    theirs, hf = hf_logits(tmp_path)
    assert hf.model.layers[0].mlp.up_proj.bias is not None
    np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)


def test_rotary_frequencies_other_than_rope_thetas_are_refused(tmp_path):
    """transformers computes the frequencies from ``rope_theta`` (it reads none): a backbone
    whose frequencies are not those (changed by 0.1%) is refused by name, nothing written."""
    backbone = families.prepare(keras_hub.models.SmolLM3Backbone(**TINY))
    rotary = backbone.transformer_layers[0].self_attn.rotary_embedding
    rotary.inv_freq.assign(np.asarray(rotary.inv_freq.value) * 1.001)
    task = type("Task", (), {"backbone": backbone, "preprocessor": None})()
    with pytest.raises(hf_export.ExportError, match="rotary frequencies other than rope_theta"):
        hf_export.export_model(task, tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()


def test_tokenizer_files_give_our_ids(exported):
    """transformers' tokenizer of the export (``PreTrainedTokenizerFast``) reads a ChatML
    conversation as our tokenizer does, its turn tokens whole, and ends where the config does."""
    lm, _, directory, _ = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
    ours = lm.tokenizer.encode(text)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours
    assert hf_tok.convert_tokens_to_ids("<|im_start|>") in ours
    config = json.loads((directory / "config.json").read_text())
    assert hf_tok.eos_token_id == config["eos_token_id"]
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())


def _with_random_lora(lm, targets="all-linear"):
    adapted = model.enable_lora(lm.module, 2, alpha=4.0, targets=targets)
    rng = np.random.default_rng(1)
    for v in lm.module.weights:
        if "lora_kernel" in v.path:
            v.assign(rng.normal(0.0, 0.3, v.shape).astype("float32"))
    return adapted


@pytest.mark.slow
def test_a_merged_lora_exports_with_its_logits(micro, tmp_path):
    """LoRA on every linear layer (the output projections' too, whose paths the family
    repairs), merged as ``nnx-posttrain export`` merges it: transformers' logits are ours."""
    lm = loaded_randomized(micro)
    base = np.asarray(model.full_logits(lm.module, IDS, MASK))
    assert len(_with_random_lora(lm)) == 2 * 7
    ours = np.asarray(model.full_logits(lm.module, IDS, MASK))
    assert np.abs(ours - base).max() > 1e-2  # the adapters change the model
    assert len(inspection.merge_lora(lm.module)) == 2 * 7
    hf_export.export_model(lm.task, tmp_path, "float32")
    theirs, _ = hf_logits(tmp_path)
    np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
def test_adapters_in_peft_layout_give_the_lora_models_logits(micro, tmp_path):
    lm = loaded_randomized(micro)
    hf_export.export_model(lm.task, tmp_path / "base", "float32")
    adapted = _with_random_lora(lm)
    ours = np.asarray(model.full_logits(lm.module, IDS, MASK))
    hf_export.export_adapters(lm.module, tmp_path / "adapter", "float32", base_model="base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"]
    assert config["rank_pattern"] == {}  # Dense q / k / v: one factor pair, as PEFT's
    tensors = safetensors.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(tensors) == 2 * len(adapted)
    _, hf = hf_logits(tmp_path / "base")
    np.testing.assert_allclose(with_adapters(hf, tensors, config), ours, atol=TOLERANCE, rtol=0)


# ----------------------------------------------------------------------------- from a run

# two steps on 8 records of the built-in task in a file (no eval data: no evaluation), with the
# built-in recipe's remat and accumulation
STEPS = ["--steps", "2", "--log-every", "1", "--eval.every", "0", "--checkpoint.every", "2",
         "--batching.batch-size", "2", "--batching.max-length", "48", "--eval.exact-match", "0",
         "--remat", "none", "--batching.grad-accum", "1", "--optim.learning-rate", "1e-2"]
LORA = ["--lora.rank", "2", "--lora.targets", "all-linear"]


@pytest.fixture(scope="module")
def sft_runs(micro, tmp_path_factory):
    """{"full": a full fine-tuning SFT run of the micro preset, "lora": one with LoRA on every
    linear layer}: two steps each, checkpointed."""
    from support import builtin_file, train_run

    data = builtin_file(tmp_path_factory.mktemp("data") / "sft.jsonl")
    runs = {}
    for name, extra in (("full", ["--lora.rank", "0"]), ("lora", LORA)):
        runs[name] = tmp_path_factory.mktemp(f"smollm3_{name}")
        train_run("sft", "--model", micro, "--data", data, *STEPS, *extra, "--run-dir",
                  runs[name], echo=lambda _: None)
    return runs


@pytest.mark.slow
def test_init_from_a_run_copies_each_layers_own_weights(micro, sft_runs):
    """``--init-from`` matches variables by path: each layer's output projection and rotary
    frequencies (the paths the family repairs) come from its own layer of the checkpoint."""
    from nnx_posttrain import runs

    trained = {v.path: np.asarray(v.value) for v in runs.load(sft_runs["full"]).module.weights}
    fresh = model.load(str(micro)).module
    o_proj = "transformer_layer_{}/self_attn/o_proj/kernel"
    before = {v.path: np.asarray(v.value) for v in fresh.weights}
    assert not np.array_equal(before[o_proj.format(1)], trained[o_proj.format(1)])  # it trained
    runs.init_weights(fresh, sft_runs["full"])
    copied = {v.path: np.asarray(v.value) for v in fresh.weights}
    assert copied.keys() == trained.keys() and len(copied) == len(fresh.weights)
    for path, value in copied.items():
        np.testing.assert_array_equal(value, trained[path], err_msg=path)
    assert not np.array_equal(copied[o_proj.format(0)], copied[o_proj.format(1)])


@pytest.mark.slow
def test_runs_export_as_nnx_posttrain_export_writes_them(micro, sft_runs, tmp_path):
    """``nnx-posttrain export --format hf`` of the full run and of the LoRA run (merged), and
    ``--adapters-only`` on the micro preset's own export: transformers' logits are the runs'."""
    from nnx_posttrain import export, runs

    for name in ("full", "lora"):
        ours = np.asarray(model.full_logits(runs.load(sft_runs[name]).module, IDS, MASK))
        export.export(sft_runs[name], tmp_path / name, target=export.Target("hf"),
                      echo=lambda _: None)
        theirs, _ = hf_logits(tmp_path / name)
        np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0, err_msg=name)
    hf_export.export_model(model.load(str(micro)).task, tmp_path / "base", "float32")
    export.export(sft_runs["lora"], tmp_path / "adapters",
                  target=export.Target("hf", adapters_only=True), echo=lambda _: None)
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    tensors = safetensors.load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    _, hf = hf_logits(tmp_path / "base")
    np.testing.assert_allclose(with_adapters(hf, tensors, config), ours, atol=TOLERANCE, rtol=0)
