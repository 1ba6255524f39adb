"""What ``--model`` names before anything loads: KerasHub presets by short name (``PRESETS``), the
built-in configurations (``TINY``, filled by ``load.register_builtin``) and local directories."""

from __future__ import annotations

import os

# Short names -> KerasHub preset handles (checked against keras_hub.models.CausalLM.presets).
PRESETS = {
    "gemma_2b": "gemma_2b_en",
    "gemma_7b": "gemma_7b_en",
    "gemma_2b_it": "gemma_instruct_2b_en",
    "gemma2_2b": "gemma2_2b_en",
    "gemma2_9b": "gemma2_9b_en",
    "gemma3_270m": "gemma3_270m",
    "gemma3_1b": "gemma3_1b",
    "llama3_8b": "llama3_8b_en",
    "llama3.2_1b": "llama3.2_1b",
    "llama3.2_3b": "llama3.2_3b",
    "qwen2.5_0.5b": "qwen2.5_0.5b_en",
    "qwen2.5_7b": "qwen2.5_7b_en",
    "qwen3_0.6b": "qwen3_0.6b_en",
    "mistral_7b": "mistral_7b_en",
}


# Built-in configurations: name -> GemmaBackbone keyword arguments (Gemma architectures with a
# SentencePiece tokenizer of their own), filled by ``register_builtin``.
TINY: dict[str, dict] = {}


def is_local_model(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))
