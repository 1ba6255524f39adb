"""Gemma 1 / 2 (``GemmaBackbone``) and Gemma 3 (``Gemma3Backbone``, text).

Decoder blocks ``decoder_block_i``: q / k / v kernels [heads, hidden, head_dim], output
[heads, head_dim, hidden], the MLP's gate / up / down ``ffw_gating`` / ``ffw_gating_2`` /
``ffw_linear``; queries scaled before the scores, optional soft cap and sliding window.
"""

from __future__ import annotations

import math

from nnx_posttrain.families import image_processors
from nnx_posttrain.families.base import (
    TINY_DIMS,
    Decoding,
    Export,
    Family,
    LayerSpec,
    Preset,
    refuse,
)

F, T = "fsdp", "tensor"


def attention(layer, training: bool) -> LayerSpec:
    """Gemma's attention (``CachedGemmaAttention``, ``CachedGemma3Attention``): queries scaled by
    1 / sqrt(head_dim) (or hidden / heads), a soft cap, a sliding window on its local layers."""
    dim = layer.head_dim if layer.query_head_dim_normalize else (
        layer.hidden_dim // layer.num_query_heads)
    window = layer.sliding_window_size if layer.use_sliding_window_attention else None
    return LayerSpec(1 / math.sqrt(dim), layer.logit_soft_cap or None, window)


SHARDING = (
    # q/k/v [heads, hidden, head_dim], output [heads, head_dim, hidden]
    (r"decoder_block_\d+/attention/(query|key|value)/kernel$", (T, F, None)),
    (r"decoder_block_\d+/attention/attention_output/kernel$", (T, None, F)),
    # MLP: gate / up [hidden, intermediate], down [intermediate, hidden]
    (r"decoder_block_\d+/(ffw_gating|ffw_gating_2)/kernel$", (F, T)),
    (r"decoder_block_\d+/ffw_linear/kernel$", (T, F)),
)
LORA = {"attention": ("query", "key", "value", "attention_output"),
        "mlp": ("ffw_gating", "ffw_gating_2", "ffw_linear")}

_L = r"(\d+)"
_RULES = [
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),
    (rf"decoder_block_{_L}/pre_attention_norm/scale", "model.layers.{}.input_layernorm.weight", None),
    (rf"decoder_block_{_L}/post_attention_norm/scale", "model.layers.{}.post_attention_layernorm.weight", None),
    (rf"decoder_block_{_L}/pre_ffw_norm/scale", "model.layers.{}.PRE_FFW.weight", None),
    (rf"decoder_block_{_L}/post_ffw_norm/scale", "model.layers.{}.post_feedforward_layernorm.weight", None),
    (rf"decoder_block_{_L}/attention/query/kernel", "model.layers.{}.self_attn.q_proj.weight", ((0, 2), (1,))),
    (rf"decoder_block_{_L}/attention/key/kernel", "model.layers.{}.self_attn.k_proj.weight", ((0, 2), (1,))),
    (rf"decoder_block_{_L}/attention/value/kernel", "model.layers.{}.self_attn.v_proj.weight", ((0, 2), (1,))),
    (rf"decoder_block_{_L}/attention/query_norm/scale", "model.layers.{}.self_attn.q_norm.weight", None),
    (rf"decoder_block_{_L}/attention/key_norm/scale", "model.layers.{}.self_attn.k_norm.weight", None),
    (rf"decoder_block_{_L}/attention/attention_output/kernel", "model.layers.{}.self_attn.o_proj.weight", ((2,), (0, 1))),
    (rf"decoder_block_{_L}/ffw_gating/kernel", "model.layers.{}.mlp.gate_proj.weight", ((1,), (0,))),
    (rf"decoder_block_{_L}/ffw_gating_2/kernel", "model.layers.{}.mlp.up_proj.weight", ((1,), (0,))),
    (rf"decoder_block_{_L}/ffw_linear/kernel", "model.layers.{}.mlp.down_proj.weight", ((1,), (0,))),
    (r"final_normalization/scale", "model.norm.weight", None),
]


# Gemma 3's vision tower (KerasHub's ``Gemma3VisionEncoder``: a SigLIP encoder, its pooling, then
# the projection into the language model) as transformers' ``Gemma3ForConditionalGeneration``
# names it: ``model.vision_tower`` (SigLIP) and ``model.multi_modal_projector``
_V, _VT = r"image_encoder/encoder_block_(\d+)", "model.vision_tower.encoder.layers.{}"
_DENSE = ((1,), (0,))  # a Dense kernel [in, out] as [out, in]
VISION_RULES = [
    (r"image_encoder/encoder_embeddings/embedding_conv/kernel",
     "model.vision_tower.embeddings.patch_embedding.weight", ("transpose", (3, 2, 0, 1))),
    (r"image_encoder/encoder_embeddings/embedding_conv/bias",
     "model.vision_tower.embeddings.patch_embedding.bias", None),
    (r"image_encoder/encoder_embeddings/position_embedding/embeddings",
     "model.vision_tower.embeddings.position_embedding.weight", None),
    (rf"{_V}/layer_norm_(1|2)/gamma", _VT + ".layer_norm{}.weight", None),
    (rf"{_V}/layer_norm_(1|2)/beta", _VT + ".layer_norm{}.bias", None),
    *[(rf"{_V}/multi_head_attention/{ours}_proj/{part}", f"{_VT}.self_attn.{theirs}_proj.{hf}",
       _DENSE if part == "kernel" else None)
      for ours, theirs in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "out"))
      for part, hf in (("kernel", "weight"), ("bias", "bias"))],
    *[(rf"{_V}/mlp_dense_{i}/{part}", f"{_VT}.mlp.fc{i}.{hf}", _DENSE if part == "kernel" else None)
      for i in (1, 2) for part, hf in (("kernel", "weight"), ("bias", "bias"))],
    (r"image_encoder/encoder_layer_norm/gamma", "model.vision_tower.post_layernorm.weight", None),
    (r"image_encoder/encoder_layer_norm/beta", "model.vision_tower.post_layernorm.bias", None),
    (r"vision_output_encoder/vision_soft_embedding_norm/scale",
     "model.multi_modal_projector.mm_soft_emb_norm.weight", None),
    (r"vision_output_encoder/vision_input_projection/kernel",
     "model.multi_modal_projector.mm_input_projection_weight", None),
]


def export_rules(backbone) -> list:
    """Gemma's weight names; the norm before the MLP is Gemma 1's ``post_attention_layernorm``
    (no post norms), else ``pre_feedforward_layernorm``. Gemma 3 with a vision encoder: the
    language model under ``model.language_model`` and the vision tower's names."""
    gemma1 = type(backbone).__name__ == "GemmaBackbone" and not backbone.use_post_ffw_norm
    pre_ffw = "post_attention_layernorm" if gemma1 else "pre_feedforward_layernorm"
    rules = [(p, name.replace("PRE_FFW", pre_ffw), layout) for p, name, layout in _RULES]
    if getattr(backbone, "vision_encoder", None) is None:
        return rules
    text = [(p, name.replace("model.", "model.language_model.", 1), layout)
            for p, name, layout in rules]
    return text + VISION_RULES


def gemma_config(b) -> dict:
    """Gemma 1 (``gemma``) or Gemma 2 (``gemma2``: post norms, soft caps, local layers)."""
    gemma2 = b.use_post_ffw_norm or b.use_post_attention_norm
    common = dict(
        vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim,
        intermediate_size=b.intermediate_dim // 2, num_hidden_layers=b.num_layers,
        num_attention_heads=b.num_query_heads, num_key_value_heads=b.num_key_value_heads,
        head_dim=b.head_dim, rms_norm_eps=b.layer_norm_epsilon, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, attention_dropout=0.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )
    if not gemma2:
        refuse("GemmaBackbone (Gemma 1)", [
            f"{name} is set (a Gemma 2 feature, without Gemma 2's post norms)"
            for name in ("final_logit_soft_cap", "attention_logit_soft_cap",
                         "use_sliding_window_attention") if getattr(b, name)
        ] + ([] if b.query_head_dim_normalize else
             ["query_head_dim_normalize=False (Gemma 1 scales queries by head_dim)"]))
        return dict(architectures=["GemmaForCausalLM"], model_type="gemma", **common)
    refuse("GemmaBackbone (Gemma 2)", [] if b.use_post_ffw_norm and b.use_post_attention_norm
           else ["only one of use_post_ffw_norm / use_post_attention_norm"])
    sliding = [bool(b.use_sliding_window_attention and i % 2 == 0) for i in range(b.num_layers)]
    return dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", **common,
        query_pre_attn_scalar=b.head_dim if b.query_head_dim_normalize
        else b.hidden_dim // b.num_query_heads,
        final_logit_softcapping=b.final_logit_soft_cap,
        attn_logit_softcapping=b.attention_logit_soft_cap,
        sliding_window=b.sliding_window_size,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
    )


def gemma3_config(b) -> dict:
    """Gemma 3 text (``gemma3_text``): KerasHub's own config writer."""
    from keras_hub.src.utils.transformers.export.gemma3 import get_gemma3_config

    refuse("Gemma3Backbone", [p for p, bad in (
        ("an embedding model", getattr(b, "is_embedding_model", False)),
        ("bidirectional attention", getattr(b, "use_bidirectional_attention", False)),
        ("no post-attention / post-feedforward norms (Gemma 3 has both)",
         not (b.use_post_ffw_norm and b.use_post_attention_norm)),
        ("no query / key norms (Gemma 3 has them)", not b.use_query_key_norm),
    ) if bad])
    cfg = get_gemma3_config(b)
    cfg.pop("torch_dtype", None)
    return cfg if b.vision_encoder is None else _gemma3_vision_config(b, cfg)


def _gemma3_vision_config(b, cfg: dict) -> dict:
    """``gemma3`` (``Gemma3ForConditionalGeneration``): KerasHub's config with its image-token
    keys where transformers reads them (the top level, not ``vision_config``: the image tokens
    per image, e.g. 4, not the default 256); the token ids themselves are the tokenizer's
    (``Export.image_tokens``). The SigLIP tower's activation is KerasHub's tanh GELU."""
    encoder = b.vision_encoder
    output = encoder.get_layer("vision_output_encoder")
    vision = dict(cfg["vision_config"], hidden_act="gelu_pytorch_tanh", num_channels=3,
                  attention_dropout=0.0)
    refuse("Gemma3Backbone with a vision encoder", [p for p, bad in (
        (f"the projection's norm epsilon {output.layer_norm_epsilon} differs from the tower's "
         f"{vision['layer_norm_eps']} (transformers uses one)",
         output.layer_norm_epsilon != vision["layer_norm_eps"]),
        ("patches or pooling that do not tile the image",
         vision["image_size"] % vision["patch_size"]
         or vision["image_size"] // vision["patch_size"] % encoder.get_layer("pooling").pool_size),
    ) if bad])
    top = {key: vision.pop(key) for key in ("boi_token_index", "eoi_token_index",
                                             "image_token_index", "mm_tokens_per_image")}
    text = {k: v for k, v in cfg["text_config"].items() if k != "torch_dtype"}
    return dict(cfg, text_config=dict(text, model_type="gemma3_text"), vision_config=vision,
                tie_word_embeddings=True, initializer_range=0.02, **top)


def vision_tokenizer(tokenizer, to) -> None:
    """KerasHub's Gemma 3 / Gemma 4 tokenizer files, with the image tokens under the tokenizer's
    own names and ids as transformers' processors read them (``image_token``, ``boi_token``,
    ``eoi_token``; KerasHub writes Gemma 3's as ``<image_soft_token>`` and the released
    vocabulary's ids, which a tokenizer whose placeholder is ``<img>``, or whose ids differ, does
    not have): what transformers' tokenizer maps to the config's image token ids."""
    import json
    from pathlib import Path

    from keras_hub.src.utils.transformers.export import hf_exporter

    hf_exporter.export_tokenizer(tokenizer, str(to))
    if not getattr(tokenizer, "has_vision_tokens", False):
        return
    names = {"image_token": tokenizer.image_placeholder,
             "boi_token": tokenizer.start_of_image_token, "eoi_token": tokenizer.end_of_image_token}
    added = {"special": True, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False}
    path = Path(to) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    kerashub = {"<start_of_image>", "<end_of_image>", "<image_soft_token>"}
    decoder = {k: v for k, v in config.get("added_tokens_decoder", {}).items()
               if v["content"] not in kerashub}
    decoder.update({str(tokenizer.token_to_id(n)): dict(added, content=n) for n in names.values()})
    config.update(names, extra_special_tokens=names, added_tokens_decoder=decoder)
    path.write_text(json.dumps(config, indent=2) + "\n")
    path = Path(to) / "special_tokens_map.json"  # KerasHub writes none for Gemma 4
    tokens = json.loads(path.read_text()) if path.is_file() else {}
    tokens["additional_special_tokens"] = [
        {k: v for k, v in dict(added, content=n).items() if k != "special"} for n in names.values()]
    path.write_text(json.dumps(tokens, indent=2) + "\n")


# what Gemma 2's published configs share: head size 256 and its scaling, the post norms, the
# logit soft caps, local attention every other layer over 4,096 tokens
GEMMA2 = dict(head_dim=256, query_head_dim_normalize=True, use_post_ffw_norm=True,
              use_post_attention_norm=True, final_logit_soft_cap=30.0,
              attention_logit_soft_cap=50.0, use_sliding_window_attention=True,
              sliding_window_size=4096)
# KerasHub's Gemma 1 / 2 ``intermediate_dim`` is twice Hugging Face's ``intermediate_size``
# (gate and up together); Gemma 3's is the same
_TINY = dict(TINY_DIMS, head_dim=8)

GEMMA = Family(
    name="gemma",
    backbone="GemmaBackbone",
    classes=("GemmaCausalLM", "GemmaCausalLMPreprocessor", "GemmaTokenizer"),
    chat_format="gemma",
    attention={"CachedGemmaAttention": attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(export_rules, gemma_config,
                  "Gemma 1 (`gemma`: no post norms, soft caps or window; any kv heads); Gemma 2 "
                  "(`gemma2`: post norms, soft caps, sliding window on even layers)"),
    decoding=Decoding("cache", "cache_update_index", embed_scale=True),
    context_length=8_192,
    hf_model_types=("gemma", "gemma2"),
    short_names={"gemma_2b": "gemma_2b_en", "gemma_7b": "gemma_7b_en",
                 "gemma_2b_it": "gemma_instruct_2b_en", "gemma2_2b": "gemma2_2b_en",
                 "gemma2_9b": "gemma2_9b_en"},
    tokenizer="sentencepiece-gemma",
    presets={
        "gemma_2b": Preset(dict(vocabulary_size=256_000, num_layers=18, num_query_heads=8,
                                num_key_value_heads=1, hidden_dim=2048, intermediate_dim=32_768,
                                head_dim=256), 256_000),
        "gemma_7b": Preset(dict(vocabulary_size=256_000, num_layers=28, num_query_heads=16,
                                num_key_value_heads=16, hidden_dim=3072, intermediate_dim=49_152,
                                head_dim=256), 256_000),
        "gemma2_9b": Preset(dict(vocabulary_size=256_000, num_layers=42, num_query_heads=16,
                                 num_key_value_heads=8, hidden_dim=3584, intermediate_dim=28_672,
                                 **GEMMA2), 256_000),
        "gemma2_2b": Preset(dict(vocabulary_size=256_000, num_layers=26, num_query_heads=8,
                                 num_key_value_heads=4, hidden_dim=2304, intermediate_dim=18_432,
                                 **GEMMA2), 256_000),
    },
    tiny={
        "gemma": dict(_TINY, num_key_value_heads=1),  # one kv head
        "gemma2": dict(_TINY, num_key_value_heads=2, query_head_dim_normalize=False,
                       use_post_ffw_norm=True, use_post_attention_norm=True,
                       attention_logit_soft_cap=5.0, final_logit_soft_cap=30.0,
                       use_sliding_window_attention=True, sliding_window_size=8),
    },
)

GEMMA3 = Family(
    name="gemma3",
    backbone="Gemma3Backbone",
    classes=("Gemma3CausalLM", "Gemma3CausalLMPreprocessor", "Gemma3Tokenizer"),
    chat_format="gemma",
    attention={"CachedGemma3Attention": attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(export_rules, gemma3_config,
                  "text (`gemma3_text`: causal, not an embedding model) and with its vision "
                  "encoder (`gemma3`: `Gemma3ForConditionalGeneration`, SigLIP tower and "
                  "projector; logits with images checked)",
                  tokenizer=vision_tokenizer,
                  image_tokens=("image_token_index", "boi_token_index", "eoi_token_index"),
                  processor=image_processors.gemma3),
    decoding=Decoding("cache", "cache_update_index", pair_cache=True, embed_scale=True),
    context_length=131_072,
    hf_model_types=("gemma3_text", "gemma3"),
    short_names={"gemma3_270m": "gemma3_270m", "gemma3_1b": "gemma3_1b"},
    tokenizer="sentencepiece-gemma3",
    presets={  # google/gemma-3-270m, gemma-3-1b-pt config.json (text; local window 512)
        "gemma3_270m": Preset(dict(vocabulary_size=262_144, image_size=None, num_layers=18,
                                   num_query_heads=4, num_key_value_heads=1, hidden_dim=640,
                                   intermediate_dim=2048, head_dim=256,
                                   use_sliding_window_attention=True, sliding_window_size=512,
                                   global_rope_scaling_factor=1.0), 262_144),
        "gemma3_1b": Preset(dict(vocabulary_size=262_144, image_size=None, num_layers=26,
                                 num_query_heads=4, num_key_value_heads=1, hidden_dim=1152,
                                 intermediate_dim=6912, head_dim=256,
                                 use_sliding_window_attention=True, sliding_window_size=512,
                                 global_rope_scaling_factor=1.0), 262_144),
    },
    tiny={"gemma3": dict(_TINY, image_size=None, num_key_value_heads=1,
                         use_sliding_window_attention=True, sliding_window_size=8)},
)
