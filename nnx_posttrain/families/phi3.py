"""Phi-3 (``Phi3Backbone``: Phi-3-mini-4k / 128k-instruct): the Llama layout under ``attention``
(``transformer_layer_i/attention/{query,key,value,attention_output}``), keys and values repeated
per query group, no sliding window in KerasHub (Phi-3-mini-4k's config has one of 2,047, which
transformers applies: research P2's table, so the two differ past 2,047 positions). KerasHub
0.32 has no Phi-3 exporter to a Hugging Face directory and no converter from one: the package's
(``EXPORT_RULES``, ``export_config``, ``export_tokenizer``) writes transformers'
``Phi3ForCausalLM``, its fused ``qkv_proj`` (q | k | v rows) and ``gate_up_proj`` (gate | up
rows) each one tensor of several Keras kernels (``export.hf``'s ``("part", ...)`` layouts), with
``sliding_window`` null (transformers then applies none, as KerasHub) and unscaled rotary
frequencies (the 128k variant's "su" scaling is refused); its converter (``model.hf_convert``)
reads such a directory back as ``--model DIR`` by the same rules, and Microsoft's published
checkpoints (their window not applied and said, their added chat markers appended).
"""

from __future__ import annotations

import json
from pathlib import Path

from nnx_posttrain.families.base import Decoding, Export, Family, Preset, refuse
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

_T = r"transformer_layer_(\d+)"
_QKV = "model.layers.{}.self_attn.qkv_proj.weight"  # q | k | v rows
_GATE_UP = "model.layers.{}.mlp.gate_up_proj.weight"  # gate | up rows
EXPORT_RULES = [  # (Keras variable path, transformers tensor, layout: export.hf.to_matrix)
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),
    (r"token_embedding/reverse_embeddings", "lm_head.weight", ((1,), (0,))),
    (rf"{_T}/attention/query/kernel", _QKV, ("part", 0, 0, ((1, 2), (0,)))),
    (rf"{_T}/attention/key/kernel", _QKV, ("part", 1, 0, ((1, 2), (0,)))),
    (rf"{_T}/attention/value/kernel", _QKV, ("part", 2, 0, ((1, 2), (0,)))),
    (rf"{_T}/attention/attention_output/kernel", "model.layers.{}.self_attn.o_proj.weight",
     ((2,), (0, 1))),
    (rf"{_T}/pre_attention_layernorm/scale", "model.layers.{}.input_layernorm.weight", None),
    (rf"{_T}/post_attention_layernorm/scale", "model.layers.{}.post_attention_layernorm.weight",
     None),
    (rf"{_T}/feedforward_gate_dense/kernel", _GATE_UP, ("part", 0, 0, ((1,), (0,)))),
    (rf"{_T}/feedforward_intermediate_dense/kernel", _GATE_UP, ("part", 1, 0, ((1,), (0,)))),
    (rf"{_T}/feedforward_output_dense/kernel", "model.layers.{}.mlp.down_proj.weight",
     ((1,), (0,))),
    (r"sequence_output_layernorm/scale", "model.norm.weight", None),
]


def export_rules(backbone) -> list:
    return list(EXPORT_RULES)


def export_config(b) -> dict:
    """transformers' ``phi3`` config: no sliding window (KerasHub applies none), the rotary
    frequencies unscaled (``rope_scaling_type`` None; the 128k variant's "su" was not verified)."""
    refuse("Phi3Backbone", [] if b.rope_scaling_type is None
           else [f"rope_scaling_type={b.rope_scaling_type!r}"])
    return dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=b.vocabulary_size,
        hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim,
        num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
        num_key_value_heads=b.num_key_value_heads, rms_norm_eps=b.layer_norm_epsilon,
        hidden_act="silu", max_position_embeddings=b.max_sequence_length,
        original_max_position_embeddings=b.pretraining_sequence_length,
        rope_theta=float(b.rope_max_wavelength), rope_scaling=None,
        rope_parameters={"rope_type": "default", "rope_theta": float(b.rope_max_wavelength)},
        sliding_window=None, tie_word_embeddings=False, attention_dropout=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0,
        # not transformers' defaults (Phi-3's 1 / 32,000, past a smaller vocabulary): the
        # tokenizer's, where the export has one (``export.hf_config``)
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def export_tokenizer(tokenizer, to) -> None:
    """Phi-3's SentencePiece model as transformers' ``LlamaTokenizer`` (``tokenizer.model``,
    which transformers converts, its chat markers added tokens kept whole); no BOS / EOS added
    (the chat template writes them). transformers' conversion prepends SentencePiece's "\u2581"
    to the text's first piece only where the text starts with neither a marker nor a space: a
    text that does (a chat turn, "<|user|>...") encodes without ours' lone leading "\u2581"
    (tests/test_hf_export_phi3.py pins it)."""
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    to = Path(to)
    tokenizer.save_assets(str(to))
    (to / "vocabulary.spm").rename(to / "tokenizer.model")
    proto = spm_pb2.ModelProto.FromString((to / "tokenizer.model").read_bytes())
    P = spm_pb2.ModelProto.SentencePiece
    added = {str(i): {"content": p.piece, "special": p.type != P.USER_DEFINED or
                      p.piece == tokenizer.end_token, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False}
             for i, p in enumerate(proto.pieces)
             if p.type in (P.UNKNOWN, P.CONTROL, P.USER_DEFINED)}
    (to / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": tokenizer.start_token,
        "eos_token": tokenizer.end_token, "unk_token": "<unk>",
        "pad_token": tokenizer.id_to_token(tokenizer.pad_token_id),
        "add_bos_token": False, "add_eos_token": False, "legacy": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "added_tokens_decoder": added}, indent=2) + "\n")


PHI3 = Family(
    name="phi3",
    backbone="Phi3Backbone",
    classes=("Phi3CausalLM", "Phi3CausalLMPreprocessor", "Phi3Tokenizer"),
    chat_format="phi3",
    attention={"Phi3Attention": phi3_attention},
    sharding=SHARDING,
    lora=LORA,
    export=Export(export_rules, export_config,
                  "`phi3` (fused qkv_proj / gate_up_proj), no sliding window, unscaled rotary",
                  tokenizer=export_tokenizer),
    decoding=Decoding("attention_cache", "attention_cache_update_index"),
    context_length=4096,  # mini-4k (the 128k variant: 131,072 with its scaled rotary)
    hf_model_types=("phi3",),  # our converter (KerasHub 0.32 has none): model.hf_convert
    short_names={"phi3_mini_4k_it": "phi3_mini_4k_instruct_en"},
    tokenizer="sentencepiece-phi3",
    presets={"phi3_mini_4k": Preset(dict(
        vocabulary_size=32_064, num_layers=32, hidden_dim=3072, intermediate_dim=8192,
        num_query_heads=32, num_key_value_heads=32, layer_norm_epsilon=1e-5,
        max_sequence_length=4096, pretraining_sequence_length=4096), 32_011)},
    tiny={"phi3": dict(vocabulary_size=64, num_layers=2, hidden_dim=32, intermediate_dim=64,
                       num_query_heads=4, num_key_value_heads=2, layer_norm_epsilon=1e-5)},
)
