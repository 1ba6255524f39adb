"""Gemma 4 (``Gemma4Backbone``, text): E2B / E4B (per-layer inputs, KV-shared trailing layers),
31B, and the 26B-A4B mixture of experts (a dense MLP and 128 experts side by side: its
router logits for the load-balancing loss, coefficient 0 as TRL reads its config; its experts
exported fused as transformers holds them, and adaptable by LoRA: ``EXPERTS``).

Gemma's layout (``decoder_block_i/attention/...``: q / k / v [heads, hidden, head_dim]) with
scale 1.0 (q / k norms instead), a scale-free value norm, local layers over a sliding window and
global layers with their own head dim (and, 26B / 31B, fewer kv heads whose keys are the values),
proportional partial rotary embeddings, a per-layer output scalar. The backbone takes
``position_ids``. Its decoder blocks read the MLP's kernels as arrays (``ops.matmul(x,
layer.kernel)``): LoRA on them works (``kernel`` includes the adapter), int8 would multiply the
raw int8 kernel without its scale, so they stay in the model's dtype (``quantize_skip``).
"""

from __future__ import annotations

from nnx_posttrain.families.base import (
    Decoding,
    ExpertLayer,
    Export,
    Family,
    LayerSpec,
    MoE,
    PeftExperts,
    Preset,
    refuse,
)
from nnx_posttrain.families import gemma4_vision, image_processors
from nnx_posttrain.families.gemma import SHARDING as GEMMA_SHARDING
from nnx_posttrain.families.gemma import vision_tokenizer

F, T, E = "fsdp", "tensor", "expert"


def attention(layer, training: bool) -> LayerSpec:
    """``Gemma4TextAttention``: scale 1.0 (its q / k norms replace 1 / sqrt(head_dim)), keys not
    repeated, a soft cap where set, the window on local layers (the decoder block's mask)."""
    window = layer.sliding_window_size if layer.use_sliding_window_attention else None
    return LayerSpec(1.0, layer.logit_soft_cap or None, window)


def layer_inputs(backbone, token_ids, x, vision_mask=None) -> list[dict]:
    """Each decoder block's ``per_layer_input`` (E2B / E4B), as the backbone computes it: the
    block's slice of the per-layer token embedding (scaled by sqrt(width)) and of the projection
    of the scaled embeddings ``x`` (scaled by 1 / sqrt(hidden), then normalised), summed, times
    1 / sqrt(2). Image tokens (``vision_mask``: a prompt with images, whose ``x`` holds the
    image embeddings) read the per-layer embedding of id 0, padding, as KerasHub's backbone
    (and transformers') reads them. No keyword where the model has no per-layer inputs."""
    from keras import ops

    width = int(backbone.hidden_size_per_layer_input or 0)
    if not width:
        return [{} for _ in range(backbone.num_layers)]
    if vision_mask is not None:
        token_ids = ops.where(ops.cast(vision_mask, "bool"), ops.zeros_like(token_ids), token_ids)
    emb = ops.cast(backbone.per_layer_token_embedding(token_ids), x.dtype)
    emb = emb * ops.cast(float(width) ** 0.5, x.dtype)
    proj = backbone.per_layer_model_projection(x)
    proj = proj * ops.cast(float(backbone.hidden_dim) ** -0.5, proj.dtype)
    out = []
    for i in range(backbone.num_layers):
        part = slice(i * width, (i + 1) * width)
        normed = backbone.per_layer_projection_norm(proj[:, :, part])
        out.append({"per_layer_input": (normed + emb[:, :, part]) * ops.cast(2.0 ** -0.5,
                                                                             proj.dtype)})
    return out


# The sampler's cached decoding: each block's cache of its own shape (global layers: their head
# dim and, K=V, their kv heads), the KV-shared trailing blocks reading an earlier block's cache
# (``shared_kv``: KerasHub's own keyword), the per-layer inputs
DECODING = Decoding(
    "cache", "cache_update_index", embed_scale=True,
    layout=lambda block: (int(block.attention.effective_num_kv_heads),
                          int(block.attention.head_dim)),
    kv_source=lambda block: block.kv_shared_layer_index if block.is_kv_shared_layer else None,
    shared_kw="shared_kv", layer_inputs=layer_inputs)


SHARDING = GEMMA_SHARDING + (
    # per-layer inputs (E2B / E4B): a [vocab, layers x width] table, its projection [hidden,
    # layers x width], each block's gate [hidden, width] and projection [width, hidden]
    (r"per_layer_token_embedding/embeddings$", (T, F)),
    (r"per_layer_model_projection/kernel$", (F, T)),
    (r"decoder_block_\d+/per_layer_input_gate/kernel$", (F, None)),
    (r"decoder_block_\d+/per_layer_up_proj/kernel$", (None, F)),
    # 26B-A4B: the router [hidden, experts] and the experts [E, hidden, I] / [E, I, hidden]
    (r"decoder_block_\d+/moe_router/proj/kernel$", (F, None)),
    (r"decoder_block_\d+/moe_expert_bank/(gate_proj|up_proj)$", (E, F, T)),
    (r"decoder_block_\d+/moe_expert_bank/down_proj$", (E, T, F)),
)

_L = r"(\d+)"
_B = rf"decoder_block_{_L}"
_RULES = [
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),
    (r"per_layer_token_embedding/embeddings", "model.embed_tokens_per_layer.weight", None),
    (r"per_layer_model_projection/kernel", "model.per_layer_model_projection.weight", ((1,), (0,))),
    (r"per_layer_projection_norm/scale", "model.per_layer_projection_norm.weight", None),
    (rf"{_B}/layer_scalar", "model.layers.{}.layer_scalar", "flat"),
    (rf"{_B}/pre_attention_norm/scale", "model.layers.{}.input_layernorm.weight", None),
    (rf"{_B}/post_attention_norm/scale", "model.layers.{}.post_attention_layernorm.weight", None),
    (rf"{_B}/pre_ffw_norm/scale", "model.layers.{}.pre_feedforward_layernorm.weight", None),
    (rf"{_B}/post_ffw_norm/scale", "model.layers.{}.post_feedforward_layernorm.weight", None),
    (rf"{_B}/attention/query/kernel", "model.layers.{}.self_attn.q_proj.weight", ((0, 2), (1,))),
    (rf"{_B}/attention/key/kernel", "model.layers.{}.self_attn.k_proj.weight", ((0, 2), (1,))),
    (rf"{_B}/attention/value/kernel", "model.layers.{}.self_attn.v_proj.weight", ((0, 2), (1,))),
    (rf"{_B}/attention/query_norm/scale", "model.layers.{}.self_attn.q_norm.weight", None),
    (rf"{_B}/attention/key_norm/scale", "model.layers.{}.self_attn.k_norm.weight", None),
    (rf"{_B}/attention/attention_output/kernel", "model.layers.{}.self_attn.o_proj.weight", ((2,), (0, 1))),
    (rf"{_B}/ffw_gating/kernel", "model.layers.{}.mlp.gate_proj.weight", ((1,), (0,))),
    (rf"{_B}/ffw_gating_2/kernel", "model.layers.{}.mlp.up_proj.weight", ((1,), (0,))),
    (rf"{_B}/ffw_linear/kernel", "model.layers.{}.mlp.down_proj.weight", ((1,), (0,))),
    (rf"{_B}/per_layer_input_gate/kernel", "model.layers.{}.per_layer_input_gate.weight", ((1,), (0,))),
    (rf"{_B}/per_layer_up_proj/kernel", "model.layers.{}.per_layer_projection.weight", ((1,), (0,))),
    (rf"{_B}/post_per_layer_input_norm/scale", "model.layers.{}.post_per_layer_input_norm.weight", None),
    (r"final_normalization/scale", "model.norm.weight", None),
]
# 26B-A4B's MoE path (transformers' ``Gemma4TextDecoderLayer`` with ``enable_moe_block``): its
# norms, the router (its per-dimension ``scale``, ``proj``, and the per-expert output scale,
# which KerasHub's expert bank applies to each expert's output and transformers' router to its
# weight: the same product), the experts fused as transformers holds them: gate | up
# [E, 2 x I, hidden] (KerasHub's gate and up [E, hidden, I], each transposed, concatenated),
# down [E, hidden, I] (KerasHub's [E, I, hidden], transposed)
_T = ("transpose", (0, 2, 1))
_MOE_RULES = [
    (rf"{_B}/post_ffw_norm_dense/scale", "model.layers.{}.post_feedforward_layernorm_1.weight", None),
    (rf"{_B}/pre_ffw_norm_moe/scale", "model.layers.{}.pre_feedforward_layernorm_2.weight", None),
    (rf"{_B}/post_ffw_norm_moe_path/scale", "model.layers.{}.post_feedforward_layernorm_2.weight", None),
    (rf"{_B}/moe_router/per_dim_scale", "model.layers.{}.router.scale", None),
    (rf"{_B}/moe_router/proj/kernel", "model.layers.{}.router.proj.weight", ((1,), (0,))),
    (rf"{_B}/moe_expert_bank/per_expert_scale", "model.layers.{}.router.per_expert_scale", None),
    (rf"{_B}/moe_expert_bank/gate_proj", "model.layers.{}.experts.gate_up_proj", ("part", 0, 1, _T)),
    (rf"{_B}/moe_expert_bank/up_proj", "model.layers.{}.experts.gate_up_proj", ("part", 1, 1, _T)),
    (rf"{_B}/moe_expert_bank/down_proj", "model.layers.{}.experts.down_proj", _T),
]


def experts_call(layer, project, x, dispatch_weights):
    """``Gemma4MoEBlock.call`` (``ExpertLayer.call``): every expert's gate and up products, the
    tanh GELU of the gate in float32, down, each expert's output scale, combined by the router's
    dispatch weights [tokens, E]; [tokens, hidden]."""
    import keras
    from keras import ops

    dtype = x.dtype
    gate = project("gate_proj", "th,ehi->eti", x)
    up = project("up_proj", "th,ehi->eti", x)
    gate = ops.cast(keras.activations.gelu(ops.cast(gate, "float32"), approximate=True), dtype)
    out = project("down_proj", "eti,eih->eth", gate * up)
    out = out * ops.reshape(ops.cast(layer.per_expert_scale, dtype), (layer.num_experts, 1, 1))
    weights = ops.transpose(ops.cast(dispatch_weights, dtype), (1, 0))
    return ops.sum(out * weights[:, :, None], axis=0)


EXPERTS = ExpertLayer("Gemma4MoEBlock", {k: k for k in ("gate_proj", "up_proj", "down_proj")},
                      experts_call)


def export_rules(backbone) -> list:
    """The text model's names (26B-A4B's experts too); with a vision encoder, ``gemma4_vision``'s."""
    rules = list(_RULES) + (list(_MOE_RULES) if backbone.enable_moe_block else [])
    if backbone.vision_encoder is None:
        return rules
    return gemma4_vision.rules(rules)


def config(b) -> dict:
    """``gemma4_text``: KerasHub's own writer, with what transformers 5.24 needs to compute the
    same model (research P10): the global layers' rotary type ``proportional`` and, where global
    layers have their own kv heads, ``attention_k_eq_v`` (and no global kv-head count otherwise,
    which KerasHub's converter would read as K=V layers)."""
    from keras_hub.src.utils.transformers.export.gemma4 import get_gemma4_config

    refuse("Gemma4Backbone", [p for p, bad in (
        ("an audio encoder", b.audio_encoder is not None),
        ("bidirectional attention (an embedding model)", b.use_bidirectional_attention),
        (f"rope scaling factors {b.local_rope_scaling_factor} / {b.global_rope_scaling_factor}",
         (b.local_rope_scaling_factor, b.global_rope_scaling_factor) != (1.0, 1.0)),
        ("KV-shared layers without per-layer inputs (transformers 5.24 cannot build it)",
         b.num_kv_shared_layers and not b.hidden_size_per_layer_input),
    ) if bad])
    cfg = get_gemma4_config(b, include_lm_head=True)
    cfg = dict(cfg.get("text_config", cfg))  # a vision model's: its text part
    cfg.pop("torch_dtype", None)
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    cfg["rope_parameters"]["full_attention"]["rope_type"] = "proportional"
    cfg["rope_parameters"]["sliding_attention"]["rope_type"] = "default"
    # global layers with their own kv heads are K=V layers (KerasHub reads the key as that)
    cfg["attention_k_eq_v"] = b.num_global_key_value_heads is not None
    cfg["num_global_key_value_heads"] = b.num_global_key_value_heads
    cfg["max_position_embeddings"] = 262_144
    cfg["tie_word_embeddings"] = True
    return cfg if b.vision_encoder is None else gemma4_vision.config(b, cfg)


# The text part of Gemma 4 E2B / E4B (google/gemma-4-E2B / E4B config.json, as KerasHub's
# converter reads it): what the two share, then each one's own
_E = dict(vocabulary_size=262_144, image_size=None, num_query_heads=8, head_dim=256,
          global_head_dim=512, final_logit_soft_cap=30.0, sliding_window_size=512,
          hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144,
          global_rope_partial_rotary_factor=0.25, global_rope_wavelength=1_000_000.0,
          local_rope_wavelength=10_000.0)
E2B = dict(_E, num_layers=35, hidden_dim=1536, intermediate_dim=6144, num_key_value_heads=1,
           num_kv_shared_layers=20, use_double_wide_mlp=True, sliding_window_pattern=5)
E4B = dict(_E, num_layers=42, hidden_dim=2560, intermediate_dim=10_240, num_key_value_heads=2,
           num_kv_shared_layers=18, use_double_wide_mlp=False, sliding_window_pattern=6)

# 26B-A4B (google/gemma-4-26B-A4B config.json's text part): a dense MLP and 128 experts (top 8),
# global layers with 2 kv heads whose keys are the values, no per-layer inputs
A4B = dict(vocabulary_size=262_144, image_size=None, num_layers=30, num_query_heads=16,
           num_key_value_heads=8, hidden_dim=2816, intermediate_dim=2112, head_dim=256,
           global_head_dim=512, final_logit_soft_cap=30.0, sliding_window_size=1024,
           sliding_window_pattern=6, num_global_key_value_heads=2, enable_moe_block=True,
           num_experts=128, expert_intermediate_dim=704, num_experts_per_token=8,
           global_rope_partial_rotary_factor=0.25, global_rope_wavelength=1_000_000.0,
           local_rope_wavelength=10_000.0, use_vision_bidirectional_attention=True)

_TINY = dict(vocabulary_size=97, image_size=None, num_layers=6, num_query_heads=4,
             num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8,
             global_head_dim=16, sliding_window_size=8, sliding_window_pattern=3,
             final_logit_soft_cap=30.0, global_rope_partial_rotary_factor=0.25)

GEMMA4 = Family(
    name="gemma4",
    backbone="Gemma4Backbone",
    classes=("Gemma4CausalLM", "CausalLMPreprocessor", "Gemma4Tokenizer"),
    chat_format="gemma4",
    attention={"Gemma4TextAttention": attention},
    sharding=SHARDING,
    lora={"attention": ("query", "key", "value", "attention_output"),
          "mlp": ("ffw_gating", "ffw_gating_2", "ffw_linear", *EXPERTS.kernels)},
    export=Export(export_rules, config,
                  "text (`gemma4_text`): per-layer inputs, KV-shared layers, global layers with "
                  "their own head dim and kv heads (keys = values), 26B-A4B's experts (fused "
                  "gate | up); with its vision encoder (`gemma4`: `Gemma4ForConditionalGeneration`, "
                  "vision tower and `embed_vision`; logits with images checked)",
                  tokenizer=vision_tokenizer,
                  image_tokens=("image_token_id", "boi_token_id", "eoi_token_id"),
                  processor=image_processors.gemma4,
                  # expert LoRA: transformers' gate_up_proj [E, 2 x I, hidden], down_proj
                  experts=PeftExperts("experts", ("gate_up_proj", "down_proj"), {
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", 0)})),
    decoding=DECODING,
    context_length=262_144,  # 26B / 31B (E2B / E4B: 131,072)
    hf_model_types=("gemma4_text", "gemma4"),
    short_names={"gemma4_2b": "gemma4_2b", "gemma4_4b": "gemma4_4b",
                 "gemma4_2b_it": "gemma4_instruct_2b", "gemma4_4b_it": "gemma4_instruct_4b"},
    tokenizer="sentencepiece-gemma4",
    presets={
        "gemma4_2b": Preset(E2B, 262_144),
        "gemma4_4b": Preset(E4B, 262_144),
        "gemma4_26b_a4b": Preset(A4B, 262_144),
    },
    tiny={
        # E2B / E4B-like: per-layer inputs, KV sharing, double-wide MLP on the shared layers
        "gemma4": dict(_TINY, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                       use_double_wide_mlp=True),
        # 31B-like: global layers with one kv head whose keys are the values
        "gemma4_kv": dict(_TINY, num_global_key_value_heads=1),
        # 26B-A4B-like: a dense MLP and experts side by side, K=V global layers
        "gemma4_moe": dict(_TINY, num_layers=3, intermediate_dim=48, num_global_key_value_heads=1,
                           enable_moe_block=True, num_experts=4, expert_intermediate_dim=16,
                           num_experts_per_token=2),
    },
    # 26B-A4B's router: its Dense ``proj`` gives the logits (softmax, top-k, renormalised, then
    # per-expert scales); transformers' Gemma 4 config has no router_aux_loss_coef, so TRL
    # leaves the loss off: coefficient 0, aux_loss and tokens per expert still logged
    moe=MoE(lambda block: getattr(getattr(block, "moe_router", None), "proj", None),
            lambda b: int(b.num_experts_per_token), lambda b: 0.0,
            lambda b: int(b.num_experts) if b.enable_moe_block else 0, expert_layer=EXPERTS),
    # the MLP the blocks read as arrays; 26B-A4B's router (``moe_router/proj``): int8 would flip
    # which experts a token goes to
    quantize_skip=("ffw_gating", "ffw_gating_2", "ffw_linear", "proj"),
)
