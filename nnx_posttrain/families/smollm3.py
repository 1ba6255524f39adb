"""SmolLM3 (``SmolLM3Backbone``): the Llama layout under other names
(``transformer_layer_i/self_attn/{q,k,v,o}_proj``, ``mlp/{gate,up,down}_proj``), keys and values
repeated per query group before ``_compute_attention``, and NoPE layers: the layers whose
``rope_layer_enabled_list`` entry is False (every 4th in the released 3B, Hugging Face's
``no_rope_layers``) skip the rotary embedding; the attention kernels see their queries and keys
as the layer gives them, so the same reader serves both kinds.

KerasHub 0.32's quirks, and what the package does about them:

- each attention layer builds its output projection (and its rotary layer's frequencies) in
  ``__init__``, outside its block's name scope: every layer's variable is ``o_proj/kernel`` /
  ``rotary_emb/inv_freq``. Paths key the sharding rules, ``--init-from`` and the exports, so
  ``prepare`` (run on every backbone the package builds or loads) renames them under their
  block (``transformer_layer_i/self_attn/o_proj/kernel``), through the variable's own
  ``__setattr__``, which Keras mirrors into its NNX metadata (a path set around it reads the
  bare name again after one pass through JAX: a jitted step, a split / merge);
- its rotary layers are built lazily, at their first call, which NNX refuses inside a traced
  step: ``prepare`` builds them;
- ``SmolLM3Attention.call`` assigns ``self.training``, which NNX refuses inside a nested trace
  (the sampler's decoding loop, remat): the package's forward passes call ``attention_call``
  instead (``Family.attention_call``), KerasHub's code without that assignment;
- the backbone ignores ``dtype`` for its layers (they take Keras' global policy): the package
  builds it with the global policy set to its dtype (``Family.ignores_dtype``,
  ``families.building``);
- KerasHub 0.32 has no SmolLM3 exporter and this package none verified.
"""

from __future__ import annotations

from nnx_posttrain.families.base import SELF_ATTENTION_CACHE, Family, Preset, Unsupported
from nnx_posttrain.families.llama import llama_like

F, T = "fsdp", "tensor"
_B = r"transformer_layer_\d+"


def smollm3_attention(layer, training: bool):
    """``SmolLM3Attention``: no window, scores scaled by ``_inv_norm_factor``."""
    return llama_like(layer, None)


def attention_call(layer, hidden_states, training=False, attention_mask=None, **kwargs):
    """``SmolLM3Attention.call`` as KerasHub 0.32 writes it, without its ``self.training =
    training`` (NNX refuses that mutation inside a nested trace: the sampler's decoding loop,
    remat): the package's forward passes call this one (``model.attention.own_calls``)."""
    from keras import ops
    from keras_hub.src.models.smollm3.smollm3_utils import apply_rotary_pos_emb

    cache = kwargs.get("self_attention_cache")
    index = kwargs.get("self_attention_cache_update_index")
    if cache is None and index is not None:
        raise ValueError("`self_attention_cache_update_index` needs `self_attention_cache`")
    shape = ops.shape(hidden_states)[:-1]
    heads, kv, hd = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    query = ops.reshape(layer.q_proj(hidden_states), (*shape, heads, hd))
    if cache is not None and index is None:  # the cache as it is
        key, value = cache[:, 0, ...], cache[:, 1, ...]
    else:
        key = ops.reshape(layer.k_proj(hidden_states), (*shape, kv, hd))
        value = ops.reshape(layer.v_proj(hidden_states), (*shape, kv, hd))
        if layer.use_rope:  # a NoPE layer rotates nothing
            cos, sin = layer.rotary_embedding(query, start_index=0 if index is None else index)
            query, key = apply_rotary_pos_emb(query, key, cos, sin, expansion_axis=2)
        if cache is not None:
            start = (0, index, 0, 0)
            key = ops.slice_update(cache[:, 0, ...], start, key)
            value = ops.slice_update(cache[:, 1, ...], start, value)
            cache = ops.stack((key, value), axis=1)
    key = ops.repeat(key, repeats=layer.num_key_value_groups, axis=2)
    value = ops.repeat(value, repeats=layer.num_key_value_groups, axis=2)
    out = layer.o_proj(layer._compute_attention(query, key, value, attention_mask,
                                                cache_update_index=index))
    return out if cache is None else (out, cache)


def prepare(backbone) -> None:
    """Give the variables each attention layer creates outside its block's scope (its output
    projection, its rotary frequencies) their block's path, and build the rotary layers (NNX
    refuses their lazy build inside a traced step). Idempotent."""
    for block in backbone.transformer_layers:
        attn = block.self_attn
        attn.rotary_embedding.build(None)
        scope = f"{block.name}/{attn.name}/"
        for layer in (attn.o_proj, attn.rotary_embedding):
            for v in layer.weights:
                if not v.path.startswith(scope):
                    # not object.__setattr__: Keras' own setter keeps it in the NNX metadata,
                    # so the path survives flattening (a jitted step)
                    v._path = scope + v.path


SHARDING = (
    # q / k / v Dense kernels [hidden, heads * head_dim], output [heads, head_dim, hidden]
    (rf"{_B}/self_attn/(q_proj|k_proj|v_proj)/kernel$", (F, T)),
    (rf"{_B}/self_attn/(q_proj|k_proj|v_proj)/bias$", (T,)),
    (rf"{_B}/self_attn/o_proj/kernel$", (T, None, F)),
    (rf"{_B}/mlp/(gate_proj|up_proj)/kernel$", (F, T)),
    (rf"{_B}/mlp/(gate_proj|up_proj)/bias$", (T,)),
    (rf"{_B}/mlp/down_proj/kernel$", (T, F)),
)

# The tiny configuration's dimensions; layer 1 is a NoPE layer
_TINY = dict(vocabulary_size=64, hidden_dim=32, intermediate_dim=48, num_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
             attention_dropout=0.0, rope_layer_enabled_list=[True, False],
             layer_types=["attention", "attention"], mlp_bias=False, layer_norm_epsilon=1e-6,
             max_position_embeddings=4096, rope_theta=10_000.0, partial_rotary_factor=1.0)

SMOLLM3 = Family(
    name="smollm3",
    backbone="SmolLM3Backbone",
    classes=("SmolLM3CausalLM", "SmolLM3CausalLMPreprocessor", "SmolLM3Tokenizer"),
    # SmolLM3's published template (a metadata system turn, /think and /no_think) is in neither
    # TRL nor transformers and KerasHub ships none; its turns are ChatML's
    chat_format="chatml",
    attention={"SmolLM3Attention": smollm3_attention},
    sharding=SHARDING,
    lora={"attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
          "mlp": ("gate_proj", "up_proj", "down_proj")},
    export=Unsupported("KerasHub 0.32 has no SmolLM3 exporter and this package none verified "
                       "yet (its NoPE layers: transformers' no_rope_layers); use --format keras"),
    decoding=SELF_ATTENTION_CACHE,
    context_length=65_536,  # SmolLM3-3B's max_position_embeddings (128k with YaRN)
    hf_model_types=("smollm3",),
    short_names={"smollm3_3b": "smollm3_3b_en"},
    tokenizer="bpe-smollm3",
    presets={"smollm3_3b": Preset(dict(  # SmolLM3-3B's config.json: every 4th layer NoPE
        vocabulary_size=128_256, hidden_dim=2048, intermediate_dim=11_008, num_layers=36,
        num_attention_heads=16, num_key_value_heads=4, attention_bias=False,
        attention_dropout=0.0, rope_layer_enabled_list=[i % 4 != 3 for i in range(36)],
        layer_types=["attention"] * 36, mlp_bias=False, layer_norm_epsilon=1e-6,
        max_position_embeddings=65_536, rope_theta=5_000_000.0, partial_rotary_factor=1.0),
        128_256)},
    tiny={"smollm3": _TINY},
    prepare=prepare,
    attention_call=attention_call,
    ignores_dtype=True,
)
