"""What ``--model`` names before anything loads: KerasHub presets by short name (``PRESETS``), the
built-in configurations (``TINY``, filled by ``load.register_builtin``) and local directories."""

from __future__ import annotations

import os

from nnx_posttrain import families

# Short names -> KerasHub preset handles (each family's ``short_names``; checked against
# keras_hub.models.CausalLM.presets by tests/test_families.py).
PRESETS = families.short_names()


# Built-in configurations: name -> GemmaBackbone keyword arguments (Gemma architectures with a
# SentencePiece tokenizer of their own), filled by ``register_builtin``.
TINY: dict[str, dict] = {}


def is_local_model(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))
