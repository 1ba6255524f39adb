"""Qwen 2 / 2.5 (``QwenBackbone``) and Qwen 3 dense (``Qwen3Backbone``): the Llama layout
(``llama.SHARDING``, ``llama.LLAMA_RULES``) with Qwen 2's q / k / v biases and Qwen 3's q / k
norms."""

from __future__ import annotations

import json

from nnx_posttrain.families.base import (SELF_ATTENTION_CACHE, TINY_DIMS, Export, Family,
                                         LayerSpec, Preset, refuse)
from nnx_posttrain.families.llama import LORA, SHARDING, llama_like, llama_rules


def qwen_attention(layer, training: bool) -> LayerSpec:
    """``QwenAttention``: a window where ``use_sliding_window_attention``."""
    return llama_like(layer, layer.sliding_window_size if layer.use_sliding_window_attention
                      else None)


def qwen3_attention(layer, training: bool) -> LayerSpec:
    """``Qwen3Attention``: ``sliding_window_size`` (None when off). KerasHub applies it only in
    its einsum branch, which it skips on JAX; this path applies it as the layer is written."""
    return llama_like(layer, getattr(layer, "sliding_window_size", None))


def qwen_config(b) -> dict:
    refuse("QwenBackbone", [p for p, bad in (
        ("use_sliding_window_attention=True", b.use_sliding_window_attention),
        (f"rope_scaling_factor={b.rope_scaling_factor}", b.rope_scaling_factor != 1.0),
    ) if bad])
    return dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2",
        vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim,
        num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
        num_key_value_heads=b.num_key_value_heads, rms_norm_eps=b.layer_norm_epsilon,
        rope_theta=b.rope_max_wavelength, hidden_act="silu", max_position_embeddings=32768,
        use_sliding_window=False, tie_word_embeddings=b.tie_word_embeddings, attention_dropout=0.0,
    )


def qwen3_config(b) -> dict:
    refuse("Qwen3Backbone", [] if b.rope_scaling_factor == 1.0
           else [f"rope_scaling_factor={b.rope_scaling_factor}"])
    window = b.sliding_window_size
    refuse("Qwen3Backbone", [] if not window or window >= 32768 else [
        f"sliding_window_size={window} (KerasHub masks every layer beyond it; the Hugging Face "
        "Qwen3 sliding window did not give the same logits)"])
    cfg = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim,
        num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
        num_key_value_heads=b.num_key_value_heads, head_dim=b.head_dim,
        rms_norm_eps=b.layer_norm_epsilon, rope_theta=b.rope_max_wavelength, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=b.tie_word_embeddings, attention_dropout=0.0,
    )
    # KerasHub's window (32,768 by default) covers every position the export is told to support
    cfg.update(use_sliding_window=False, sliding_window=None,
               max_position_embeddings=min(40960, window or 40960))
    return cfg


def chatml_tokenizer(tokenizer, to, end: str = "<|im_end|>", max_length: int = 40960) -> None:
    """A Qwen 3 style byte-level BPE tokenizer written as Qwen 2's (``Qwen2Tokenizer``, which
    transformers reads for every Qwen) with its own end token (KerasHub exports Qwen 2's only)."""
    tokenizer.save_assets(str(to))
    (to / "vocabulary.json").rename(to / "vocab.json")
    special = {str(tokenizer.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                               "rstrip": False, "normalized": False,
                                               "single_word": False}
               for t in tokenizer.unsplittable_tokens or []}
    (to / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": end,
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": max_length,
        "added_tokens_decoder": special}, indent=2))



QWEN2 = Family(
    name="qwen2",
    backbone="QwenBackbone",
    classes=("QwenCausalLM", "QwenCausalLMPreprocessor", "QwenTokenizer"),
    chat_format="qwen2.5",
    attention={"QwenAttention": qwen_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(llama_rules, qwen_config, "Qwen 2 / 2.5 (`qwen2`) without sliding window"),
    decoding=SELF_ATTENTION_CACHE,
    context_length=131_072,  # Qwen 2.5 with YaRN (32,768 without)
    hf_model_types=("qwen2",),
    short_names={"qwen2.5_0.5b": "qwen2.5_0.5b_en", "qwen2.5_7b": "qwen2.5_7b_en"},
    tokenizer="bpe-qwen2",
    presets={  # Qwen's embedding has 151,936 rows for 151,665 tokens (padded for the hardware)
        "qwen2.5_0.5b": Preset(dict(vocabulary_size=151_936, num_layers=24, num_query_heads=14,
                                    num_key_value_heads=2, hidden_dim=896, intermediate_dim=4864,
                                    rope_max_wavelength=1_000_000, layer_norm_epsilon=1e-6,
                                    tie_word_embeddings=True), 151_665),
    },
    tiny={"qwen2": dict(TINY_DIMS, num_key_value_heads=2, use_sliding_window_attention=True,
                        sliding_window_size=8)},  # q/k/v biases
)

QWEN3 = Family(
    name="qwen3",
    backbone="Qwen3Backbone",
    classes=("Qwen3CausalLM", "Qwen3CausalLMPreprocessor", "Qwen3Tokenizer"),
    chat_format="qwen3",
    attention={"Qwen3Attention": qwen3_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(llama_rules, qwen3_config,
                  "Qwen 3 dense (`qwen3`), positions up to its sliding window (32,768)",
                  tokenizer=chatml_tokenizer),
    decoding=SELF_ATTENTION_CACHE,
    context_length=131_072,  # Qwen 3 with YaRN (40,960 without)
    hf_model_types=("qwen3",),
    short_names={"qwen3_0.6b": "qwen3_0.6b_en"},
    tokenizer="bpe-qwen3",
    presets={
        "qwen3_0.6b": Preset(dict(vocabulary_size=151_936, num_layers=28, num_query_heads=16,
                                  num_key_value_heads=8, hidden_dim=1024, head_dim=128,
                                  intermediate_dim=3072, rope_max_wavelength=1_000_000,
                                  layer_norm_epsilon=1e-6, tie_word_embeddings=True), 151_669),
    },
    tiny={"qwen3": dict(TINY_DIMS, num_key_value_heads=1, head_dim=8)},  # q/k norms
)
