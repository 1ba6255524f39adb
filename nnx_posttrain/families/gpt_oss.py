"""GPT-OSS (``GptOssBackbone``, 20b / 120b): the Llama layout's attention with biases and learned
attention sinks, every block's MLP a sparse MoE block (``sparse_moe_block/``: a router Dense
``router/router_dense`` [hidden, experts] with a bias, top-k of its logits then a softmax over
the k, and the experts stacked with biases: gate / up interleaved [E, hidden, 2 x I], down
[E, I, hidden], a clamped SwiGLU between them).

Its Hugging Face export is transformers' ``GptOssForCausalLM`` (``gpt_oss``), written as the
model KerasHub computes, which differs from the published checkpoints' reading of their own
config in two ways (research P2) that the written config states exactly: KerasHub slides its
window on the odd layers (transformers' default ``layer_types``: the even ones), so the export
lists ``layer_types``; and its mask keeps ``W + 1`` keys where transformers keeps
``sliding_window`` keys, so the export's ``sliding_window`` is ``W + 1``. The experts are
written stacked, as transformers holds them (``mlp.experts.gate_up_proj`` and its bias,
``down_proj`` and its bias: the same [E, in, out] layout as KerasHub's); the sinks as
``self_attn.sinks``. KerasHub's converter reads only the published MXFP4 experts, so it does
not read such an export back (transformers does).
"""

from __future__ import annotations

import dataclasses

from nnx_posttrain.families.base import (SELF_ATTENTION_CACHE, TINY_DIMS, Export, ExpertLayer,
                                         Family, MoE, PeftExperts, Preset, refuse)
from nnx_posttrain.families.llama import LORA, SHARDING, llama_like
from nnx_posttrain.families.moe import router_layer

F, T, E = "fsdp", "tensor", "expert"


def gpt_oss_attention(layer, training: bool):
    """``GptOssAttention``: the Llama layout's scaled scores and repeated keys / values, its
    learned attention sinks (the ``sinks`` variable: one logit per query head, appended to the
    scores of every softmax and its probability dropped), and on odd layers a sliding window:
    KerasHub's mask keeps keys ``kv_pos >= q_pos - sliding_window``, W + 1 keys (even layers
    have none). (Transformers' and OpenAI's windows are W keys: beyond 128 positions the two
    models differ, research P2.)"""
    window = layer.sliding_window + 1 if layer.sliding_window else None
    return dataclasses.replace(llama_like(layer, window), sinks=layer.sinks)


def experts_call(layer, project, hidden_states):
    """``GptOssExperts.call`` (``ExpertLayer.call``): gate / up interleaved in one product (plus
    its bias), the gate clamped above and up on both sides at ``limit``, ``(up + 1) * gate *
    sigmoid(alpha * gate)``, then down (plus its bias); [E, tokens, hidden]."""
    from keras import ops

    gate_up = project("gate_up_proj", "th,ehm->etm", hidden_states)
    gate_up = gate_up + layer.gate_up_proj_bias[:, None, :]
    gate = ops.clip(gate_up[..., ::2], -1e9, layer.limit)
    up = ops.clip(gate_up[..., 1::2], -layer.limit, layer.limit)
    hidden = (up + 1) * (gate * ops.sigmoid(gate * layer.alpha))
    return project("down_proj", "etm,emh->eth", hidden) + layer.down_proj_bias[:, None, :]


EXPERTS = ExpertLayer("GptOssExperts", {"gate_up_proj": "gate_up_proj",
                                        "down_proj": "down_proj"}, experts_call)

_L = r"transformer_layer_\d+/sparse_moe_block"
SHARDING_GPT_OSS = SHARDING + (
    (rf"{_L}/router/router_dense/kernel$", (F, None)),
    # experts: gate / up interleaved [E, hidden, 2 x I] (+ bias [E, 2 x I]), down [E, I, hidden]
    (rf"{_L}/experts/gate_up_proj$", (E, F, T)),
    (rf"{_L}/experts/gate_up_proj_bias$", (E, T)),
    (rf"{_L}/experts/down_proj$", (E, T, F)),
    (rf"{_L}/experts/down_proj_bias$", (E, None)),
)

# ----------------------------------------------------------------------------- Hugging Face export
_B = r"transformer_layer_(\d+)"
_A = _B + "/self_attention"
_M = "model.layers.{}"
_RULES = [
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),
    (r"token_embedding/reverse_embeddings", "lm_head.weight", ((1,), (0,))),
    (rf"{_A}/query/kernel", f"{_M}.self_attn.q_proj.weight", ((1, 2), (0,))),
    (rf"{_A}/key/kernel", f"{_M}.self_attn.k_proj.weight", ((1, 2), (0,))),
    (rf"{_A}/value/kernel", f"{_M}.self_attn.v_proj.weight", ((1, 2), (0,))),
    (rf"{_A}/query/bias", f"{_M}.self_attn.q_proj.bias", "flat"),
    (rf"{_A}/key/bias", f"{_M}.self_attn.k_proj.bias", "flat"),
    (rf"{_A}/value/bias", f"{_M}.self_attn.v_proj.bias", "flat"),
    (rf"{_A}/attention_output/kernel", f"{_M}.self_attn.o_proj.weight", ((2,), (0, 1))),
    (rf"{_A}/attention_output/bias", f"{_M}.self_attn.o_proj.bias", None),
    (rf"{_A}/sinks", f"{_M}.self_attn.sinks", None),
    (rf"{_B}/input_layernorm/scale", f"{_M}.input_layernorm.weight", None),
    (rf"{_B}/post_attention_layernorm/scale", f"{_M}.post_attention_layernorm.weight", None),
    (rf"{_B}/sparse_moe_block/router/router_dense/kernel", f"{_M}.mlp.router.weight",
     ((1,), (0,))),
    (rf"{_B}/sparse_moe_block/router/router_dense/bias", f"{_M}.mlp.router.bias", None),
] + [(rf"{_B}/sparse_moe_block/experts/{name}", f"{_M}.mlp.experts.{name}", None)
     for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")] + [
    (r"sequence_output_layernorm/scale", "model.norm.weight", None),
]


def export_rules(backbone) -> list:
    return list(_RULES)


def layer_types(b) -> list[str]:
    """KerasHub's window layers: the odd ones (``GptOssBackbone``), none without a window."""
    return ["sliding_attention" if b.sliding_window and i % 2 == 1 else "full_attention"
            for i in range(b.num_layers)]


def export_config(b) -> dict:
    """``gpt_oss`` as KerasHub computes it: its window layers and W + 1 keys (module doc), its
    YaRN rotary embedding (``original_max_position_embeddings`` 4096, not truncated)."""
    refuse("GptOssBackbone", [p for p, bad in (
        (f"rope_scaling_factor={b.rope_scaling_factor} (below 1: KerasHub's YaRN scales the "
         "attention by 0.1 ln(factor) + 1 there, transformers' does not)",
         b.rope_scaling_factor < 1.0),
    ) if bad])
    window = b.sliding_window + 1 if b.sliding_window else None
    return dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=b.vocabulary_size,
        hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim,
        num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
        num_key_value_heads=b.num_key_value_heads,
        head_dim=b.head_dim or b.hidden_dim // b.num_query_heads,
        num_local_experts=b.num_experts, num_experts_per_tok=b.top_k,
        rms_norm_eps=b.layer_norm_epsilon, sliding_window=window, layer_types=layer_types(b),
        rope_parameters=dict(rope_type="yarn", rope_theta=b.rope_max_wavelength,
                             factor=float(b.rope_scaling_factor), beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
        attention_bias=True, attention_dropout=0.0, hidden_act="silu", swiglu_alpha=1.702,
        swiglu_limit=7.0, router_aux_loss_coef=0.9, output_router_logits=False,
        max_position_embeddings=int(4096 * b.rope_scaling_factor), tie_word_embeddings=False)


GPT_OSS = Family(
    name="gpt_oss",
    backbone="GptOssBackbone",
    classes=("GptOssCausalLM", "GptOssCausalLMPreprocessor", "GptOssTokenizer"),
    chat_format="harmony",
    attention={"GptOssAttention": gpt_oss_attention},
    sharding=SHARDING_GPT_OSS,
    lora={"attention": LORA["attention"], "mlp": tuple(EXPERTS.kernels)},
    export=Export(export_rules, export_config,
                  "`gpt_oss` (`GptOssForCausalLM`) as KerasHub computes it: attention sinks, "
                  "stacked experts with biases, its window layers and W + 1 keys, YaRN",
                  # expert LoRA: transformers' [E, in, out] experts are KerasHub's kernels
                  experts=PeftExperts("mlp.experts", ("gate_up_proj", "down_proj"), {
                      "gate_up_proj": ("gate_up_proj", 0), "down_proj": ("down_proj", 0)})),
    decoding=SELF_ATTENTION_CACHE,
    context_length=131_072,
    hf_model_types=("gpt_oss",),  # KerasHub reads the published MXFP4 checkpoints only
    short_names={"gpt_oss_20b": "gpt_oss_20b_en"},
    tokenizer="bpe-gpt_oss",
    presets={"gpt_oss_20b": Preset(dict(
        vocabulary_size=201_088, num_layers=24, num_query_heads=64, num_key_value_heads=8,
        hidden_dim=2880, intermediate_dim=2880, num_experts=32, top_k=4, head_dim=64,
        sliding_window=128, rope_max_wavelength=150_000,
        rope_scaling_factor=32.0,  # YaRN: the published config's rope_scaling (research P2c)
        layer_norm_epsilon=1e-5), 200_019)},
    tiny={"gpt_oss": dict(TINY_DIMS, num_key_value_heads=2, num_experts=4, top_k=2,
                          intermediate_dim=16, head_dim=8, sliding_window=4)},
    # top-k of the router's logits, softmax over the k; gpt-oss-20b's config.json:
    # router_aux_loss_coef 0.9 (KerasHub's backbone keeps none)
    quantize_skip=("router_dense",),
    moe=MoE(router_layer("sparse_moe_block", "router", "router_dense"), lambda b: int(b.top_k),
            lambda b: 0.9, expert_layer=EXPERTS),
)
