"""The built-in task: two-digit addition in chat form, demonstrated by a sloppy teacher and judged by
an exact checker (``arithmetic``), its SentencePiece tokenizer (``tokenizer``) and the tiny Gemma
configurations trained on it (``MODELS``), and the agentic task (``multiply``: two-digit products
with a tool) and its model ``gemma_tiny_tools``, and the image task (``shapes``: count the
coloured shapes in a picture drawn in code; ``--data builtin:shapes``) and its Gemma 3 vision
models (``VISION_MODELS``). Its
recipes, one file per algorithm (``recipes/<algorithm>.yaml``), are the settings a run on the
built-in data gets over the algorithm's defaults (``recipe``).

A *user* of the library, which the lower layers never import: ``register()`` makes its data
(``--data builtin``, through ``nnx_posttrain.data.register_builtin``) and its models (the
``BUILTIN_MODELS`` table, through ``nnx_posttrain.model.register_builtin``) known to them.
Importing this package registers nothing; ``nnx_posttrain.runs`` and ``nnx_posttrain.train``
call ``register()`` before they open data or build a model, and so may anyone who reads the
built-in data or models directly (a notebook, a tool, the tests).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from nnx_posttrain import data, model
from nnx_posttrain.tasks import arithmetic, multiply, shapes, tokenizer

# Gemma architectures with the task's own SentencePiece tokenizer.
MODELS = {
    "gemma_tiny": dict(
        num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=128,
        intermediate_dim=512, head_dim=32,
    ),
    # Gemma 2 features: attention and final-logit soft caps, post norms, sliding window.
    "gemma2_tiny": dict(
        num_layers=4, num_query_heads=4, num_key_value_heads=2, hidden_dim=128,
        intermediate_dim=512, head_dim=32, query_head_dim_normalize=True,
        use_post_ffw_norm=True, use_post_attention_norm=True, attention_logit_soft_cap=50.0,
        final_logit_soft_cap=30.0, use_sliding_window_attention=True, sliding_window_size=32,
    ),
    # gemma_tiny at half its depth: the smaller student of the distillation table
    "gemma_tiny_half": dict(
        num_layers=2, num_query_heads=4, num_key_value_heads=1, hidden_dim=128,
        intermediate_dim=512, head_dim=32,
    ),
    "gemma_micro": dict(  # for fast tests
        num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=32,
        intermediate_dim=64, head_dim=16,
    ),
}

# Vision models. Gemma 3 (KerasHub's Gemma3Backbone + Gemma3VisionEncoder): 16 x 16
# images in 4 x 4 patches, pooled 2 x 2 into 4 image tokens, at most ``max_images`` a sequence.
VISION_MODELS = {
    "gemma3_vision_micro": dict(  # for fast tests
        num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=32,
        intermediate_dim=64, head_dim=16, max_images=2,
        vision=dict(image_size=16, patch_size=4, pool_size=2, num_heads=2, hidden_dim=16,
                    num_layers=1, intermediate_dim=32),
    ),
    # gemma_tiny's text with a 2-layer vision encoder: learns the image task (tools/image_table.py)
    "gemma3_vision_tiny": dict(
        num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=128,
        intermediate_dim=512, head_dim=32, max_images=1,
        vision=dict(image_size=16, patch_size=4, pool_size=2, num_heads=2, hidden_dim=64,
                    num_layers=2, intermediate_dim=128),
    ),
    # Gemma 4 (Gemma4Backbone + Gemma4VisionEncoder): E2B-like text (per-layer inputs, KV-shared
    # layers) with image tokens attending to each other; 16 x 16 images in 4 x 4 patches, pooled
    # 2 x 2 into 4 image tokens
    "gemma4_vision_micro": dict(  # for fast tests
        family="gemma4", num_layers=4, num_query_heads=2, num_key_value_heads=1, hidden_dim=32,
        intermediate_dim=64, head_dim=8, global_head_dim=16, sliding_window_size=8,
        sliding_window_pattern=2, final_logit_soft_cap=30.0,
        global_rope_partial_rotary_factor=0.25, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True,
        use_vision_bidirectional_attention=True, max_images=2,
        vision=dict(image_size=16, patch_size=4, pool_size=2, num_heads=2, hidden_dim=16,
                    num_layers=1, intermediate_dim=32, head_dim=8, position_embedding_size=8),
    ),
    # Qwen 3.5 (Qwen3_5Backbone + Qwen3_5VisionEncoder): a Gated DeltaNet block then a
    # full-attention block with multimodal rotary positions (mrope_section: the 4 rotary pairs
    # of a head as temporal, height, width, temporal); 16 x 16 images in 4 x 4 patches, merged
    # 2 x 2 into 4 image tokens; a byte-level BPE tokenizer with Qwen's special tokens
    "qwen3_5_vision_micro": dict(  # for fast tests
        family="qwen3_5", num_layers=2, num_query_heads=2, num_key_value_heads=1, head_dim=16,
        hidden_dim=32, intermediate_dim=64, layer_types=["linear_attention", "full_attention"],
        partial_rotary_factor=0.5, mrope_section=[2, 1, 1], tie_word_embeddings=True,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_images=2,
        vision=dict(image_size=16, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                    depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                    num_position_embeddings=16),
    ),
}
# The tokenizer data of each vision model's family
_VISION_TOKENIZERS = {None: tokenizer.vision_proto, "gemma4": tokenizer.gemma4_vision_proto,
                      "qwen3_5": tokenizer.qwen3_5_vocabulary}

_RECORDS = {"sft": arithmetic.sft_record, "preference": arithmetic.preference_record,
            "unpaired_preference": arithmetic.unpaired_record,
            "prompt_only": arithmetic.prompt_record}


def records(kind: str, split: str) -> list[dict]:
    """The task's records of one format (``kind``) and split. Training SFT records are the
    teacher's demonstrations (mistakes included, see ``arithmetic``); everything else, and every
    held-out record, is judged by the checker."""
    if (kind, split) == ("sft", "train"):
        return [arithmetic.demonstration_record(a, b) for a, b in arithmetic.demonstrations()]
    return [_RECORDS[kind](a, b) for a, b in arithmetic.problems(split)]


RECIPES = Path(__file__).parent / "recipes"
# each built-in dataset's folder of recipes: the arithmetic task's, the image task's
RECIPE_FOLDERS = {"builtin": RECIPES, "builtin:shapes": RECIPES / "shapes"}


def recipe(algorithm: str, data: str = "builtin") -> Path | None:
    """The recipe file of ``algorithm`` on the built-in dataset ``data`` (``builtin``: the
    arithmetic task, ``builtin:shapes``: the image task); None where it has none."""
    folder = RECIPE_FOLDERS.get(data)
    path = folder / f"{algorithm}.yaml" if folder is not None else None
    return path if path is not None and path.is_file() else None


# Every built-in model: name -> (GemmaBackbone keyword arguments, its tokenizer's SentencePiece
# model); the agentic task's is gemma_tiny with that task's tokenizer (tasks.multiply).
BUILTIN_MODELS = {
    **{name: (dims, tokenizer.builtin_proto) for name, dims in MODELS.items()},
    "gemma_tiny_tools": (MODELS["gemma_tiny"], multiply.tokenizer_proto),
    **{name: (dims, _VISION_TOKENIZERS[dims.get("family")])
       for name, dims in VISION_MODELS.items()},
}


@functools.cache
def fingerprint(module=arithmetic) -> str:
    """A built-in task's fingerprint: the generator's code is the data, its hash changes
    whenever the records may."""
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()


def register() -> None:
    """Make the built-in task's data (``--data builtin``) and models (``BUILTIN_MODELS``) known
    to ``nnx_posttrain.data`` and ``nnx_posttrain.model``: its data unless a built-in task is
    registered already, each model unless its name is (a caller's own registrations stand;
    calling it again changes nothing)."""
    if not data.builtin_registered():
        data.register_builtin(records, fingerprint())
    if not data.builtin_registered("builtin:shapes"):  # the image task (VISION_MODELS train on it)
        data.register_builtin(shapes.records, fingerprint(shapes), "builtin:shapes")
    for name, (dims, proto) in BUILTIN_MODELS.items():
        if name not in model.TINY:
            model.register_builtin(name, dims, proto)
