"""Qwen 3.5 MoE (``Qwen3_5MoeBackbone``, text tower; 35B-A3B): Qwen 3.5's two block kinds
(``families.qwen3_5``: full attention with its output gate, the Gated DeltaNet with its
recurrent state in the sampler's cache) with a sparse MoE block as every block's MLP.

The MoE block (``transformer_layer_i/sparse_moe_block/``, the block's ``mlp``): a router Dense
``router_gate`` [hidden, experts] (softmax, top-k, the k weights renormalised, as transformers'
``Qwen3_5MoeTopKRouter``), the routed experts stacked in raw weights (``experts/``: gate|up
[E, hidden, 2 x I], down [E, I, hidden]) and a shared expert every token takes
(``shared_expert/``: a SwiGLU MLP of Dense layers, scaled by ``sigmoid(shared_expert_gate)``).
The shared expert is outside the routing: the load-balancing loss reads the router's logits
alone and is Qwen3-MoE's (transformers 5.24's ``Qwen3_5MoeForCausalLM`` calls the same
``load_balancing_loss_func``, coefficient ``router_aux_loss_coef`` 0.001). KerasHub computes
every expert for every token and drops the logits: ``model.router`` captures them. The experts'
leading dimension is on the ``expert`` mesh axis (``--mesh.expert``).
"""

from __future__ import annotations

from nnx_posttrain.families import qwen3_5
from nnx_posttrain.families.base import ExpertLayer, Export, Family, MoE, Preset
from nnx_posttrain.families.moe import QWEN3_MOE_PEFT, expert_kernels, expert_rules, router_layer
from nnx_posttrain.families.qwen import chatml_tokenizer

F, T, E = "fsdp", "tensor", "expert"
_MOE = r"transformer_layer_\d+/sparse_moe_block"

SHARDING = qwen3_5.SHARDING + (
    (rf"{_MOE}/router_gate/kernel$", (F, None)),
    (rf"{_MOE}/shared_expert_gate/kernel$", (F, None)),
    # the shared expert: a dense MLP's
    (rf"{_MOE}/shared_expert/(feedforward_gate_dense|feedforward_intermediate_dense)/kernel$",
     (F, T)),
    (rf"{_MOE}/shared_expert/feedforward_output_dense/kernel$", (T, F)),
    # the routed experts [E, hidden, 2 x I] (gate|up) and [E, I, hidden] (down): the experts over
    # the expert axis, each one's matrices as a dense MLP's
    (rf"{_MOE}/experts/expert_feedforward_gate_dense$", (E, F, T)),
    (rf"{_MOE}/experts/expert_feedforward_output_dense$", (E, T, F)),
)

_T = r"transformer_layer_(\d+)/sparse_moe_block"
_L = "model.layers.{}.mlp"


def export_rules(b) -> list:
    """transformers' ``Qwen3_5MoeForCausalLM`` names: the dense family's for attention, the
    DeltaNet and the norms; the router ``mlp.gate``, the shared expert and its gate, and one
    tensor per routed expert (``mlp.experts.{e}.{gate,up,down}_proj``, which transformers merges
    into its stacked experts on loading)."""
    i = b.moe_intermediate_dim
    shared = [(rf"{_T}/shared_expert/feedforward_{part}_dense/kernel",
               f"{_L}.shared_expert.{name}_proj.weight", ((1,), (0,)))
              for part, name in (("gate", "gate"), ("intermediate", "up"), ("output", "down"))]
    return qwen3_5.export_rules(b) + shared + [
        (rf"{_T}/router_gate/kernel", f"{_L}.gate.weight", ((1,), (0,))),
        (rf"{_T}/shared_expert_gate/kernel", f"{_L}.shared_expert_gate.weight", ((1,), (0,))),
    ] + expert_rules(b, "mlp.experts", {  # gate | up halves of one stacked kernel
        "expert_feedforward_gate_dense": [("gate_proj", 0, i), ("up_proj", i, 2 * i)],
        "expert_feedforward_output_dense": [("down_proj", 0, b.hidden_dim)]}, block=_T)


def export_config(b) -> dict:
    """transformers' ``Qwen3_5MoeTextConfig`` (``qwen3_5_moe_text``: ``Qwen3_5MoeForCausalLM``)."""
    return dict(qwen3_5.text_config(b), architectures=["Qwen3_5MoeForCausalLM"],
                model_type="qwen3_5_moe_text", moe_intermediate_size=b.moe_intermediate_dim,
                shared_expert_intermediate_size=b.shared_expert_intermediate_size,
                num_experts=b.num_experts, num_experts_per_tok=b.top_k,
                router_aux_loss_coef=b.router_aux_loss_coefficient, output_router_logits=False)


def experts_call(layer, project, hidden_states):
    """``Qwen3_5MoeExperts.call`` (``ExpertLayer.call``): gate | up in one product,
    ``up * silu(gate)`` (SiLU in float32), then down."""
    from keras import ops

    gate, up = ops.split(project("expert_feedforward_gate_dense", "th,ehm->etm", hidden_states),
                         2, axis=-1)
    gate = ops.cast(ops.silu(ops.cast(gate, "float32")), hidden_states.dtype)
    return project("expert_feedforward_output_dense", "eti,eih->eth", up * gate)


EXPERTS = ExpertLayer("Qwen3_5MoeExperts", expert_kernels("gate", "output"), experts_call)
# --lora.targets mlp: the shared expert's layers and the routed experts' kernels
_LORA_MLP = ("feedforward_gate_dense", "feedforward_intermediate_dense",
             "feedforward_output_dense", *EXPERTS.kernels)

# The tiny configuration: the dense family's (a Gated DeltaNet block, then a full-attention
# block), each with 4 experts (top 2) and a shared expert
_TINY = dict({k: v for k, v in qwen3_5.QWEN3_5.tiny["qwen3_5"].items()
              if k != "intermediate_dim"},
              moe_intermediate_dim=16, shared_expert_intermediate_size=24, num_experts=4,
              top_k=2)

# Qwen3.5-35B-A3B's text tower (its config.json's text_config; transformers'
# Qwen3_5MoeTextConfig defaults): 40 layers, every 4th full attention, 256 experts (top 8) of
# 512 and a shared expert of 512
_35B_A3B = dict(vocabulary_size=248_320, num_layers=40, num_query_heads=16, num_key_value_heads=2,
                head_dim=256, hidden_dim=2048, moe_intermediate_dim=512,
                shared_expert_intermediate_size=512, num_experts=256, top_k=8,
                layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                             for i in range(40)],
                partial_rotary_factor=0.25, rope_max_wavelength=10_000_000,
                layer_norm_epsilon=1e-6, tie_word_embeddings=False, linear_num_key_heads=16,
                linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, router_aux_loss_coefficient=0.001)

QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    backbone="Qwen3_5MoeBackbone",
    classes=("Qwen3_5MoeCausalLM", "Qwen3_5MoeCausalLMPreprocessor", "Qwen3_5MoeTokenizer"),
    chat_format="qwen3.5",  # Qwen3.5-35B-A3B's template: thinking on (TRL's qwen3_5_think.jinja)
    attention={"Qwen3_5Attention": qwen3_5.qwen3_5_attention},
    sharding=SHARDING,
    lora={"attention": qwen3_5.QWEN3_5.lora["attention"], "mlp": _LORA_MLP},
    export=Export(export_rules, export_config,
                  "Qwen 3.5 MoE, text tower (`qwen3_5_moe_text`, `Qwen3_5MoeForCausalLM`), one "
                  "tensor per expert", tokenizer=chatml_tokenizer,
                  experts=QWEN3_MOE_PEFT),  # its experts: Qwen3-MoE's
    decoding=qwen3_5.QWEN3_5.decoding,
    context_length=262_144,  # Qwen 3.5's max_position_embeddings
    hf_model_types=("qwen3_5_moe",),
    short_names={"qwen3_5_35b_a3b": "qwen3_5_moe_35b_a3b",
                 "qwen3_5_35b_a3b_base": "qwen3_5_moe_35b_a3b_base"},
    tokenizer="bpe-qwen3_5_moe",
    presets={"qwen3_5_35b_a3b": Preset(_35B_A3B, 248_070)},  # Qwen 3.5's tokenizer (0.8B's)
    tiny={"qwen3_5_moe": _TINY},
    # int8 leaves the routers in float (rounding them flips which experts a token goes to)
    quantize_skip=("router_gate",),
    moe=MoE(router_layer("mlp", "_router_gate"), lambda b: int(b.top_k),
            lambda b: float(b.router_aux_loss_coefficient),  # 0.001 (35B-A3B's config)
            expert_layer=EXPERTS),
    recurrent=qwen3_5.QWEN3_5.recurrent,
    recurrent_call=qwen3_5.QWEN3_5.recurrent_call,
)
