"""Phi-3 (``Phi3Backbone``: Phi-3-mini-4k / 128k-instruct): the Llama layout under ``attention``
(``transformer_layer_i/attention/{query,key,value,attention_output}``), keys and values repeated
per query group, no sliding window in KerasHub (Phi-3-mini-4k's config has one of 2,047, which
transformers applies: research P2's table, so the two differ past 2,047 positions). KerasHub
0.32 has no Phi-3 converter from a Hugging Face directory and no exporter to one.
"""

from __future__ import annotations

from nnx_posttrain.families.base import Decoding, Family, Preset, Unsupported
from nnx_posttrain.families.llama import LORA, llama_like

F, T = "fsdp", "tensor"


def phi3_attention(layer, training: bool):
    """``Phi3Attention``: no window (KerasHub applies none)."""
    return llama_like(layer, None)


SHARDING = (
    (r"transformer_layer_\d+/attention/(query|key|value)/kernel$", (F, T, None)),
    (r"transformer_layer_\d+/attention/attention_output/kernel$", (T, None, F)),
    (r"transformer_layer_\d+/(feedforward_gate_dense|feedforward_intermediate_dense)/kernel$",
     (F, T)),
    (r"transformer_layer_\d+/feedforward_output_dense/kernel$", (T, F)),
)

PHI3 = Family(
    name="phi3",
    backbone="Phi3Backbone",
    classes=("Phi3CausalLM", "Phi3CausalLMPreprocessor", "Phi3Tokenizer"),
    chat_format="phi3",
    attention={"Phi3Attention": phi3_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Unsupported("KerasHub 0.32 has no Phi-3 exporter and this package none verified yet "
                       "(transformers' fused qkv_proj / gate_up_proj); use --format keras"),
    decoding=Decoding("attention_cache", "attention_cache_update_index"),
    context_length=4096,  # mini-4k (the 128k variant: 131,072 with its scaled rotary)
    hf_model_types=Unsupported("KerasHub 0.32 converts no Phi-3 Hugging Face checkpoint "
                               "(model_type phi3); use its KerasHub preset"),
    short_names={"phi3_mini_4k_it": "phi3_mini_4k_instruct_en"},
    tokenizer="sentencepiece-phi3",
    presets={"phi3_mini_4k": Preset(dict(
        vocabulary_size=32_064, num_layers=32, hidden_dim=3072, intermediate_dim=8192,
        num_query_heads=32, num_key_value_heads=32, layer_norm_epsilon=1e-5,
        max_sequence_length=4096, pretraining_sequence_length=4096), 32_011)},
    tiny={"phi3": dict(vocabulary_size=64, num_layers=2, hidden_dim=32, intermediate_dim=64,
                       num_query_heads=4, num_key_value_heads=2, layer_norm_epsilon=1e-5)},
)
