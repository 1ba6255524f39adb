"""The Llama-layout mixtures of experts: Qwen3-MoE (``Qwen3MoeBackbone``, 30B-A3B, 235B-A22B),
Mixtral (``MixtralBackbone``, 8x7B); GPT-OSS (``families.gpt_oss``) reuses their routing helpers.

Attention and norms are the Llama layout (``llama.SHARDING``; Qwen 3's q / k norms); each block's
MLP is a sparse MoE block (``transformer_layer_i/<name>_sparse_moe_block_j/``): a router Dense
``sparse_feedforward_gate_dense`` [hidden, experts] (softmax, top-k, renormalised) and the
experts stacked in raw weights (Qwen3-MoE: gate|up [E, hidden, 2 x I] and down [E, I, hidden];
Mixtral: gate, up [E, hidden, I], down [E, I, hidden]). KerasHub computes every expert for every
token and drops the router logits (research P6, P7): ``model.router`` captures them for the
load-balancing loss (``losses.router``). The experts' leading dimension is sharded over the
``expert`` mesh axis (``--mesh.expert``, ``sharding``). The stacked experts are not layers: LoRA
on them is per-expert factors in their einsum (``model.expert_lora``, ``ExpertLayer``: each
family's experts computation), int8 leaves the experts in float.
"""

from __future__ import annotations

import re

from nnx_posttrain.families.base import (SELF_ATTENTION_CACHE, TINY_DIMS, ExpertLayer, Export,
                                         Family, MoE, PeftExperts, Preset, refuse)
from nnx_posttrain.families.llama import LLAMA_RULES, LORA, SHARDING, llama_like
from nnx_posttrain.families.qwen import chatml_tokenizer

F, T, E = "fsdp", "tensor", "expert"


def qwen3_moe_attention(layer, training: bool):
    """``Qwen3MoeAttention``: no window (its ``sliding_window_size`` applies only in the einsum
    branch KerasHub skips on JAX; transformers' Qwen3-MoE has none)."""
    return llama_like(layer, None)


def mixtral_attention(layer, training: bool):
    """``CachedMixtralAttention``: the window of the decoder's banded mask, ``sliding_window``
    (research P1: Mistral's private name would read none)."""
    return llama_like(layer, layer.sliding_window)


_MOE = r"transformer_layer_\d+/\w+_sparse_moe_block(_\d+)?"
SHARDING_MOE = SHARDING + (
    (rf"{_MOE}/sparse_feedforward_gate_dense/kernel$", (F, None)),
    # experts [E, hidden, I] (gate, up; Qwen3-MoE's gate|up) and [E, I, hidden] (down): the
    # experts over the expert axis (--mesh.expert), each one's matrices as a dense MLP's
    (rf"{_MOE}/experts/expert_feedforward_(gate|intermediate)_dense$", (E, F, T)),
    (rf"{_MOE}/experts/expert_feedforward_output_dense$", (E, T, F)),
)
# ----------------------------------------------------------------------------- Hugging Face export
# transformers 5.24 writes (and reads) one tensor per expert: Qwen3-MoE's
# ``mlp.experts.{e}.{gate,up,down}_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1 / w3 / w2``
_BLOCK = r"transformer_layer_(\d+)/\w+_sparse_moe_block(?:_\d+)?"


def expert_rules(b, prefix: str, parts: dict, block: str = _BLOCK) -> list:
    """Per expert and part: (regex of the stacked variable, HF name, ("expert", e, lo, hi));
    ``block``: the regex of the MoE block's path (its layer index the one group)."""
    out = []
    for variable, pieces in parts.items():
        for e in range(b.num_experts):
            out += [(rf"{block}/experts/{variable}", f"model.layers.{{}}.{prefix}.{e}.{name}.weight",
                     ("expert", e, lo, hi)) for name, lo, hi in pieces]
    return out


def qwen3_moe_rules(b) -> list:
    i = b.moe_intermediate_dim
    return LLAMA_RULES + [
        (rf"{_BLOCK}/sparse_feedforward_gate_dense/kernel", "model.layers.{}.mlp.gate.weight",
         ((1,), (0,))),
    ] + expert_rules(b, "mlp.experts", {  # gate | up halves of one stacked kernel
        "expert_feedforward_gate_dense": [("gate_proj", 0, i), ("up_proj", i, 2 * i)],
        "expert_feedforward_output_dense": [("down_proj", 0, b.hidden_dim)]})


def mixtral_rules(b) -> list:
    i = b.intermediate_dim
    return LLAMA_RULES + [
        (rf"{_BLOCK}/sparse_feedforward_gate_dense/kernel",
         "model.layers.{}.block_sparse_moe.gate.weight", ((1,), (0,))),
    ] + expert_rules(b, "block_sparse_moe.experts", {
        "expert_feedforward_gate_dense": [("w1", 0, i)],
        "expert_feedforward_intermediate_dense": [("w3", 0, i)],
        "expert_feedforward_output_dense": [("w2", 0, b.hidden_dim)]})


def _common(b) -> dict:
    return dict(vocab_size=b.vocabulary_size, hidden_size=b.hidden_dim,
                num_hidden_layers=b.num_layers, num_attention_heads=b.num_query_heads,
                num_key_value_heads=b.num_key_value_heads, rms_norm_eps=b.layer_norm_epsilon,
                rope_theta=b.rope_max_wavelength, hidden_act="silu", attention_dropout=0.0,
                num_experts_per_tok=b.top_k)


def qwen3_moe_config(b) -> dict:
    """``qwen3_moe``, with the expert count under both keys: ``num_experts`` (the published
    configs', which KerasHub's converter reads) and ``num_local_experts`` (transformers 5.24's)."""
    refuse("Qwen3MoeBackbone", [p for p, bad in (
        (f"rope_scaling_factor={b.rope_scaling_factor}", b.rope_scaling_factor != 1.0),
        ("dense MLP layers (mlp_only_layers, decoder_sparse_step)",
         list(b.mlp_only_layers or []) or b.decoder_sparse_step != 1),
        (f"sliding_window_size={b.sliding_window_size} (none on JAX, as transformers')",
         b.sliding_window_size and b.sliding_window_size < 32768),
    ) if bad])
    return dict(_common(b), architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                head_dim=b.head_dim, intermediate_size=b.intermediate_dim,
                moe_intermediate_size=b.moe_intermediate_dim, num_experts=b.num_experts,
                num_local_experts=b.num_experts, norm_topk_prob=b.norm_top_k_prob,
                decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=b.router_aux_loss_coefficient, output_router_logits=False,
                use_sliding_window=False, sliding_window=None, attention_bias=False,
                max_position_embeddings=40_960, tie_word_embeddings=b.tie_word_embeddings)


def mixtral_config(b) -> dict:
    return dict(_common(b), architectures=["MixtralForCausalLM"], model_type="mixtral",
                intermediate_size=b.intermediate_dim, num_local_experts=b.num_experts,
                head_dim=b.hidden_dim // b.num_query_heads, sliding_window=b.sliding_window,
                router_aux_loss_coef=b.router_aux_loss_coef, output_router_logits=False,
                router_jitter_noise=0.0, max_position_embeddings=32_768,
                tie_word_embeddings=False)


def gate_up_experts_call(layer, project, hidden_states):
    """``Qwen3MoeExperts.call`` (``ExpertLayer.call``): gate | up in one product,
    ``up * act(gate)``, then down."""
    from keras import ops

    gate, up = ops.split(project("expert_feedforward_gate_dense", "th,ehm->etm", hidden_states),
                         2, axis=-1)
    return project("expert_feedforward_output_dense", "eti,eih->eth", up * layer.activation(gate))


def mixtral_experts_call(layer, project, hidden_states):
    """``MixtralMoeExperts.call`` (``ExpertLayer.call``): ``intermediate * act(gate)`` (the
    activation in float32), then down."""
    from keras import ops

    gate = project("expert_feedforward_gate_dense", "th,ehm->etm", hidden_states)
    gate = ops.cast(layer.activation(ops.cast(gate, "float32")), layer.compute_dtype)
    up = project("expert_feedforward_intermediate_dense", "th,ehm->etm", hidden_states)
    return project("expert_feedforward_output_dense", "eti,eih->eth", up * gate)


def expert_kernels(*names: str) -> dict[str, str]:
    """{kernel name: the experts layer's attribute} of KerasHub's ``_<name>`` weights."""
    return {f"expert_feedforward_{n}_dense": f"_expert_feedforward_{n}_dense" for n in names}


QWEN3_MOE_EXPERTS = ExpertLayer("Qwen3MoeExperts", expert_kernels("gate", "output"),
                                gate_up_experts_call)
# expert LoRA as PEFT adapters: transformers 5.24 holds the experts (which its checkpoints write
# one tensor per expert) as ``mlp.experts.gate_up_proj`` [E, 2 x I, hidden] (gate | up) and
# ``down_proj`` [E, hidden, I]
QWEN3_MOE_PEFT = PeftExperts("mlp.experts", ("gate_up_proj", "down_proj"), {
    "expert_feedforward_gate_dense": ("gate_up_proj", 0),
    "expert_feedforward_output_dense": ("down_proj", 0)})
MIXTRAL_PEFT = PeftExperts("mlp.experts", ("gate_up_proj", "down_proj"), {
    "expert_feedforward_gate_dense": ("gate_up_proj", 0),
    "expert_feedforward_intermediate_dense": ("gate_up_proj", 1),
    "expert_feedforward_output_dense": ("down_proj", 0)})
MIXTRAL_EXPERTS = ExpertLayer("MixtralMoeExperts",
                              expert_kernels("gate", "intermediate", "output"),
                              mixtral_experts_call)


def router_layer(*attributes: str):
    """``MoE.router``: the layer at ``block.<attributes...>`` (None where one is missing)."""
    def router(block):
        layer = block
        for name in attributes:
            layer = getattr(layer, name, None)
        return layer
    return router


def _router(attribute: str):
    def router(block):
        moe = getattr(block, attribute, None)
        return getattr(moe, "_sparse_feedforward_gate_dense", None)
    return router


_COUNTED = re.compile(r"_sparse_moe_block_\d+/")


def prepare(backbone) -> None:
    """``Family.prepare``: KerasHub names Qwen3-MoE's and Mixtral's MoE blocks by a process-wide
    counter (``qwen3_sparse_moe_block_5``: the number of such blocks built before), so their
    variables' paths (the checkpoint's keys of full fine-tuning and of expert LoRA) would differ
    between the process that trains and one that loads the checkpoint after building other
    models; each becomes its block's ``..._sparse_moe_block``. Idempotent."""
    for v in backbone.weights:
        fixed = _COUNTED.sub("_sparse_moe_block/", v.path)
        if fixed != v.path:
            v._path = fixed  # Keras mirrors it into the NNX metadata that split / merge keep


# int8 leaves the routers (a [hidden, experts] matrix each): rounding them flips which experts a
# token goes to (bitsandbytes users skip the "gate" likewise)
_ROUTER_SKIP = ("sparse_feedforward_gate_dense",)
# each family sets its own intermediate_dim over these
_TINY = dict(TINY_DIMS, num_key_value_heads=2, num_experts=4, top_k=2)

QWEN3_MOE = Family(
    name="qwen3_moe",
    backbone="Qwen3MoeBackbone",
    classes=("Qwen3MoeCausalLM", "Qwen3MoeCausalLMPreprocessor", "Qwen3MoeTokenizer"),
    chat_format="qwen3",
    attention={"Qwen3MoeAttention": qwen3_moe_attention},
    sharding=SHARDING_MOE,
    lora={"attention": LORA["attention"],  # mlp: its dense layers (mlp_only_layers), experts
          "mlp": (*LORA["mlp"], *QWEN3_MOE_EXPERTS.kernels)},
    export=Export(qwen3_moe_rules, qwen3_moe_config,
                  "`qwen3_moe` (every layer sparse, no window), one tensor per expert",
                  tokenizer=chatml_tokenizer, experts=QWEN3_MOE_PEFT),
    decoding=SELF_ATTENTION_CACHE,
    context_length=40_960,  # 30B-A3B (131,072 with YaRN)
    hf_model_types=("qwen3_moe",),
    short_names={"qwen3_moe_30b_a3b": "qwen3_moe_30b_a3b_en"},
    tokenizer="bpe-qwen3",
    presets={"qwen3_moe_30b_a3b": Preset(dict(
        vocabulary_size=151_936, hidden_dim=2048, head_dim=128, num_layers=48, num_query_heads=32,
        num_key_value_heads=4, intermediate_dim=6144, moe_intermediate_dim=768, num_experts=128,
        top_k=8, norm_top_k_prob=True, layer_norm_epsilon=1e-6, rope_max_wavelength=1e6,
        sliding_window_size=None, router_aux_loss_coefficient=0.001,
        tie_word_embeddings=False), 151_669)},
    tiny={"qwen3_moe": dict(_TINY, intermediate_dim=64, moe_intermediate_dim=16, head_dim=8,
                            norm_top_k_prob=True)},
    prepare=prepare,
    quantize_skip=_ROUTER_SKIP,
    moe=MoE(_router("mlp"), lambda b: int(b.top_k),
            lambda b: float(b.router_aux_loss_coefficient),  # 0.001 (30B-A3B's config)
            expert_layer=QWEN3_MOE_EXPERTS),
)

MIXTRAL = Family(
    name="mixtral",
    backbone="MixtralBackbone",
    classes=("MixtralCausalLM", "MixtralCausalLMPreprocessor", "MixtralTokenizer"),
    chat_format="mistral",
    attention={"CachedMixtralAttention": mixtral_attention},
    sharding=SHARDING_MOE,
    lora={"attention": LORA["attention"], "mlp": tuple(MIXTRAL_EXPERTS.kernels)},
    export=Export(mixtral_rules, mixtral_config,
                  "`mixtral` (its sliding window too), one tensor per expert (w1 / w3 / w2)",
                  experts=MIXTRAL_PEFT),
    decoding=SELF_ATTENTION_CACHE,
    context_length=32_768,
    hf_model_types=("mixtral",),
    short_names={"mixtral_8x7b": "mixtral_8_7b_en", "mixtral_8x7b_it": "mixtral_8_instruct_7b_en"},
    tokenizer="sentencepiece-llama",
    presets={"mixtral_8x7b": Preset(dict(
        vocabulary_size=32_000, num_layers=32, num_query_heads=32, hidden_dim=4096,
        intermediate_dim=14_336, num_key_value_heads=8, num_experts=8, top_k=2,
        rope_max_wavelength=1e6, layer_norm_epsilon=1e-5,
        sliding_window=None), 32_000)},  # KerasHub's default window is 512: 8x7B has none
    tiny={"mixtral": dict(_TINY, intermediate_dim=16, sliding_window=8)},
    prepare=prepare,
    quantize_skip=_ROUTER_SKIP,
    moe=MoE(_router("_sparse_moe_block"), lambda b: int(b.top_k),
            lambda b: float(b.router_aux_loss_coef),  # 0.02 (8x7B's config)
            expert_layer=MIXTRAL_EXPERTS),
)
