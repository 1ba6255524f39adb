"""The model adapter: the only code that knows KerasHub.

A ``LanguageModel`` (``load``) holds the KerasHub ``CausalLM`` (``task``, kept for
``save_to_preset`` and KerasHub's own tools), the ``nnx.Module`` that training splits,
differentiates and merges (``module``, the backbone), a plain-Python ``Tokenizer`` and the name of
its chat template. Around it:

- ``load``: names, presets, local KerasHub / Hugging Face directories, built-in configurations
  (``register_builtin``), the ``nnx.state`` workaround for tasks, ``describe``;
- ``tokenizer``: the plain-Python ``Tokenizer`` and its ``fingerprint``; KerasHub tokenizers
  built without Keras' tracking of their vocabulary (``build``);
- ``names``: what ``--model`` names (preset short names, built-in configurations, directories);
- ``dtypes``: ``--dtype``'s names, a checkpoint's stored dtype, ``--dtype auto``, weight bytes;
- ``lora``: the trainable-variable filter, ``split``, LoRA and its off switch (the reference model);
- ``expert_lora``: LoRA on a mixture of experts' stacked kernels (per-expert factors in the
  experts' einsum), its merge;
- ``quantize``: a weight-only int8 frozen base under LoRA (QLoRA-style), and its inverse for export;
- ``blocks``: overriding a method of every decoder block for one call (``override_blocks``): the
  packed-row attention mask, remat;
- ``layer_scan``: identical decoder blocks run as one ``jax.lax.scan`` over their stacked
  weights (``set_scan``: ``--scan-layers``), one block traced and compiled instead of every one;
- ``attention``: one attention path for every family and accelerator (``set_attention``:
  ``keras``, ``xla``, ``cudnn``, ``splash``, ``auto``), segment ids compared inside the kernel,
  and the sampler's decoding step against its KV cache (``attend_cached``); its blocked path
  (``flash``) and TPU kernel (``splash``) are modules of their own;
- ``router``: the router logits of a mixture-of-experts forward pass (``routers_captured``),
  for the load-balancing loss;
- ``dense``: the decoder blocks' projections with their kernel gradient as one 2-D matmul;
- ``logprobs``: per-token log-probabilities in float32, vocabulary-chunked, at scored positions;
- ``heads``: scalar heads on the backbone (``RewardModel``, ``PolicyWithValue``);
- ``vision``: vision-language backbones (Gemma 3, Gemma 4, Qwen 3.5 with their vision
  encoders): the images of the batch being processed (``images``), the backbone's image inputs;
  ``vision_tower``: the tower's weights (frozen by default, ``--train-vision``, LoRA on it).

It may import only config-level modules (``config``, ``chat``, ``sharding``, ``checkpoint``,
``metrics_log``) and third-party libraries: never data, losses, algorithms, train or tasks.
"""

from nnx_posttrain.model.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from nnx_posttrain.model.attention import attention_of, set_attention
from nnx_posttrain.model.blocks import (
    decoder_blocks,
    frozen_stacks,
    given_stacks,
    override_blocks,
    segment_attention_mask,
    set_remat,
    takes_positions,
)
from nnx_posttrain.model.heads import PolicyWithValue, RewardModel
from nnx_posttrain.model.layer_scan import MODES as SCAN_MODES
from nnx_posttrain.model.layer_scan import scanning, set_scan
from nnx_posttrain.model.dtypes import AUTO, DTYPES, checkpoint_dtype, resolve_dtype, weights_bytes
from nnx_posttrain.model.load import (
    PRESETS,
    TINY,
    LanguageModel,
    ModelLoadError,
    Tokenizer,
    chat_format_for,
    chat_format_of,
    describe,
    eval_shape_task,
    is_local_model,
    load,
    load_tokenizer,
    nnx_ready,
    register_builtin,
    warm_up,
)
from nnx_posttrain.model.quantize import dequantized_into, quantize, quantized_layers
from nnx_posttrain.model.router import captured as routers_captured
from nnx_posttrain.model.logprobs import (
    LOGPROBS,
    Projection,
    assume_device_memory,
    full_logits,
    hidden_states,
    logprobs_from_hidden,
    paired_terms,
    scored_positions,
    token_logprobs,
    vocabulary_logits,
)
from nnx_posttrain.model.vision import images, outside_the_trace, reads_images
from nnx_posttrain.model.vision_tower import freeze_tower, tower_trains
from nnx_posttrain.model.lora import (
    ATTENTION_LAYERS,
    LORA_TARGETS,
    count_params,
    enable_lora,
    has_lora,
    lora_delta,
    lora_disabled,
    merge,
    named_variables,
    split,
    trainable_filter,
)

__all__ = [
    # load
    "AUTO", "DTYPES", "PRESETS", "TINY", "LanguageModel", "ModelLoadError", "Tokenizer",
    "chat_format_for", "chat_format_of", "checkpoint_dtype", "describe", "eval_shape_task", "is_local_model", "load", "load_tokenizer",
    "nnx_ready", "register_builtin", "resolve_dtype", "warm_up", "weights_bytes",
    # quantize
    "dequantized_into", "quantize", "quantized_layers",
    # router logits of mixtures of experts (the load-balancing loss)
    "routers_captured",
    # lora
    "ATTENTION_LAYERS", "LORA_TARGETS", "count_params", "enable_lora", "has_lora", "lora_delta", "lora_disabled", "merge",
    "named_variables", "split", "trainable_filter",
    # attention
    "ATTENTION_IMPLEMENTATIONS", "attention_of", "set_attention",
    # blocks
    "decoder_blocks", "frozen_stacks", "given_stacks", "override_blocks", "segment_attention_mask", "set_remat", "takes_positions",
    # layer scan
    "SCAN_MODES", "scanning", "set_scan",
    # logprobs
    "LOGPROBS", "Projection", "assume_device_memory", "full_logits", "hidden_states", "logprobs_from_hidden", "paired_terms", "scored_positions", "token_logprobs",
    "vocabulary_logits",
    # heads
    "PolicyWithValue", "RewardModel",
    # vision
    "freeze_tower", "images", "outside_the_trace", "reads_images", "tower_trains",
]
