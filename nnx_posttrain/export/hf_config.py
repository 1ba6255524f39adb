"""Hugging Face ``config.json`` of a KerasHub backbone, for the families and configurations whose
export was verified against ``transformers`` (``export.hf``); anything else is refused by name."""

from __future__ import annotations

from nnx_posttrain import errors

VERIFIED = ("GemmaBackbone", "Gemma3Backbone", "Llama3Backbone", "MistralBackbone",
            "QwenBackbone", "Qwen3Backbone")


class ExportError(errors.ModelError):
    """The model cannot be exported as asked; the message says why."""


def _refuse(family: str, problems: list[str]):
    if problems:
        raise ExportError(f"--format hf: this {family} configuration has no verified Hugging Face "
                          f"export ({'; '.join(problems)}); use --format keras")


def _gemma_config(b) -> dict:
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
        _refuse("GemmaBackbone (Gemma 1)", [
            f"{name} is set (a Gemma 2 feature, without Gemma 2's post norms)"
            for name in ("final_logit_soft_cap", "attention_logit_soft_cap",
                         "use_sliding_window_attention") if getattr(b, name)
        ] + ([] if b.query_head_dim_normalize else
             ["query_head_dim_normalize=False (Gemma 1 scales queries by head_dim)"]))
        return dict(architectures=["GemmaForCausalLM"], model_type="gemma", **common)
    _refuse("GemmaBackbone (Gemma 2)", [] if b.use_post_ffw_norm and b.use_post_attention_norm
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


def _gemma3_config(b) -> dict:
    from keras_hub.src.utils.transformers.export.gemma3 import get_gemma3_config

    _refuse("Gemma3Backbone", [p for p, bad in (
        ("a vision encoder", b.vision_encoder is not None),
        ("an embedding model", getattr(b, "is_embedding_model", False)),
        ("bidirectional attention", getattr(b, "use_bidirectional_attention", False)),
        ("no post-attention / post-feedforward norms (Gemma 3 has both)",
         not (b.use_post_ffw_norm and b.use_post_attention_norm)),
        ("no query / key norms (Gemma 3 has them)", not b.use_query_key_norm),
    ) if bad])
    cfg = get_gemma3_config(b)
    cfg.pop("torch_dtype", None)
    return cfg


def _llama3_config(b) -> dict:
    from keras_hub.src.utils.transformers.export.llama3 import get_llama3_config

    _refuse("Llama3Backbone", [] if b.rope_position_scaling_factor == 1.0
            else [f"rope_position_scaling_factor={b.rope_position_scaling_factor}"])
    cfg = get_llama3_config(b)
    cfg.pop("torch_dtype", None)
    return cfg


def _mistral_config(b) -> dict:
    _refuse("MistralBackbone", [] if getattr(b, "rope_scaling_factor", 1.0) == 1.0
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


def _qwen_config(b) -> dict:
    _refuse("QwenBackbone", [p for p, bad in (
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


def _qwen3_config(b) -> dict:
    _refuse("Qwen3Backbone", [] if b.rope_scaling_factor == 1.0
            else [f"rope_scaling_factor={b.rope_scaling_factor}"])
    window = b.sliding_window_size
    _refuse("Qwen3Backbone", [] if not window or window >= 32768 else [
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


CONFIGS = {"GemmaBackbone": _gemma_config, "Gemma3Backbone": _gemma3_config,
           "Llama3Backbone": _llama3_config, "MistralBackbone": _mistral_config,
           "QwenBackbone": _qwen_config, "Qwen3Backbone": _qwen3_config}


def family(backbone) -> str:
    name = type(backbone).__name__
    if name not in CONFIGS:
        raise ExportError(
            f"--format hf: {name} has no verified Hugging Face export (verified: "
            f"{', '.join(VERIFIED)}); use --format keras")
    return name


def hf_config(backbone, tokenizer=None, dtype: str = "float32") -> dict:
    cfg = CONFIGS[family(backbone)](backbone)
    if tokenizer is not None:
        for key, attr in (("bos_token_id", "start_token_id"), ("eos_token_id", "end_token_id"),
                          ("pad_token_id", "pad_token_id")):
            value = getattr(tokenizer, attr, None)
            if value is not None:
                cfg[key] = int(value)
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return cfg
