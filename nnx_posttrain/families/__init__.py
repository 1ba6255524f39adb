"""Model families: one entry per KerasHub causal-LM family (``FAMILIES``), the one place that
says what the package knows of it.

Adding a family is one ``Family`` (``families.base``) in a module of this package and one line
in ``FAMILIES``: its backbone and task classes, chat format, attention reader, sharding rules,
LoRA target names, Hugging Face export (weight names, config writer, tokenizer), KV-cache
decoding, context length, the Hugging Face model types KerasHub converts, ``--model`` short
names, ``tools.make_preset`` shapes and tokenizer kind, and a tiny test configuration. The rest
of the package reads them: ``model.attention`` (readers), ``sharding`` (rules), ``model.load``
(chat format, model types, short names), ``model.lora`` (targets), ``export.hf`` (export),
``sampling`` (decoding, context), ``tools.make_preset`` (presets). ``tests/test_families.py``
lists the families and fails on one missing a part (``Unsupported`` says why a part is absent).

``prepare(backbone)`` runs the family's repair of a KerasHub backbone (``Family.prepare``);
``building(backbone, dtype)`` is the context to build one in (``Family.ignores_dtype``).

Lookups: ``of(backbone)`` (an instance or a class name), ``by_model_type``, ``attention_reader``,
``recurrent_layer`` (a block's recurrent mixer: ``Family.recurrent``).
"""

from __future__ import annotations

import contextlib

from nnx_posttrain.families.base import (  # noqa: F401  (the records, re-exported)
    Decoding,
    Export,
    ExportError,
    ExpertLayer,
    Family,
    LayerSpec,
    MoE,
    PeftExperts,
    Preset,
    Reader,
    Unsupported,
    refuse,
)
from nnx_posttrain.families.gemma import GEMMA, GEMMA3
from nnx_posttrain.families.gemma4 import GEMMA4
from nnx_posttrain.families.llama import LLAMA2, LLAMA3, MISTRAL
from nnx_posttrain.families.gpt_oss import GPT_OSS
from nnx_posttrain.families.moe import MIXTRAL, QWEN3_MOE
from nnx_posttrain.families.phi3 import PHI3
from nnx_posttrain.families.qwen import QWEN2, QWEN3
from nnx_posttrain.families.qwen3_5 import QWEN3_5
from nnx_posttrain.families.qwen3_5_moe import QWEN3_5_MOE
from nnx_posttrain.families.smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {f.name: f for f in (
    GEMMA, GEMMA3, GEMMA4, LLAMA2, LLAMA3, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL,
    GPT_OSS, PHI3, SMOLLM3, QWEN3_5, QWEN3_5_MOE,
)}
_BY_BACKBONE = {f.backbone: f for f in FAMILIES.values()}


def of(backbone) -> Family | None:
    """The family of ``backbone`` (a KerasHub backbone, or its class name), or None."""
    name = backbone if isinstance(backbone, str) else type(backbone).__name__
    return _BY_BACKBONE.get(name)


def by_model_type(model_type: str) -> Family | None:
    """The family KerasHub converts a Hugging Face ``model_type`` to, or None."""
    return next((f for f in FAMILIES.values() if not isinstance(f.hf_model_types, Unsupported)
                 and model_type in f.hf_model_types), None)


def attention_reader(layer) -> Reader | None:
    """The reader of a KerasHub attention layer, by its class name (a class shared by two
    families has one reader), or None for a class no family knows."""
    name = type(layer).__name__
    return next((f.attention[name] for f in FAMILIES.values() if name in f.attention), None)


def attention_classes() -> set[str]:
    """Every attention layer class name some family reads."""
    return {name for f in FAMILIES.values() for name in f.attention}


def recurrent_layer(block):
    """The recurrent token mixer of a KerasHub decoder block that has one instead of attention
    (a class of some family's ``Family.recurrent``: Qwen 3.5's Gated DeltaNet), else None."""
    known = {name for f in FAMILIES.values() for name in f.recurrent}
    return next((layer for layer in block._flatten_layers(include_self=False, recursive=False)
                 if type(layer).__name__ in known), None)


def short_names() -> dict[str, str]:
    """``--model`` short names -> KerasHub preset handles, of every family."""
    return {k: v for f in FAMILIES.values() for k, v in f.short_names.items()}


def presets() -> dict[str, tuple[Family, Preset]]:
    """``tools.make_preset --like`` names -> (family, preset), of every family."""
    return {like: (f, p) for f in FAMILIES.values() if not isinstance(f.presets, Unsupported)
            for like, p in f.presets.items()}


def context_lengths() -> dict[str, int]:
    """{backbone class name: the longest context of the family's released checkpoints}."""
    return {f.backbone: f.context_length for f in FAMILIES.values()}


def prepare(backbone):
    """Run the family's repair of ``backbone`` (``Family.prepare``) where it has one; returns
    ``backbone``."""
    family = of(backbone)
    if family is not None and family.prepare is not None:
        family.prepare(backbone)
    return backbone


@contextlib.contextmanager
def building(backbone: str, dtype):
    """While active, a backbone of class ``backbone`` is built as its family needs: in
    ``dtype`` (a Keras dtype policy name) where the family ignores its ``dtype`` argument
    (``Family.ignores_dtype``: SmolLM3; Keras' global policy is ``dtype`` until the block ends),
    and within the family's ``build_context``. Other families: nothing changes."""
    family = of(backbone or "")
    with contextlib.ExitStack() as stack:
        if family is not None and family.build_context is not None:
            stack.enter_context(family.build_context())
        if family is not None and family.ignores_dtype and dtype is not None:
            import keras

            stack.callback(keras.config.set_dtype_policy, keras.config.dtype_policy())
            keras.config.set_dtype_policy(dtype)
        yield
