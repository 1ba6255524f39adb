"""Hugging Face export (nnx_posttrain.export.hf) verified by a logits round trip against transformers.

Tiny random backbones of every exported family and configuration (multi-KV-head, soft caps,
sliding windows, post norms, tied and untied embeddings, biases, q/k norms, scaled rotary
frequencies) are exported, loaded with ``transformers.AutoModelForCausalLM`` and must give the
same logits to 1e-4; unverified ones are refused by name. LoRA adapters exported in PEFT's
format, applied to the exported base model, give the LoRA model's logits.
"""

import json

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import keras
import keras_hub
import numpy as np
import pytest

from nnx_posttrain import families, model
from nnx_posttrain.export import hf as hf_export
from tools import make_preset

import support

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 512
M = keras_hub.models
IDS = (np.arange(1, 49, dtype=np.int32)[None, :] * 7) % V  # 48 positions: past every window
MASK = np.ones_like(IDS)

BACKBONES = {
    "gemma_1kv": lambda: M.GemmaBackbone(vocabulary_size=V, num_layers=2, num_query_heads=4,
                                         num_key_value_heads=1, hidden_dim=32, intermediate_dim=64,
                                         head_dim=8),
    "gemma_2kv": lambda: M.GemmaBackbone(vocabulary_size=V, num_layers=2, num_query_heads=4,
                                         num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                         head_dim=8),
    "gemma2": lambda: M.GemmaBackbone(
        vocabulary_size=V, num_layers=3, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64, head_dim=8, query_head_dim_normalize=False, use_post_ffw_norm=True,
        use_post_attention_norm=True, attention_logit_soft_cap=5.0, final_logit_soft_cap=3.0,
        use_sliding_window_attention=True, sliding_window_size=8),
    "gemma3": lambda: M.Gemma3Backbone(
        vocabulary_size=V, image_size=None, vision_encoder=None, num_layers=7, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8,
        use_post_ffw_norm=True, use_post_attention_norm=True, use_sliding_window_attention=True,
        sliding_window_size=8),
    "llama3": lambda: M.Llama3Backbone(vocabulary_size=V, num_layers=2, num_query_heads=4,
                                       num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                       rope_max_wavelength=500_000),
    "llama3.1_tied": lambda: M.Llama3Backbone(
        vocabulary_size=V, num_layers=2, num_query_heads=4, num_key_value_heads=1, hidden_dim=32,
        intermediate_dim=64, rope_max_wavelength=500_000, rope_frequency_adjustment_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_pretraining_sequence_length=16,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True),
    "mistral": lambda: M.MistralBackbone(vocabulary_size=V, num_layers=2, num_query_heads=4,
                                         num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                         sliding_window=8),
    "qwen2.5": lambda: M.QwenBackbone(vocabulary_size=V, num_layers=2, num_query_heads=4,
                                      num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                                      rope_max_wavelength=1_000_000, tie_word_embeddings=True),
    "qwen3": lambda: M.Qwen3Backbone(vocabulary_size=V, num_layers=2, num_query_heads=4,
                                     num_key_value_heads=2, hidden_dim=32, head_dim=16,
                                     intermediate_dim=64, tie_word_embeddings=False),
}
# the newer families: their tests' tiny configurations (``families``), with this vocabulary
NEWER = {"gemma4": "gemma4", "gemma4_kv": "gemma4", "gemma4_moe": "gemma4", "qwen3_moe": "qwen3_moe",
         "mixtral": "mixtral", "smollm3": "smollm3"}  # SmolLM3's: layer 1 NoPE
BACKBONES.update({variant: (lambda f=family, v=variant: getattr(M, families.FAMILIES[f].backbone)(
    **dict(families.FAMILIES[f].tiny[v], vocabulary_size=V))) for variant, family in NEWER.items()})
# Qwen 3.5's text tower exports as transformers' Qwen3_5ForCausalLM (``qwen3_5_text``), which
# KerasHub's converter does not read (it takes ``qwen3_5``, the vision-language config)
BACKBONES["qwen3_5"] = lambda: M.Qwen3_5Backbone(**dict(families.FAMILIES["qwen3_5"].tiny["qwen3_5"],
                                                       vocabulary_size=V))
# Qwen 3.5 MoE's likewise, as Qwen3_5MoeForCausalLM (``qwen3_5_moe_text``; one tensor per expert)
BACKBONES["qwen3_5_moe"] = lambda: M.Qwen3_5MoeBackbone(
    **dict(families.FAMILIES["qwen3_5_moe"].tiny["qwen3_5_moe"], vocabulary_size=V))
# GPT-OSS as transformers' GptOssForCausalLM (KerasHub's converter reads only the published MXFP4
# experts): its tiny configuration (window 4 on the odd layers, past which the 48 positions go),
# and with YaRN (factor 4, as 20b's 32: frequencies and the attention scale change)
BACKBONES["gpt_oss"] = lambda: M.GptOssBackbone(**dict(families.FAMILIES["gpt_oss"].tiny["gpt_oss"],
                                                      vocabulary_size=V))
BACKBONES["gpt_oss_yarn"] = lambda: M.GptOssBackbone(**dict(
    families.FAMILIES["gpt_oss"].tiny["gpt_oss"], vocabulary_size=V, rope_scaling_factor=4.0,
    rope_max_wavelength=500))
# Phi-3 as transformers' Phi3ForCausalLM (fused qkv_proj / gate_up_proj; no sliding window), which
# KerasHub's converters do not read: tests/test_hf_export_phi3.py has the rest
BACKBONES["phi3"] = lambda: M.Phi3Backbone(**dict(families.FAMILIES["phi3"].tiny["phi3"],
                                                  vocabulary_size=V))
MODEL_TYPE = {"phi3": "phi3", "gpt_oss": "gpt_oss", "gpt_oss_yarn": "gpt_oss", "gemma4_moe": "gemma4_text",
              "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma_1kv": "gemma", "gemma_2kv": "gemma", "gemma2": "gemma2",
              "gemma3": "gemma3_text", "llama3": "llama", "llama3.1_tied": "llama",
              "mistral": "mistral", "qwen2.5": "qwen2", "qwen3": "qwen3",
              "gemma4": "gemma4_text", "gemma4_kv": "gemma4_text", "qwen3_moe": "qwen3_moe",
              "mixtral": "mixtral", "smollm3": "smollm3"}


def randomized(backbone, seed=0):
    """Weights of a visible scale (norm scales and biases too), so every mapping matters; not
    those transformers derives from the config (SmolLM3's rotary frequencies)."""
    rng = np.random.default_rng(seed)
    fam = families.of(backbone)
    derived = {id(v) for v in hf_export.derived_variables(backbone)} if fam and fam.export else ()
    for v in backbone.weights:
        std = 0.3 if len(v.shape) > 1 else 0.2
        if id(v) not in derived:
            v.assign(rng.normal(0.0, std, v.shape).astype("float32"))
    return backbone


def task_of(backbone):
    """A CausalLM around the backbone, with a tokenizer of its family (for the tokenizer files)."""
    name = type(backbone).__name__
    if name == "GemmaBackbone":
        tok = M.GemmaTokenizer(proto=make_preset.gemma_proto(V))
        return M.GemmaCausalLM(backbone, M.GemmaCausalLMPreprocessor(tok))
    if name == "Llama3Backbone":
        tok = make_preset.llama3_tokenizer(V + 512)  # tokenizer ids stay below the embedding's
        return M.Llama3CausalLM(backbone, M.Llama3CausalLMPreprocessor(tok))
    if name == "QwenBackbone":
        return M.QwenCausalLM(backbone, M.QwenCausalLMPreprocessor(make_preset.qwen_tokenizer(V)))
    return type("Task", (), {"backbone": backbone, "preprocessor": None})()


def micro_preset(tmp_path_factory, family: str, tokens: int = 1024):
    """The directory of ``family``'s micro preset (its ``tiny`` config with ``tokens`` ids,
    random weights of seed 0)."""
    out = tmp_path_factory.mktemp(f"{family}_micro")
    keras.utils.set_random_seed(0)
    dims = dict(families.FAMILIES[family].tiny[family], vocabulary_size=tokens)
    make_preset._task(family, dims, tokens, "float32").save_to_preset(str(out))
    return out


def loaded_randomized(path):
    """The preset at ``path`` as a run loads it (``model.load``: the family's repair), its
    weights randomized."""
    lm = model.load(str(path))
    randomized(lm.module)
    return lm


def exported_micro(path, tmp_path_factory):
    """(the model at ``path``, randomized; our logits; its export with the chat template;
    transformers' logits)."""
    lm = loaded_randomized(path)
    ours = np.asarray(model.full_logits(lm.module, IDS, MASK))
    directory = tmp_path_factory.mktemp(f"{path.name}_export")
    hf_export.export_model(lm.task, directory, "float32", lm.chat_format)
    theirs, _ = hf_logits(directory)
    return lm, ours, directory, theirs


def hf_logits(directory, dtype=torch.float32):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=dtype, output_loading_info=True)
    # every tensor of the model read from the export, none left over or reinitialised
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return hf(torch.tensor(IDS, dtype=torch.long)).logits.float().numpy(), hf


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_export_round_trips_through_transformers(name, tmp_path):
    backbone = randomized(BACKBONES[name]())
    ours = np.asarray(model.full_logits(backbone, IDS, MASK))
    hf_export.export_model(task_of(backbone), tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE[name]
    assert config["num_key_value_heads"] == backbone.num_key_value_heads
    theirs, _ = hf_logits(tmp_path)
    assert np.abs(ours).max() > 1.0  # a scale at which a wrong mapping shows
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NEWER))
def test_an_export_of_a_newer_family_loads_back_through_kerashubs_converter(name, tmp_path):
    """What transformers reads, KerasHub's converter reads too (``--model HF_DIR``): the
    published config keys, not only what transformers 5.24 writes (research P10)."""
    backbone = randomized(BACKBONES[name]())
    hf_export.export_model(task_of(backbone), tmp_path, "float32")
    reloaded = keras_hub.models.Backbone.from_preset(str(tmp_path), dtype="float32")
    assert type(reloaded) is type(backbone)
    pair = (reloaded, backbone)
    if name == "smollm3":  # KerasHub's rotary embedding assigns to itself: refused inside jit
        theirs, ours = (model.full_logits(m, IDS, MASK) for m in pair)
    else:  # both forwards as one jitted program (op by op, each operation compiles on its own)
        theirs, ours = support.jitted(
            lambda pair, ids, mask: [model.full_logits(m, ids, mask) for m in pair], pair)(IDS, MASK)
    np.testing.assert_allclose(theirs, ours, atol=1e-5)


def test_gemma2_export_is_gemma2_with_every_feature(tmp_path):
    backbone = randomized(BACKBONES["gemma2"]())
    hf_export.export_model(task_of(backbone), tmp_path, "float32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gemma2" and config["num_key_value_heads"] == 2
    assert config["attn_logit_softcapping"] == 5.0 and config["final_logit_softcapping"] == 3.0
    assert config["sliding_window"] == 8 and config["query_pre_attn_scalar"] == 32 // 4
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "np") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (2 * 8, 32)
    for norm in ("post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert f"model.layers.1.{norm}.weight" in keys
    # and KerasHub reads it back (its Hugging Face converter): the same logits
    reloaded = keras_hub.models.CausalLM.from_preset(str(tmp_path), dtype="float32")
    np.testing.assert_allclose(model.full_logits(reloaded.backbone, IDS, MASK),
                               model.full_logits(backbone, IDS, MASK), atol=1e-4)


@pytest.mark.slow
def test_bfloat16_export_is_half_the_size_and_loads(tmp_path):
    backbone = randomized(BACKBONES["llama3"]())
    task = task_of(backbone)
    hf_export.export_model(task, tmp_path / "f32", "float32")
    hf_export.export_model(task, tmp_path / "bf16", "bfloat16")
    from safetensors import safe_open

    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    f32 = (tmp_path / "f32" / "model.safetensors").stat().st_size
    bf16 = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    assert abs(bf16 / f32 - 0.5) < 0.01
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    theirs, _ = hf_logits(tmp_path / "bf16", torch.bfloat16)
    np.testing.assert_allclose(theirs, model.full_logits(backbone, IDS, MASK), atol=0.15)


def test_tokenizer_files_load_in_transformers_with_the_same_ids(tmp_path):
    backbone = randomized(BACKBONES["gemma_2kv"]())
    task = task_of(backbone)
    hf_export.export_model(task, tmp_path, "float32")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = model.Tokenizer(task.preprocessor.tokenizer)
    text = "<start_of_turn>user\nWhat is 12 + 30?<end_of_turn>\n"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


@pytest.mark.slow
def test_unverified_families_and_configurations_are_refused_by_name(tmp_path):
    llama2 = M.LlamaBackbone(vocabulary_size=V, num_layers=1, num_query_heads=2,
                             num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    with pytest.raises(hf_export.ExportError, match="LlamaBackbone has no verified"):
        hf_export.export_model(task_of(llama2), tmp_path / "a", "float32")
    half_gemma2 = M.GemmaBackbone(vocabulary_size=V, num_layers=1, num_query_heads=2,
                                  num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                                  head_dim=8, final_logit_soft_cap=30.0)
    with pytest.raises(hf_export.ExportError, match="final_logit_soft_cap"):
        hf_export.export_model(task_of(half_gemma2), tmp_path / "b", "float32")
    window = M.Qwen3Backbone(vocabulary_size=V, num_layers=1, num_query_heads=2,
                             num_key_value_heads=1, hidden_dim=16, head_dim=8, intermediate_dim=32,
                             sliding_window_size=8)
    with pytest.raises(hf_export.ExportError, match="sliding_window_size=8"):
        hf_export.export_model(task_of(window), tmp_path / "w", "float32")
    smollm3 = M.SmolLM3Backbone(**dict(families.FAMILIES["smollm3"].tiny["smollm3"],
                                       attention_bias=True))  # transformers' o_proj has a bias
    with pytest.raises(hf_export.ExportError, match="attention_bias=True"):
        hf_export.export_model(task_of(smollm3), tmp_path / "s", "float32")
    lora = BACKBONES["gemma_1kv"]()
    model.enable_lora(lora, 2)
    with pytest.raises(hf_export.ExportError, match="lora_kernel"):
        hf_export.export_model(task_of(lora), tmp_path / "c", "float32")


# ----------------------------------------------------------------------------- PEFT adapters


@pytest.mark.parametrize("name,targets", [("gemma_2kv", "all-linear"), ("llama3", "attention")])
def test_adapters_in_peft_layout_give_the_lora_models_logits(name, targets, tmp_path):
    backbone = randomized(BACKBONES[name]())
    hf_export.export_model(task_of(backbone), tmp_path / "base", "float32")
    adapted = model.enable_lora(backbone, 2, alpha=4.0, targets=targets)
    rng = np.random.default_rng(1)
    for v in backbone.weights:
        if "lora_kernel" in v.path:
            v.assign(rng.normal(0.0, 0.3, v.shape).astype("float32"))
    ours = np.asarray(model.full_logits(backbone, IDS, MASK))
    hf_export.export_adapters(backbone, tmp_path / "adapter", "float32", base_model="base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4.0
    from safetensors.numpy import load_file

    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(tensors) == 2 * len(adapted)
    base_logits, hf = hf_logits(tmp_path / "base")
    assert np.abs(base_logits - ours).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(with_adapters(hf, tensors, config), ours, atol=1e-4)


def with_adapters(hf, tensors, config):
    """transformers' logits of ``hf`` with PEFT adapters added into its weights. PEFT's layout:
    base_model.model.<module>.lora_A.weight [r, in], lora_B.weight [out, r], scaled by
    lora_alpha / r (rank_pattern / alpha_pattern where a module's rank differs)."""
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace("lora_A", "lora_B")]
            linear, short = modules[path], path.split(".")[-1]
            r = config["rank_pattern"].get(short, config["r"])
            alpha = config["alpha_pattern"].get(short, config["lora_alpha"])
            assert a.shape == (r, linear.in_features) and b.shape == (linear.out_features, r)
            linear.weight += torch.tensor(alpha / r * (b @ a))
        return hf(torch.tensor(IDS, dtype=torch.long)).logits.numpy()


def test_adapters_load_with_peft(tmp_path):
    peft = pytest.importorskip("peft")
    backbone = randomized(BACKBONES["gemma_2kv"]())
    hf_export.export_model(task_of(backbone), tmp_path / "base", "float32")
    model.enable_lora(backbone, 2, alpha=4.0, targets="all-linear")
    rng = np.random.default_rng(1)
    for v in backbone.weights:
        if "lora_kernel" in v.path:
            v.assign(rng.normal(0.0, 0.3, v.shape).astype("float32"))
    hf_export.export_adapters(backbone, tmp_path / "adapter", "float32", base_model="base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                             dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = peft_model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, model.full_logits(backbone, IDS, MASK), atol=1e-4)


def test_lora_factors_are_exact_block_diagonal_adapters():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 5, 2)), rng.normal(size=(2, 4))  # query: heads 3, in 5, head 4
    lora_a, lora_b, rank = hf_export.lora_factors(a, b, ((0, 2), (1,)))
    assert rank == 6 and lora_a.shape == (6, 5) and lora_b.shape == (12, 6)
    delta = np.einsum("ndr,rh->ndh", a, b)
    np.testing.assert_allclose(lora_b @ lora_a, hf_export.to_matrix(delta, ((0, 2), (1,))))
    a, b = rng.normal(size=(3, 4, 2)), rng.normal(size=(2, 5))  # output: heads 3, head 4, out 5
    lora_a, lora_b, rank = hf_export.lora_factors(a, b, ((2,), (0, 1)))
    assert rank == 2
    np.testing.assert_allclose(lora_b @ lora_a,
                               hf_export.to_matrix(np.einsum("nhr,rd->nhd", a, b), ((2,), (0, 1))))


# ----------------------------------------------------------------------------- vision-language

# the built-in gemma3_vision_micro (its tokenizer, image converter and vision tower: 16 x 16
# images, 4 image tokens an image) with what real Gemma 3 has and the micro lacks: post norms,
# local layers over a window and, in six layers, a global one
GEMMA3_VISION = "gemma3_vision_export_micro"
VISION_LENGTH = 56


@pytest.fixture(scope="module")
def gemma3_vision(tmp_path_factory):
    """(the model, a batch of an image row, a two-image row and a text row, its export)."""
    from nnx_posttrain import tasks
    from nnx_posttrain.tasks import shapes, tokenizer

    if GEMMA3_VISION not in model.TINY:
        model.register_builtin(GEMMA3_VISION, dict(
            tasks.VISION_MODELS["gemma3_vision_micro"], num_layers=6, use_post_ffw_norm=True,
            use_post_attention_norm=True, use_sliding_window_attention=True,
            sliding_window_size=8), tokenizer.vision_proto)
    lm = support.vision_model(GEMMA3_VISION)
    randomized(lm.module)  # the vision tower's weights too
    first, second = shapes.sft_record(0), shapes.sft_record(1)
    two = {"images": first["images"] + second["images"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "or"},
                                     {"type": "image"}, {"type": "text", "text": "which?"}]},
        {"role": "assistant", "content": "the first"}]}
    text = {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                         {"role": "assistant", "content": "5"}]}
    batch = support.tokenized_batch(lm, [first, two, text], VISION_LENGTH)
    assert list(batch["image_count"]) == [1, 2, 0]
    directory = tmp_path_factory.mktemp("gemma3_vision")
    hf_export.export_model(lm.task, directory, "float32", lm.chat_format)
    return lm, batch, directory


def hf_vision_logits(hf, batch, pixel_values=None):
    """transformers' logits of a batch of our pipeline: its real images (image_count of each
    row, in order) as [images, 3, H, W], the image tokens' block marked by token_type_ids (the
    tokens of an image attend to each other, as Gemma3Processor marks them)."""
    pixel_values = batch["pixel_values"] if pixel_values is None else pixel_values
    images = [pixel_values[row, :count] for row, count in enumerate(batch["image_count"])]
    images = np.concatenate(images).transpose(0, 3, 1, 2)
    with torch.no_grad():
        return hf(input_ids=torch.tensor(batch["input_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(batch["attention_mask"]),
                  pixel_values=torch.tensor(images) if len(images) else None,
                  token_type_ids=torch.tensor(batch["vision_mask"], dtype=torch.long)
                  ).logits.numpy()


@pytest.mark.slow
def test_gemma3_vision_export_gives_transformers_logits_with_images(gemma3_vision):
    """Gemma 3 with its vision tower, exported, loads as transformers'
    Gemma3ForConditionalGeneration (every tensor read, none left over) and gives our logits on
    the same token ids and pixel values: a row with one image, one with two, a text-only row.
    The images change the logits, so a mis-mapped tensor of the vision tower or projector
    shows; a text-only batch (no pixel values) gives ours too."""
    lm, batch, directory = gemma3_vision
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["mm_tokens_per_image"] == 4
    assert config["image_token_index"] == lm.task.preprocessor.tokenizer.image_placeholder_id
    hf, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with model.images(batch["pixel_values"]):
        ours = np.asarray(model.full_logits(lm.module, batch["input_ids"], batch["attention_mask"]))
    real = batch["attention_mask"].astype(bool)  # right padding: compare the real positions
    theirs = hf_vision_logits(hf, batch)
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(theirs[real], ours[real], atol=1e-4, rtol=0)
    swapped = batch["pixel_values"][:, ::-1]  # the two-image row's pictures swapped
    other = hf_vision_logits(hf, batch, np.where(batch["image_count"][:, None, None, None, None]
                                                 == 2, swapped, batch["pixel_values"]))
    assert np.abs(other[1] - theirs[1])[real[1]].max() > 1e-2  # the images are read
    text = {k: v[2:] for k, v in batch.items()}
    np.testing.assert_allclose(hf_vision_logits(hf, text)[0][real[2]], ours[2][real[2]],
                               atol=1e-4, rtol=0)


@pytest.mark.slow
def test_gemma3_vision_tokenizer_files_give_the_configs_image_tokens(gemma3_vision):
    """transformers' tokenizer of the export reads the image placeholder, start and end of image
    as the config's ids (the ids where Gemma3ForConditionalGeneration places the images), and
    the image row's text as our pipeline's ids."""
    lm, batch, directory = gemma3_vision
    config = json.loads((directory / "config.json").read_text())
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    for key in ("image_token", "boi_token", "eoi_token"):  # Gemma3Processor's names for them
        assert hf_tok.convert_tokens_to_ids(getattr(hf_tok, key)) == config[f"{key}_index"]
    ids = [config["boi_token_index"], *[config["image_token_index"]] * 4, config["eoi_token_index"]]
    text = "<start_of_image>" + "<img>" * 4 + "<end_of_image>"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    real = batch["input_ids"][0][batch["attention_mask"][0] > 0].tolist()
    assert hf_tok(hf_tok.decode(real[1:]), add_special_tokens=True)["input_ids"] == real


def test_gemma3_vision_export_has_an_image_processor_reading_images_as_ours(gemma3_vision,
                                                                           monkeypatch):
    """The export's ``preprocessor_config.json`` / ``processor_config.json``: transformers'
    ``AutoProcessor`` loads them offline as a ``Gemma3Processor`` whose image processor gives a
    picture of the model's size our pipeline's pixel values (the converter's rescale and
    offset as rescale + normalize), and whose text expansion of ``<start_of_image>`` gives our
    pipeline's token ids (4 placeholders between the image's start and end)."""
    lm, batch, directory = gemma3_vision
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    processor = transformers.AutoProcessor.from_pretrained(str(directory))
    assert type(processor).__name__ == "Gemma3Processor" and processor.image_seq_length == 4
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    theirs = processor(text=["<start_of_image>"], images=[[image]], return_tensors="np")
    np.testing.assert_allclose(theirs["pixel_values"][0].transpose(1, 2, 0),
                               lm.images.pixels([image])[0], atol=1e-6, rtol=0)
    block = theirs["input_ids"][0].tolist()[1:]  # after BOS: "\n\n", the image's tokens, "\n\n"
    ours = batch["input_ids"][0].tolist()
    assert any(ours[i:i + len(block)] == block for i in range(len(ours)))
    assert (theirs["token_type_ids"][0] == 1).sum() == 4
