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
- KerasHub 0.32 has no SmolLM3 exporter: the package's (``EXPORT_RULES``, ``export_config``,
  ``export_tokenizer``) writes transformers' ``SmolLM3ForCausalLM``, its NoPE layers as
  ``no_rope_layers`` (1: the layer rotates; ``no_rope_layer_interval`` where the list has one),
  the rotary frequencies left to transformers (a non-persistent buffer there, computed from
  ``rope_theta``: the export checks ours are those), the embedding tied as KerasHub ties it.
"""

from __future__ import annotations

import contextlib
import json

from nnx_posttrain.families.base import SELF_ATTENTION_CACHE, Export, Family, Preset, refuse
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
    projection, its rotary frequencies) their block's path, and those layers their block's
    scope (where ``enable_lora`` adds their factors), and build the rotary layers (NNX refuses
    their lazy build inside a traced step). Idempotent."""
    for block in backbone.transformer_layers:
        attn = block.self_attn
        attn.rotary_embedding.build(None)
        scope = f"{block.name}/{attn.name}/"
        for layer in (attn.o_proj, attn.rotary_embedding):
            # the scope of the variables the layer adds later (its LoRA factors)
            layer._parent_path, layer._path = scope[:-1], scope + layer.name
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

_T, _L = r"transformer_layer_(\d+)", "model.layers.{}"
_DENSE = ((1,), (0,))  # a Dense kernel [in, out] as [out, in]
EXPORT_RULES = [  # Keras path -> transformers' SmolLM3ForCausalLM name, layout (export.hf)
    (r"token_embedding/embeddings", "model.embed_tokens.weight", None),  # tied: no lm_head
    (rf"{_T}/self_attn/q_proj/kernel", _L + ".self_attn.q_proj.weight", _DENSE),
    (rf"{_T}/self_attn/k_proj/kernel", _L + ".self_attn.k_proj.weight", _DENSE),
    (rf"{_T}/self_attn/v_proj/kernel", _L + ".self_attn.v_proj.weight", _DENSE),
    (rf"{_T}/self_attn/o_proj/kernel", _L + ".self_attn.o_proj.weight", ((2,), (0, 1))),
    (rf"{_T}/self_attn/rotary_emb/inv_freq", None, "derived"),  # export.hf.DERIVED
    (rf"{_T}/input_layernorm/scale", _L + ".input_layernorm.weight", None),
    (rf"{_T}/post_attention_layernorm/scale", _L + ".post_attention_layernorm.weight", None),
    (rf"{_T}/mlp/gate_proj/kernel", _L + ".mlp.gate_proj.weight", _DENSE),
    (rf"{_T}/mlp/up_proj/kernel", _L + ".mlp.up_proj.weight", _DENSE),
    (rf"{_T}/mlp/down_proj/kernel", _L + ".mlp.down_proj.weight", _DENSE),
    (rf"{_T}/mlp/gate_proj/bias", _L + ".mlp.gate_proj.bias", None),  # mlp_bias
    (rf"{_T}/mlp/up_proj/bias", _L + ".mlp.up_proj.bias", None),
    (rf"{_T}/mlp/down_proj/bias", _L + ".mlp.down_proj.bias", None),
    (r"sequence_output_layernorm/scale", "model.norm.weight", None),
]


def export_rules(backbone) -> list:
    return list(EXPORT_RULES)


def _frequencies_are_rope_thetas(b) -> bool:
    """Whether every layer's rotary frequencies are those transformers computes from
    ``rope_theta`` (1 / theta ** (2i / head_dim)), to float32 rounding (KerasHub's float32
    power: ~1e-7 relative on a CPU; 1e-5 leaves room for an accelerator's, and still tells any
    other base or a changed frequency)."""
    import numpy as np

    hd = b.hidden_dim // b.num_attention_heads
    expected = 1.0 / (float(b.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    return all(np.allclose(np.asarray(block.self_attn.rotary_embedding.inv_freq.value,
                                      np.float64), expected, rtol=1e-5, atol=0)
               for block in b.transformer_layers)


def no_rope_layers(b) -> list[int]:
    """transformers' ``no_rope_layers``: per layer, 1 where it rotates, 0 for a NoPE layer (the
    layers' own ``use_rope``: KerasHub rotates a layer past its list's end)."""
    return [int(bool(block.self_attn.use_rope)) for block in b.transformer_layers]


def export_config(b) -> dict:
    """transformers' ``SmolLM3Config`` (``smollm3``); the token ids come from the tokenizer
    (``export.hf_config``), none by default (transformers' defaults are the 128k vocabulary's)."""
    refuse("SmolLM3Backbone", [p for p, bad in (
        ("attention_bias=True (transformers' o_proj has a bias, KerasHub's none)",
         b.attention_bias),
        (f"partial_rotary_factor={b.partial_rotary_factor}", b.partial_rotary_factor != 1.0),
        ("rotary frequencies other than rope_theta's", not _frequencies_are_rope_thetas(b)))
        if bad])
    rope, n = no_rope_layers(b), b.num_layers
    cfg = dict(
        architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=b.vocabulary_size,
        hidden_size=b.hidden_dim, intermediate_size=b.intermediate_dim, num_hidden_layers=n,
        num_attention_heads=b.num_attention_heads, num_key_value_heads=b.num_key_value_heads,
        hidden_act="silu", max_position_embeddings=b.max_position_embeddings,
        rms_norm_eps=b.layer_norm_epsilon, rope_theta=float(b.rope_theta),
        rope_parameters=dict(rope_type="default", rope_theta=float(b.rope_theta)),
        use_sliding_window=False, sliding_window=None, no_rope_layers=rope,
        layer_types=["full_attention"] * n, attention_bias=False,
        attention_dropout=float(b.attention_dropout), mlp_bias=bool(b.mlp_bias),
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    interval = next((k for k in range(2, n + 2)
                     if rope == [int((i + 1) % k != 0) for i in range(n)]), None)
    if interval is not None:  # the list is "every k-th layer NoPE" (SmolLM3-3B's: 4)
        cfg["no_rope_layer_interval"] = interval
    return cfg


def export_tokenizer(tokenizer, to) -> None:
    """The tokenizer as transformers' ``PreTrainedTokenizerFast`` (SmolLM3's published form): a
    ``tokenizer.json`` of Llama 3's layout (KerasHub's builder: byte-level BPE, Llama 3's
    split), with every special and unsplittable token (the turn tokens) as an added token."""
    from keras_hub.src.utils.transformers.export.llama3 import build_llama3_tokenizer_json

    spec = build_llama3_tokenizer_json(tokenizer)
    known = {t["id"] for t in spec["added_tokens"]}
    extra = [t for t in (tokenizer.unsplittable_tokens or []) if tokenizer.token_to_id(t)
             not in known]
    spec["added_tokens"] = sorted(spec["added_tokens"] + [dict(
        id=tokenizer.token_to_id(t), content=t, single_word=False, lstrip=False, rstrip=False,
        normalized=False, special=True) for t in extra], key=lambda t: t["id"])
    (to / "tokenizer.json").write_text(json.dumps(spec, indent=2, ensure_ascii=False))
    (to / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": tokenizer.end_token, "pad_token": None, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 65_536}, indent=2))


# The tiny configuration's dimensions; layer 1 is a NoPE layer
_TINY = dict(vocabulary_size=64, hidden_dim=32, intermediate_dim=48, num_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
             attention_dropout=0.0, rope_layer_enabled_list=[True, False],
             layer_types=["attention", "attention"], mlp_bias=False, layer_norm_epsilon=1e-6,
             max_position_embeddings=4096, rope_theta=10_000.0, partial_rotary_factor=1.0)


@contextlib.contextmanager
def concrete_rope_frequencies():
    """While active, KerasHub's SmolLM3 layers compute their rotary frequencies concretely (a
    few numbers, which their ``__init__`` turns into NumPy): so the backbone can be built
    abstractly (``nnx.eval_shape``: ``plan``, ``tools.make_preset --config-only``)."""
    import jax
    from keras_hub.src.models.smollm3 import smollm3_layers

    original = smollm3_layers.rope_init

    def concrete(*args):
        with jax.ensure_compile_time_eval():
            return original(*args)

    smollm3_layers.rope_init = concrete
    try:
        yield
    finally:
        smollm3_layers.rope_init = original


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
    export=Export(export_rules, export_config,
                  "SmolLM3 (`smollm3`, `SmolLM3ForCausalLM`): NoPE layers (`no_rope_layers`), "
                  "tied embedding, MLP biases; no attention biases",
                  tokenizer=export_tokenizer),
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
    build_context=concrete_rope_frequencies,
)
