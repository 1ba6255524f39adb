"""What a generation may take: the context of each model family (``CONTEXT_LENGTHS``), the memory
decoding needs beyond the weights (``generation_bytes``), and the check of both before a sampler
is built (``check_generation``). Re-exported by ``sampler``."""

from __future__ import annotations

import keras
import numpy as np

from nnx_posttrain import errors, families, model
from nnx_posttrain.model import device_memory
from nnx_posttrain.model.device_memory import GiB

# The longest context of each family's released checkpoints (``families``: ``context_length``,
# their configs' max_position_embeddings; the longest where a family's sizes differ: Gemma 3 1B
# has 32,768, Llama 3.0 8,192), by backbone class name. Rotary positions past it are untrained:
# a generation that would need them is refused. A model trained for less still gets the
# family's bound.
CONTEXT_LENGTHS = families.context_lengths()


def generation_bytes(module, batch: int, prompt_length: int, max_new_tokens: int) -> int:
    """What decoding ``batch`` prompts of ``prompt_length`` tokens for ``max_new_tokens`` tokens
    allocates beyond the weights: the KV cache of every block, the float32 logits of one
    position (the prompt pass projects only its last)."""
    dtype = kv_layout(module)[2]
    length = prompt_length + max_new_tokens
    width = sum(heads * head_dim for heads, head_dim in filter(None, block_layouts(module)))
    cache = 2 * batch * length * width
    return (cache * np.dtype(dtype).itemsize + state_bytes(module, batch)
            + 4 * batch * int(module.vocabulary_size))


def state_bytes(module, batch: int) -> int:
    """The recurrent blocks' states (Qwen 3.5's Gated DeltaNet: ``Decoding.state``) for
    ``batch`` rows, whatever the length; 0 for a family without recurrent blocks."""
    import jax

    from nnx_posttrain.model.attention import recurrent_layer

    family = families.of(module)
    decoding = family.decoding if family is not None and family.decoding else None
    if decoding is None or decoding.state is None:
        return 0
    shapes = [jax.eval_shape(lambda block=block: decoding.state(block, batch))
              for block in model.decoder_blocks(module) if recurrent_layer(block) is not None]
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def check_generation(module, batch: int, prompt_length: int, max_new_tokens: int,
                     option: str = "max_new_tokens", memory_check: bool = True) -> None:
    """``ConfigError`` naming ``option`` when a prompt of ``prompt_length`` tokens plus
    ``max_new_tokens`` is longer than the family's context (``CONTEXT_LENGTHS``), or when (with
    ``memory_check``) ``generation_bytes`` is more than the memory free; with the longest
    ``max_new_tokens`` that would pass."""
    name, total = type(module).__name__, prompt_length + max_new_tokens
    context = CONTEXT_LENGTHS.get(name)
    if context and total > context:
        raise errors.ConfigError(
            f"{option} {max_new_tokens:,}: a prompt of up to {prompt_length:,} tokens and "
            f"{max_new_tokens:,} new ones make {total:,} positions, past the {context:,} of "
            f"{name}'s context (nnx_posttrain.sampling.capacity.CONTEXT_LENGTHS); at most "
            f"{max(context - prompt_length, 0):,} new tokens")
    free = device_memory.available_bytes() if memory_check else None
    need = generation_bytes(module, batch, prompt_length, max_new_tokens)
    if free is not None and need > free:
        fixed = generation_bytes(module, batch, prompt_length, 0)
        per_token = generation_bytes(module, batch, prompt_length, 1) - fixed
        fits = max((free - fixed) // per_token, 0)
        raise errors.ConfigError(
            f"{option} {max_new_tokens:,}: decoding {batch} sequences of {total:,} positions needs "
            f"an estimated {need / GiB:,.2f} GiB (KV cache and logits; "
            f"nnx_posttrain.sampling.capacity.generation_bytes), and {free / GiB:,.2f} GiB are free; "
            f"at most ~{fits:,} new tokens fit")


def kv_layout(module) -> tuple[int, int, str]:
    """(kv heads, head dim, compute dtype) of the backbone's keys and values."""
    heads = int(module.num_key_value_heads)
    queries = getattr(module, "num_query_heads", None) or module.num_attention_heads  # SmolLM3
    head_dim = getattr(module, "head_dim", None) or module.hidden_dim // queries
    return heads, int(head_dim), keras.backend.standardize_dtype(module.compute_dtype)


def block_layouts(module) -> list:
    """Each decoder block's KV cache: (kv heads, head dim), or None for a block that reads an
    earlier block's (Gemma 4's KV-shared layers) or has a recurrent state instead (Qwen 3.5's
    Gated DeltaNet: ``state_bytes``); the backbone's ``kv_layout`` for every block unless the
    family's ``Decoding`` says otherwise (``layout``, ``kv_source``)."""
    from nnx_posttrain.model.attention import recurrent_layer

    heads, head_dim, _ = kv_layout(module)
    family = families.of(module)
    decoding = family.decoding if family is not None and family.decoding else None
    layout = getattr(decoding, "layout", None) or (lambda block: (heads, head_dim))
    source = getattr(decoding, "kv_source", None) or (lambda block: None)
    return [None if source(block) is not None or recurrent_layer(block) is not None
            else layout(block) for block in model.decoder_blocks(module)]
