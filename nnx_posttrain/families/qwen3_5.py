"""Qwen 3.5 dense (``Qwen3_5Backbone``, text tower): decoder blocks ``transformer_layer_i`` of
two kinds, by ``layer_types``:

- ``full_attention``: ``self_attention`` (``Qwen3_5Attention``), grouped-query attention with
  Qwen 3's q / k norms (``(1 + scale)`` RMS norms), a partial rotary embedding (the first
  ``partial_rotary_factor`` of each head; 0.25 in the released models) and a sigmoid output gate
  (the query projection gives each head ``2 x head_dim``: the query, then the gate). The norms
  and the rotation happen before ``_compute_attention``, the gate after it, so the attention
  kernels (``model.attention``) compute the seam itself: rotated queries against keys repeated
  per group, scores scaled by ``1 / sqrt(head_dim)``. No sliding window: the published model
  (transformers' ``Qwen3_5TextConfig``) has none, and KerasHub on JAX drops its
  ``sliding_window_size`` (its fused branch ignores it);
- ``linear_attention``: ``linear_attn`` (``Qwen3_5GatedDeltaNet``), the Gated DeltaNet: q / k / v
  from one projection through a causal depthwise convolution, a gated delta-rule recurrence
  over a state [value heads, key dim, value dim] per row, a gated RMS norm and ``out_proj``.
  It has no attention to replace: these blocks stay with KerasHub's code
  (``Family.recurrent``), but for the delta rule of the training forward, computed as a scan
  over chunks (``gated_delta_net``, ``Family.recurrent_call``). Its state runs along the whole
  row: packed rows and shared-prompt pairs, whose examples it would cross, are refused
  (``model.hidden_states``) or not built (``algorithms.shared_prompt``). A padding position's
  input is zeroed by the layer itself, which leaves a zero state zero: left padding is exact.

The released 0.8B to 27B checkpoints are vision-language models; the text tower is what this
family trains (a vision tower stays with KerasHub's attention, ``model.attention``).
"""

from __future__ import annotations

from nnx_posttrain.families import qwen3_5_vision
from nnx_posttrain.families.base import Decoding, Export, Family, Preset, refuse
from nnx_posttrain.families.gated_delta_net import delta_net_call
from nnx_posttrain.families.llama import SHARDING as LLAMA_SHARDING
from nnx_posttrain.families.llama import llama_like
from nnx_posttrain.families.qwen import chatml_tokenizer

F, T = "fsdp", "tensor"
_B = r"transformer_layer_\d+"


def qwen3_5_attention(layer, training: bool):
    """``Qwen3_5Attention``: the Llama family's seam (keys / values repeated per group, scores
    scaled by ``_inv_norm_factor``), no window (see the module's docstring)."""
    return llama_like(layer, None)


def chat_format(backbone) -> str:
    """Qwen 3.5's published templates (``chat_templates/qwen3.5*.jinja``): Qwen3.5-0.8B and 2B
    (hidden size 1,024 and 2,048) ship the one whose generation prompt closes an empty think
    block (``qwen3.5-nothink``), 4B and larger (2,560 and wider) the one that opens a think
    block (``qwen3.5``); the rendered conversations are the same. Read from a class name alone
    (before loading): ``qwen3.5``. ``--chat-format`` chooses the other."""
    hidden = getattr(backbone, "hidden_dim", None)
    return "qwen3.5-nothink" if hidden is not None and hidden <= 2048 else "qwen3.5"


def empty_state(block, batch: int) -> tuple:
    """A Gated DeltaNet block's initial state, as KerasHub's ``Qwen3_5CausalLM`` builds it: the
    convolution's last inputs [B, channels, kernel - 1] (zeros: the causal padding) and the
    delta-rule state [B, value heads, key dim, value dim] in float32."""
    import jax.numpy as jnp

    layer = block._linear_attn
    channels = 2 * layer.key_dim + layer.value_dim
    return (jnp.zeros((batch, channels, layer.conv_kernel_size - 1), layer.compute_dtype),
            jnp.zeros((batch, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim),
                      jnp.float32))


def state_step(block, x, state: tuple, index, mask=None) -> tuple:
    """A Gated DeltaNet block of the sampler (``Decoding.state_step``): KerasHub's block with
    its state as its cache (the prompt pass: its chunked delta rule from that state; a
    decoding step: one recurrent step), returning (output, (conv state, delta-rule state)).

    The prompt pass's left pads (``mask``) are zeroed at the layer's input, which leaves the
    zero state zero (no bias anywhere before the recurrence: zero queries, keys and values, a
    zero update), so a row's state is its own tokens'. KerasHub's own masked branch would pick
    its convolution state at the row's length, as for right padding: the mask is applied here
    instead, for the duration of the call (the layer's ``call`` shadowed on the instance)."""
    layer = block._linear_attn
    original = layer.call

    def masked(hidden_states, attention_mask=None, **kwargs):
        keep = mask[..., None].astype(hidden_states.dtype)
        return original(hidden_states * keep, attention_mask=None, **kwargs)

    if mask is not None:
        object.__setattr__(layer, "call", masked)
    try:
        out, conv, recurrent = block(x, self_attention_cache=state,
                                     self_attention_cache_update_index=index)
    finally:
        if mask is not None:
            object.__delattr__(layer, "call")
    return out, (conv, recurrent)


_T = r"transformer_layer_(\d+)"
_L = "model.layers.{}"
_EXPORT_RULES = [  # Keras path -> transformers' Qwen3_5ForCausalLM name, layout (export.hf)
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),
    (r"token_embedding/reverse_embeddings", "lm_head.weight", ((1,), (0,))),
    (rf"{_T}/self_attention/(query|key|value)/kernel", None, ((1, 2), (0,))),
    (rf"{_T}/self_attention/query_norm/scale", _L + ".self_attn.q_norm.weight", None),
    (rf"{_T}/self_attention/key_norm/scale", _L + ".self_attn.k_norm.weight", None),
    (rf"{_T}/self_attention/attention_output/kernel", _L + ".self_attn.o_proj.weight",
     ((2,), (0, 1))),
    (rf"{_T}/linear_attn/(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)/kernel", None,
     ((1,), (0,))),
    (rf"{_T}/linear_attn/conv1d_kernel", _L + ".linear_attn.conv1d.weight", ("axis", 1)),
    (rf"{_T}/linear_attn/(dt_bias|A_log)", None, None),
    (rf"{_T}/linear_attn/norm/scale", _L + ".linear_attn.norm.weight", None),
    (rf"{_T}/input_layernorm/scale", _L + ".input_layernorm.weight", None),
    (rf"{_T}/post_attention_layernorm/scale", _L + ".post_attention_layernorm.weight", None),
    (rf"{_T}/feedforward_gate_dense/kernel", _L + ".mlp.gate_proj.weight", ((1,), (0,))),
    (rf"{_T}/feedforward_intermediate_dense/kernel", _L + ".mlp.up_proj.weight", ((1,), (0,))),
    (rf"{_T}/feedforward_output_dense/kernel", _L + ".mlp.down_proj.weight", ((1,), (0,))),
    (r"sequence_output_layernorm/scale", "model.norm.weight", None),
]
_NAMED = {"query": "self_attn.q_proj.weight", "key": "self_attn.k_proj.weight",
          "value": "self_attn.v_proj.weight", "dt_bias": "linear_attn.dt_bias",
          "A_log": "linear_attn.A_log"}


def export_rules(backbone) -> list:
    """The weight names of transformers' ``Qwen3_5ForCausalLM`` (the text tower): one rule per
    sublayer where the Keras name is a regex group (q / k / v, the DeltaNet's projections and
    gates), each group's own HF name; with a vision encoder, ``Qwen3_5ForConditionalGeneration``'s
    (``qwen3_5_vision``)."""
    rules = text_rules()
    return rules if backbone.vision_encoder is None else qwen3_5_vision.rules(rules)


def text_rules() -> list:
    rules = []
    for pattern, name, layout in _EXPORT_RULES:
        if name is not None:
            rules.append((pattern, name, layout))
            continue
        group = pattern.split("(", 2)[2].split(")")[0]
        for part in group.split("|"):
            hf = _NAMED.get(part, f"linear_attn.{part}.weight")
            rules.append((pattern.replace(f"({group})", part), f"{_L}.{hf}", layout))
    return rules


def text_config(b, vision: bool = False) -> dict:
    """The keys transformers' Qwen 3.5 text configs share (``Qwen3_5TextConfig``,
    ``Qwen3_5MoeTextConfig``: all but the MLP's), refusing what was not verified: a vision
    encoder and M-RoPE sections (unless ``vision``: the dense family's vision-language export,
    ``qwen3_5_vision``, which needs both)."""
    refuse(type(b).__name__, [p for p, bad in (
        (f"rope_scaling_factor={b.rope_scaling_factor}", b.rope_scaling_factor != 1.0),
        ("a vision encoder", b.vision_encoder is not None and not vision),
        ("a vision encoder without mrope_section", b.vision_encoder is not None and vision
         and not b.mrope_section),
        (f"mrope_section={b.mrope_section}", b.mrope_section is not None and not vision))
        if bad])
    return dict(
        vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim, num_hidden_layers=b.num_layers,
        num_attention_heads=b.num_query_heads, num_key_value_heads=b.num_key_value_heads,
        head_dim=b.head_dim, rms_norm_eps=b.layer_norm_epsilon, hidden_act="silu",
        attention_bias=False, attention_dropout=0.0, tie_word_embeddings=b.tie_word_embeddings,
        layer_types=list(b.layer_types), max_position_embeddings=262_144,
        rope_parameters=dict(rope_type="default", rope_theta=b.rope_max_wavelength,
                             partial_rotary_factor=b.partial_rotary_factor),
        linear_num_key_heads=b.linear_num_key_heads,
        linear_num_value_heads=b.linear_num_value_heads,
        linear_key_head_dim=b.linear_key_head_dim, linear_value_head_dim=b.linear_value_head_dim,
        linear_conv_kernel_dim=b.linear_conv_kernel_dim)


def export_config(b) -> dict:
    """transformers' ``Qwen3_5TextConfig`` (``qwen3_5_text``: ``Qwen3_5ForCausalLM``); with a
    vision encoder, ``Qwen3_5Config`` (``qwen3_5``: ``Qwen3_5ForConditionalGeneration``)."""
    vision = b.vision_encoder is not None
    text = dict(text_config(b, vision), architectures=["Qwen3_5ForCausalLM"],
                model_type="qwen3_5_text", intermediate_size=b.intermediate_dim)
    return qwen3_5_vision.config(b, text) if vision else text


SHARDING = LLAMA_SHARDING + (
    # the Gated DeltaNet: q / k / v in one projection [hidden, 2 key dim + value dim] (its
    # channels also the depthwise convolution's [channels, kernel]), the output gate z [hidden,
    # value dim], the per-head gates a / b [hidden, value heads], out_proj [value dim, hidden]
    (rf"{_B}/linear_attn/(in_proj_qkv|in_proj_z)/kernel$", (F, T)),
    (rf"{_B}/linear_attn/(in_proj_a|in_proj_b)/kernel$", (F, None)),
    (rf"{_B}/linear_attn/conv1d_kernel$", (T, None)),
    (rf"{_B}/linear_attn/out_proj/kernel$", (T, F)),
)

# The tiny configuration: a Gated DeltaNet block, then a full-attention block (grouped heads,
# q / k norms, half the head rotated, the output gate); two key heads shared by four value heads
_TINY = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2,
             head_dim=8, hidden_dim=32, intermediate_dim=48,
             layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.5,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4)

# Qwen3.5-0.8B's text tower (its config.json's text_config): 24 layers, every 4th full attention
_0_8B = dict(vocabulary_size=248_320, num_layers=24, num_query_heads=8, num_key_value_heads=2,
             head_dim=256, hidden_dim=1024, intermediate_dim=3584,
             layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                          for i in range(24)],
             partial_rotary_factor=0.25, rope_max_wavelength=10_000_000, layer_norm_epsilon=1e-6,
             tie_word_embeddings=True, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)

QWEN3_5 = Family(
    name="qwen3_5",
    backbone="Qwen3_5Backbone",
    classes=("Qwen3_5CausalLM", "Qwen3_5CausalLMPreprocessor", "Qwen3_5Tokenizer"),
    chat_format=chat_format,
    attention={"Qwen3_5Attention": qwen3_5_attention},
    sharding=SHARDING,
    lora={"attention": ("query", "key", "value", "attention_output", "in_proj_qkv", "in_proj_z",
                        "out_proj"),
          "mlp": ("feedforward_gate_dense", "feedforward_intermediate_dense",
                  "feedforward_output_dense")},
    export=Export(export_rules, export_config,
                  "Qwen 3.5 dense, text tower (`qwen3_5_text`, `Qwen3_5ForCausalLM`); with its "
                  "vision encoder (`qwen3_5`: `Qwen3_5ForConditionalGeneration`, logits with "
                  "images checked from the same patches)",
                  tokenizer=chatml_tokenizer,
                  image_tokens=("image_token_id", "vision_start_token_id",
                                "vision_end_token_id")),
    decoding=Decoding("self_attention_cache", "self_attention_cache_update_index",
                      state=empty_state, state_step=state_step),
    context_length=262_144,  # Qwen 3.5's max_position_embeddings
    hf_model_types=("qwen3_5",),
    short_names={"qwen3_5_0.8b": "qwen3_5_0.8b", "qwen3_5_0.8b_base": "qwen3_5_0.8b_base"},
    tokenizer="bpe-qwen3_5",
    presets={"qwen3_5_0.8b": Preset(_0_8B, 248_070)},  # tokenizer.json's 248,070 tokens
    tiny={"qwen3_5": _TINY},
    recurrent=("Qwen3_5GatedDeltaNet",),
    recurrent_call=delta_net_call,
)
