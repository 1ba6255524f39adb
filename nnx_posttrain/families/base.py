"""What a family entry holds (``Family``) and the small records it is made of.

A family is one KerasHub backbone class and everything the package must know of it: its chat
format, how to read its attention layers (``LayerSpec``), its sharding rules, its Hugging Face
export, its KV-cache decoding, its context, its LoRA target names, its preset shapes for
``tools.make_preset`` and a tiny configuration for the tests. A part a family does not have is an
``Unsupported`` with the reason, never a gap: ``tests/test_families.py`` checks every entry.
Imports ``nnx_posttrain.errors`` only (KerasHub lazily, inside the functions that read a model).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nnx_posttrain import errors


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A part the family does not have, and why (said to the user where the part is asked for)."""

    reason: str

    def __bool__(self):  # ``if family.export:`` reads as "has an export"
        return False


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What the attention kernels (``model.attention.attend``) need to know of one KerasHub
    attention layer: the scale of the scores, the soft cap, the sliding window, how many times
    the layer repeated each key / value head, whether the scale multiplies the scores (Llama
    family) or the queries (Gemma), and its attention sinks (GPT-OSS): the layer's variable of
    one learned logit per query head that joins every softmax's denominator (a key no value
    belongs to), read when the kernel runs (its value inside a trace, for its gradient); None
    for none. ``sinks`` is not part of the spec's equality or hash."""

    scale: float
    soft_cap: float | None = None
    window: int | None = None  # a query sees keys at most window - 1 positions earlier
    repeated: int = 1  # keys / values arrive repeated this many times per kv head (Llama family)
    scale_scores: bool = False  # scale the scores (Llama family) rather than the queries (Gemma)
    sinks: Any = dataclasses.field(default=None, compare=False)  # [query heads] sink logits


# An attention reader: (KerasHub attention layer, training) -> its LayerSpec, or the reason the
# layer stays with KerasHub's own code (``model.attention`` then falls back to ``keras``).
Reader = Callable[[Any, bool], "LayerSpec | str"]


class ExportError(errors.ModelError):
    """The model cannot be exported as asked; the message says why."""


def refuse(family: str, problems: list[str]) -> None:
    """``ExportError`` when ``problems`` (configurations whose export was not verified) is not
    empty."""
    if problems:
        raise ExportError(f"--format hf: this {family} configuration has no verified Hugging Face "
                          f"export ({'; '.join(problems)}); use --format keras")


@dataclasses.dataclass(frozen=True)
class PeftExperts:
    """LoRA on a family's stacked experts (``model.expert_lora``) as PEFT adapters on
    transformers' 3-D expert parameters (PEFT's ``target_parameters``; ``export.hf_experts``):
    ``module``: the experts module's name inside its decoder layer (``mlp.experts``);
    ``params``: its expert parameters in the order transformers declares them (PEFT nests the
    wrappers of one module's parameters in that order); ``kernels``: {Keras kernel name
    (``ExpertLayer.kernels``): (its parameter, its place there)}: a parameter of several
    kernels (gate | up) holds their outputs concatenated in that order."""

    module: str
    params: tuple[str, ...]
    kernels: dict[str, tuple[str, int]]


@dataclasses.dataclass(frozen=True)
class Export:
    """The Hugging Face export of a family (``export.hf``), verified by a logits round trip
    against ``transformers`` (tests/test_hf_export.py).

    ``rules(backbone)``: ``(regex on the Keras variable path, HF tensor name, layout)`` per
    variable (see ``export.hf.to_matrix``: the layout of a kernel is (output axes, input axes),
    None copies the array, "flat" flattens it); ``config(backbone)``: the HF config.json (raising
    ``ExportError`` for a configuration that was not verified); ``tokenizer(tokenizer, dir)``:
    writes the tokenizer files (None: KerasHub's exporter); ``verified``: the configurations, for
    the docs; ``image_tokens``: a vision-language config's keys of the tokenizer's image
    placeholder, start-of-image and end-of-image ids (``export.hf_config`` writes them);
    ``processor(preprocessor)``: a vision-language export's image processor files, {file name:
    JSON} (``families.image_processors``; ``ExportError`` where transformers has no form of them);
    ``experts``: LoRA on the stacked experts as PEFT adapters (``PeftExperts``; None: refused)."""

    rules: Callable[[Any], list]
    config: Callable[[Any], dict]
    verified: str
    tokenizer: Callable[[Any, Any], None] | None = None
    image_tokens: tuple[str, str, str] = ()
    processor: Callable[[Any], dict] | None = None
    experts: PeftExperts | None = None


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How the KV-cache sampler (``sampling.sampler``) drives the family's decoder blocks: the
    block's cache keyword and cache-index keyword, whether its cache is a (key, value) tuple
    (Gemma 3) rather than one [B, 2, L, kv, hd] array, and whether the backbone multiplies its
    embeddings by sqrt(hidden_dim) (Gemma).

    Gemma 4's blocks differ from one another; three functions, None for the other families:
    ``layout(block)``: the block's (kv heads, head dim) (None: the backbone's, every block);
    ``kv_source(block)``: the index of the earlier block whose keys and values a KV-shared block
    reads (given to it as keyword ``shared_kw``: that block's cache output), None for a block
    with its own; ``layer_inputs(backbone, token_ids, x, vision_mask=None)``: each block's extra
    keyword arguments (a list of dicts) from the token ids and the scaled embeddings ``x`` (with
    a prompt's images: its image tokens' ``vision_mask``).

    A family with recurrent blocks (``Family.recurrent``: Qwen 3.5's Gated DeltaNet) carries
    their state in the sampler's cache instead of keys and values: ``state(block, batch)``, a
    recurrent block's initial state (a tuple of zero arrays); ``state_step(block, x, state,
    index, mask)``: the block on ``x`` [B, T, D] at positions ``index ..`` from ``state``,
    returning (its output, the new state); ``mask``: the prompt's padding mask [B, T] (left
    pads) in the prompt pass, None for a decoding step."""

    cache_kw: str
    index_kw: str
    pair_cache: bool = False
    embed_scale: bool = False
    layout: Callable[[Any], tuple[int, int]] | None = None
    kv_source: Callable[[Any], int | None] | None = None
    shared_kw: str = ""
    layer_inputs: Callable[..., list] | None = None
    state: Callable[[Any, int], tuple] | None = None
    state_step: Callable[..., tuple] | None = None


# The decoder blocks' cache keywords of KerasHub's Llama-like families (Llama, Mistral, Qwen, the
# mixtures of experts)
SELF_ATTENTION_CACHE = Decoding("self_attention_cache", "self_attention_cache_update_index")
# The micro dimensions of the per-family tests' configurations (``Family.tiny``), which add each
# family's own (its key-value heads, head size, window, experts)
TINY_DIMS = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, hidden_dim=32,
                 intermediate_dim=48)


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """The layer of a MoE block that holds its stacked experts, for LoRA on them
    (``model.expert_lora``): ``cls``: its KerasHub class name; ``kernels``: {kernel name (the
    variable's, a ``--lora.targets`` name): the layer's attribute holding it, [E, in, out]};
    ``call(layer, project, *args, **kwargs)``: the layer's ``call`` with each kernel product
    written ``project(name, equation, x)`` (the einsum of ``x`` and that kernel in ``x``'s dtype,
    plus its adapters' term where LoRA is on): KerasHub's computation, which LoRA at zero
    reproduces exactly (tests/test_expert_lora.py)."""

    cls: str
    kernels: dict[str, str]
    call: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture-of-experts family's routing (``model.router``, ``losses.router``):
    ``router(block)``: the layer whose output is the block's router logits [rows, experts]
    (None: a block with a dense MLP); ``top_k(backbone)``: the experts per token;
    ``aux_coef(backbone)``: the load-balancing loss coefficient of the family's released config
    (transformers' ``router_aux_loss_coef``; 0 where its config has none, as TRL reads it);
    ``experts(backbone)``: the experts of each MoE layer (0: a model of the family without any),
    which ``--mesh.expert`` must divide (``sharding.check_experts``); ``expert_layer``: the
    layer holding the stacked experts, for LoRA on them (``ExpertLayer``; None: not adaptable).
    A family's sharding rules map its stacked experts' leading dimension to the logical axis
    ``expert``."""

    router: Callable[[Any], Any]
    top_k: Callable[[Any], int]
    aux_coef: Callable[[Any], float]
    experts: Callable[[Any], int] = lambda backbone: int(backbone.num_experts)
    expert_layer: ExpertLayer | None = None


@dataclasses.dataclass(frozen=True)
class Preset:
    """A real model's shape for ``tools.make_preset --like``: the KerasHub backbone arguments of
    the published checkpoint and its tokenizer's size (the embedding may have more rows)."""

    dims: dict
    tokens: int


@dataclasses.dataclass(frozen=True)
class Family:
    """One KerasHub causal-LM family: everything the package knows of it, in one place.

    - ``name``; ``backbone``: the KerasHub backbone class name; ``classes``: its ``CausalLM``,
      ``CausalLMPreprocessor`` and ``Tokenizer`` class names (``keras_hub.models``);
    - ``chat_format``: the chat format (``chat.FORMATS``), or a function of the backbone
      returning it (Llama 3.0 or 3.1+);
    - ``attention``: {attention layer class name: reader} (``LayerSpec`` or a reason);
    - ``sharding``: ``(regex on the variable path, logical axis per dimension)`` rules, anchored
      on the family's own path names (``sharding.RULES`` holds every family's);
    - ``lora``: the layer names of ``--lora.targets attention`` and ``mlp`` (a mixture of
      experts': its stacked expert kernels' names too, ``MoE.expert_layer``);
    - ``export``: ``Export``; ``decoding``: ``Decoding``; ``context_length``: the longest context
      of the released checkpoints (rotary positions beyond it are untrained);
    - ``hf_model_types``: the Hugging Face ``model_type`` values KerasHub (Phi-3: the package,
      ``model.hf_convert``) converts to this backbone (``--model HF_DIR``);
    - ``short_names``: ``--model`` short names -> KerasHub preset handles;
    - ``tokenizer``: the synthetic tokenizer kind of ``tools.make_preset`` (``TOKENIZERS``);
      ``presets``: ``--like`` name -> ``Preset``;
    - ``tiny``: variant name -> backbone arguments of a tiny random model with the family's
      features (the tests' ``support.TINY_FAMILIES``; float32 is added);
    - ``moe``: the routing of a mixture-of-experts family (``MoE``), None for a dense one;
    - ``quantize_skip``: layer names ``--quantize int8`` leaves in the model's dtype (a block
      that reads a layer's kernel as an array, which int8 would give without its scale);
    - ``prepare(backbone)``: a repair of KerasHub's backbone the package runs on every one it
      builds or loads (``families.prepare``; SmolLM3's variable paths), None for none;
    - ``attention_call(layer, *args, **kwargs)``: the attention layer's ``call`` in the package's
      forward passes (``model.attention.own_calls``), None: KerasHub's (SmolLM3's mutates the
      layer, which NNX refuses inside a nested trace);
    - ``ignores_dtype``: the backbone builds its layers in Keras' global dtype policy, not its
      ``dtype`` argument (SmolLM3): ``families.building`` sets the global one while it is built;
    - ``build_context``: a context the backbone is built in (SmolLM3's: its rotary frequencies
      computed concretely, which its layers turn into NumPy: an abstract build, ``plan``'s
      ``nnx.eval_shape``, could not); ``families.building`` enters it;
    - ``recurrent``: the layer classes of decoder blocks that mix tokens with a recurrent state
      instead of softmax attention (Qwen 3.5's Gated DeltaNet): the attention path leaves those
      blocks to KerasHub's code, and rows whose examples such a state would cross (packed rows,
      shared-prompt pairs) are refused or not built; ``recurrent_call(layer, original, *args,
      **kwargs)``: such a layer's ``call`` in the package's forward passes (``original``:
      KerasHub's, bound), None: KerasHub's (Qwen 3.5's: its delta rule as a scan,
      ``gated_delta_net``).
    """

    name: str
    backbone: str
    classes: tuple[str, str, str]
    chat_format: str | Callable[[Any], str] | Unsupported
    attention: dict[str, Reader]
    sharding: tuple
    lora: dict[str, tuple[str, ...] | Unsupported]
    export: Export | Unsupported
    decoding: Decoding | Unsupported
    context_length: int
    hf_model_types: tuple[str, ...] | Unsupported
    short_names: dict[str, str]
    tokenizer: str
    presets: dict[str, Preset] | Unsupported
    tiny: dict[str, dict]
    quantize_skip: tuple[str, ...] = ()
    moe: MoE | None = None
    prepare: Callable[[Any], None] | None = None
    attention_call: Callable[..., Any] | None = None
    ignores_dtype: bool = False
    build_context: Callable[[], Any] | None = None
    recurrent: tuple[str, ...] = ()
    recurrent_call: Callable[..., Any] | None = None

    def format_of(self, backbone) -> str | None:
        """The chat format of ``backbone`` (a model of this family), or None when the family has
        no known template."""
        if isinstance(self.chat_format, Unsupported):
            return None
        return self.chat_format if isinstance(self.chat_format, str) else \
            self.chat_format(backbone)


def language_model(text_rules: list) -> list:
    """A text model's rules with its ``model.`` tensors under ``model.language_model`` (a
    vision-language checkpoint's layout; ``lm_head`` stays)."""
    return [(p, name.replace("model.", "model.language_model.", 1), layout)
            for p, name, layout in text_rules]
