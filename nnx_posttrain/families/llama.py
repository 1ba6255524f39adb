"""Llama 2 (``LlamaBackbone``), Llama 3 / 3.1+ (``Llama3Backbone``) and Mistral
(``MistralBackbone``): the Llama layout that Qwen shares (``LLAMA_RULES``, ``llama_like``).

Decoder blocks ``transformer_layer_i``: q / k / v kernels [hidden, heads, head_dim], output
[heads, head_dim, hidden], the MLP's ``feedforward_gate_dense`` / ``..._intermediate_dense`` /
``..._output_dense``; keys and values repeated per query group before ``_compute_attention``,
scores scaled by ``_inv_norm_factor``.
"""

from __future__ import annotations

from nnx_posttrain.families.base import (
    SELF_ATTENTION_CACHE,
    TINY_DIMS,
    Export,
    Family,
    LayerSpec,
    Preset,
    Unsupported,
    refuse,
)

F, T = "fsdp", "tensor"


def llama_like(layer, window, groups=None) -> LayerSpec:
    """The Llama family's attention: scores scaled by ``_inv_norm_factor``, keys / values
    repeated ``num_key_value_groups`` times, ``window`` (None: none)."""
    if groups is None:
        groups = getattr(layer, "num_key_value_groups", None) or 1
    return LayerSpec(float(layer._inv_norm_factor), None, window or None, repeated=int(groups),
                     scale_scores=True)


def llama_attention(layer, training: bool) -> LayerSpec:
    """``LlamaAttention`` (Llama 2, Llama 3): no window."""
    return llama_like(layer, None)


def mistral_attention(layer, training: bool) -> LayerSpec:
    """``CachedMistralAttention``: the window the decoder's banded mask applies; its key / value
    group count is private."""
    return llama_like(layer, layer._sliding_window, layer._num_key_value_groups)


SHARDING = (
    # q/k/v [hidden, heads, head_dim] (Qwen 2's biases [heads, head_dim]), output [heads,
    # head_dim, hidden]
    (r"transformer_layer_\d+/self_attention/(query|key|value)/kernel$", (F, T, None)),
    (r"transformer_layer_\d+/self_attention/(query|key|value)/bias$", (T, None)),
    (r"transformer_layer_\d+/self_attention/attention_output/kernel$", (T, None, F)),
    # MLP: gate / up [hidden, intermediate], down [intermediate, hidden]
    (r"transformer_layer_\d+/(feedforward_gate_dense|feedforward_intermediate_dense)/kernel$",
     (F, T)),
    (r"transformer_layer_\d+/(feedforward_gate_dense|feedforward_intermediate_dense)/bias$", (T,)),
    (r"transformer_layer_\d+/feedforward_output_dense/kernel$", (T, F)),
)
LORA = {"attention": ("query", "key", "value", "attention_output"),
        "mlp": ("feedforward_gate_dense", "feedforward_intermediate_dense",
                "feedforward_output_dense")}

_T = r"transformer_layer_(\d+)"
LLAMA_RULES = [  # Llama 3, Mistral, Qwen 2 / 2.5, Qwen 3
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),
    (r"token_embedding/reverse_embeddings", "lm_head.weight", ((1,), (0,))),
    (rf"{_T}/self_attention/query/kernel", "model.layers.{}.self_attn.q_proj.weight", ((1, 2), (0,))),
    (rf"{_T}/self_attention/key/kernel", "model.layers.{}.self_attn.k_proj.weight", ((1, 2), (0,))),
    (rf"{_T}/self_attention/value/kernel", "model.layers.{}.self_attn.v_proj.weight", ((1, 2), (0,))),
    (rf"{_T}/self_attention/query/bias", "model.layers.{}.self_attn.q_proj.bias", "flat"),
    (rf"{_T}/self_attention/key/bias", "model.layers.{}.self_attn.k_proj.bias", "flat"),
    (rf"{_T}/self_attention/value/bias", "model.layers.{}.self_attn.v_proj.bias", "flat"),
    (rf"{_T}/self_attention/query_dense_layernorm/scale", "model.layers.{}.self_attn.q_norm.weight", None),
    (rf"{_T}/self_attention/key_dense_layernorm/scale", "model.layers.{}.self_attn.k_norm.weight", None),
    (rf"{_T}/self_attention/attention_output/kernel", "model.layers.{}.self_attn.o_proj.weight", ((2,), (0, 1))),
    (rf"{_T}/self_attention_layernorm/scale", "model.layers.{}.input_layernorm.weight", None),
    (rf"{_T}/feedforward_layernorm/scale", "model.layers.{}.post_attention_layernorm.weight", None),
    (rf"{_T}/feedforward_gate_dense/kernel", "model.layers.{}.mlp.gate_proj.weight", ((1,), (0,))),
    (rf"{_T}/feedforward_intermediate_dense/kernel", "model.layers.{}.mlp.up_proj.weight", ((1,), (0,))),
    (rf"{_T}/feedforward_output_dense/kernel", "model.layers.{}.mlp.down_proj.weight", ((1,), (0,))),
    (r"sequence_output_layernorm/scale", "model.norm.weight", None),
]


def llama_rules(backbone) -> list:
    return list(LLAMA_RULES)


def llama3_config(b) -> dict:
    """Llama 3 and 3.1+ (``llama``): KerasHub's own config writer."""
    from keras_hub.src.utils.transformers.export.llama3 import get_llama3_config

    refuse("Llama3Backbone", [] if b.rope_position_scaling_factor == 1.0
           else [f"rope_position_scaling_factor={b.rope_position_scaling_factor}"])
    cfg = get_llama3_config(b)
    cfg.pop("torch_dtype", None)
    return cfg


def mistral_config(b) -> dict:
    refuse("MistralBackbone", [] if getattr(b, "rope_scaling_factor", 1.0) == 1.0
           else [f"rope_scaling_factor={b.rope_scaling_factor}"])
    return dict(
        architectures=["MistralForCausalLM"], model_type="mistral",
        vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim,
        num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
        num_key_value_heads=b.num_key_value_heads,
        head_dim=getattr(b, "head_dim", None) or b.hidden_dim // b.num_query_heads,
        rms_norm_eps=b.layer_norm_epsilon, rope_theta=b.rope_max_wavelength, hidden_act="silu",
        max_position_embeddings=32768, sliding_window=b.sliding_window, tie_word_embeddings=False,
        attention_dropout=0.0,
    )


def llama3_format(backbone) -> str:
    """Llama 3 backbones with scaled rotary frequencies are 3.1 or later (their template has a
    date header)."""
    dated = getattr(backbone, "rope_frequency_adjustment_factor", None) is not None
    return "llama3.1" if dated else "llama3"



LLAMA2 = Family(
    name="llama2",
    backbone="LlamaBackbone",
    classes=("LlamaCausalLM", "LlamaCausalLMPreprocessor", "LlamaTokenizer"),
    chat_format=Unsupported("Llama 2's chat template is not copied here (choose one with "
                            "--chat-format)"),
    attention={"LlamaAttention": llama_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Unsupported("Llama 2's export to Hugging Face was not verified"),
    decoding=SELF_ATTENTION_CACHE,
    context_length=4_096,
    hf_model_types=Unsupported("KerasHub's Llama converter reads Llama 3 directories"),
    short_names={},
    tokenizer="sentencepiece-llama",
    presets={"llama2_7b": Preset(dict(vocabulary_size=32_000, num_layers=32, num_query_heads=32,
                                      num_key_value_heads=32, hidden_dim=4096,
                                      intermediate_dim=11_008, layer_norm_epsilon=1e-5), 32_000)},
    tiny={"llama2": dict(TINY_DIMS, num_key_value_heads=2)},
)

LLAMA3 = Family(
    name="llama3",
    backbone="Llama3Backbone",
    classes=("Llama3CausalLM", "Llama3CausalLMPreprocessor", "Llama3Tokenizer"),
    chat_format=llama3_format,
    attention={"LlamaAttention": llama_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(llama_rules, llama3_config,
                  "Llama 3 and 3.1+ (`llama`; scaled rotary frequencies), tied or not"),
    decoding=SELF_ATTENTION_CACHE,
    context_length=131_072,  # Llama 3.1 / 3.2
    hf_model_types=("llama",),
    short_names={"llama3_8b": "llama3_8b_en", "llama3.2_1b": "llama3.2_1b",
                 "llama3.2_3b": "llama3.2_3b"},
    tokenizer="bpe-llama3",
    presets={
        "llama3_8b": Preset(dict(vocabulary_size=128_256, num_layers=32, num_query_heads=32,
                                 num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14_336,
                                 rope_max_wavelength=500_000, layer_norm_epsilon=1e-5), 128_256),
        "llama3.2_1b": Preset(dict(vocabulary_size=128_256, num_layers=16, num_query_heads=32,
                                   num_key_value_heads=8, hidden_dim=2048, intermediate_dim=8192,
                                   rope_max_wavelength=500_000,
                                   rope_frequency_adjustment_factor=32.0,
                                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                                   rope_pretraining_sequence_length=8192,
                                   layer_norm_epsilon=1e-5, tie_word_embeddings=True), 128_256),
    },
    tiny={"llama3": dict(TINY_DIMS, num_key_value_heads=2)},
)

MISTRAL = Family(
    name="mistral",
    backbone="MistralBackbone",
    classes=("MistralCausalLM", "MistralCausalLMPreprocessor", "MistralTokenizer"),
    chat_format="mistral",
    attention={"CachedMistralAttention": mistral_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(llama_rules, mistral_config, "`mistral`: sliding window, head_dim"),
    decoding=SELF_ATTENTION_CACHE,
    context_length=32_768,
    hf_model_types=("mistral",),
    short_names={"mistral_7b": "mistral_7b_en"},
    tokenizer="sentencepiece-llama",
    presets={"mistral_7b": Preset(dict(vocabulary_size=32_000, num_layers=32, num_query_heads=32,
                                       num_key_value_heads=8, hidden_dim=4096,
                                       intermediate_dim=14_336, layer_norm_epsilon=1e-5,
                                       sliding_window=4096), 32_000)},
    tiny={"mistral": dict(TINY_DIMS, num_key_value_heads=2, sliding_window=8)},
)
