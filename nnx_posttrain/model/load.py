"""Loading a KerasHub causal LM as a ``LanguageModel`` on the NNX backend.

``load(name)`` accepts a built-in configuration (``TINY``, filled by ``register_builtin``), a short
name (``PRESETS``), a KerasHub preset handle, or a local directory (a KerasHub preset or a Hugging
Face checkpoint, which KerasHub converts). Every failure becomes one ``ModelLoadError`` that says
what to do (offline: pass a local directory). It also works around the ``nnx.state`` trap of
KerasHub tasks and warms the backbone up once (abstractly: ``jax.eval_shape``).
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import keras
import keras_hub
from flax import nnx

from nnx_posttrain import chat, errors, families
from nnx_posttrain.model.dtypes import DTYPES, keras_weight_files
from nnx_posttrain.model.names import PRESETS, TINY, is_local_model
from nnx_posttrain.model.quantize import skipped, while_loading
from nnx_posttrain.model import converters, hf_convert, lean_load as lean, vision, vision_builtin
from nnx_posttrain.model.vision_tower import prepare_tower
from nnx_posttrain.model.lora import count_params, trainable_filter
from nnx_posttrain.model.tokenizer import Tokenizer, build as build_tokenizer

_TOKENIZER_PROTOS: dict[str, Callable[[], bytes]] = {}


def register_builtin(name: str, backbone_kwargs: dict,
                     tokenizer_proto: Callable[[], bytes]) -> None:
    """Make ``load(name)`` build a ``GemmaCausalLM`` from ``backbone_kwargs`` (every
    ``GemmaBackbone`` argument but the vocabulary size, which is the tokenizer's) and the
    SentencePiece model that ``tokenizer_proto()`` returns (serialized bytes; called at each load,
    so it may build and cache the model lazily)."""
    TINY[name] = dict(backbone_kwargs)
    _TOKENIZER_PROTOS[name] = tokenizer_proto


_BUILTIN_BACKBONES = {"gemma4": "Gemma4Backbone", "qwen3_5": "Qwen3_5Backbone"}


def _build_builtin(name: str, policy: str, seed: int):
    """The ``GemmaCausalLM`` of a registered built-in configuration, initialised from ``seed``."""
    keras.utils.set_random_seed(seed)
    if "vision" in TINY[name]:  # a Gemma 3, or (``family``) Gemma 4 / Qwen 3.5, with images
        dims = dict(TINY[name])
        build = vision_builtin.BUILDERS[dims.pop("family", None)]
        return build(dims, _TOKENIZER_PROTOS[name](), policy)
    tok = _builtin_gemma_tokenizer(name)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tok.vocabulary_size(), dtype=policy, **TINY[name]
    )
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tok)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)


def _builtin_gemma_tokenizer(name: str):
    """The ``GemmaTokenizer`` of a registered text-only built-in configuration."""
    proto = _TOKENIZER_PROTOS[name]()
    return build_tokenizer(lambda: keras_hub.models.GemmaTokenizer(proto=proto))


class ModelLoadError(errors.ModelError, RuntimeError):
    """A model could not be loaded; the message says what to do."""


@dataclasses.dataclass
class LanguageModel:
    task: keras_hub.models.CausalLM
    tokenizer: Tokenizer
    chat_format: str
    name: str
    images: object = None  # a vision model's ``data.ImageSpec`` (set by ``runs.build_model``)

    @property
    def module(self) -> nnx.Module:
        """The NNX module that training operates on (the backbone, with LoRA when enabled)."""
        return self.task.backbone


def chat_format_for(backbone) -> str | None:
    """The chat template of a KerasHub backbone's family (an instance or its class name;
    ``families``), or None when no template is known for it (Llama 2's LlamaBackbone, ...)."""
    family = families.of(backbone)
    return None if family is None else family.format_of(backbone)


def _chat_format(name: str, family: str, backbone, chosen: str | None) -> str:
    """The run's chat format: ``chosen`` (--chat-format), else the family's; an unknown family
    is refused rather than given a template it was not trained with."""
    if chosen:
        if chosen not in chat.FORMATS:
            raise ModelLoadError(f"--chat-format {chosen!r}: not a chat format; choose one of "
                                 f"{', '.join(chat.FORMATS)}")
        return chosen
    fmt = chat_format_for(backbone if backbone is not None else family)
    if fmt is None:
        raise ModelLoadError(
            f"model {name!r} is a {family}: no chat template is known for this family. Choose "
            f"one with --chat-format NAME ({', '.join(chat.FORMATS)}; e.g. chatml for a model "
            "you fine-tune into ChatML), or use a Gemma, Llama 3, Qwen 2.5 / 3 or Mistral model.")
    return fmt


def chat_format_of(name: str, chosen: str | None = None) -> str | None:
    """The chat format ``load(name, chat_format=chosen)`` will give, read before it loads (a
    built-in model, a local directory's config); None where only loading tells (a preset name,
    a Llama 3 whose version its weights' config decides, a Qwen 3.5 whose size does)."""
    if chosen:
        return chosen
    if name in TINY:
        backbone = _BUILTIN_BACKBONES.get(TINY[name].get("family"), "GemmaBackbone")
        dims = types.SimpleNamespace(hidden_dim=TINY[name]["hidden_dim"])  # (Qwen 3.5's rule)
        return families.of(backbone).format_of(dims)
    handle = PRESETS.get(name, name)
    family = _preset_backbone_class(str(Path(handle).expanduser())) if is_local_model(handle) \
        else None
    return None if family in (None, "Llama3Backbone", "Qwen3_5Backbone") else \
        chat_format_for(family)


def _preset_backbone_class(handle: str) -> str | None:
    """The backbone class a local preset directory will load (read before loading it):
    KerasHub's config.json class name, or a Hugging Face config's model type mapped to it."""
    config = Path(handle) / "config.json"
    if not config.is_file():
        return None
    try:
        saved = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if "class_name" in saved:
        return saved["class_name"]
    family = families.by_model_type(saved.get("model_type"))
    return family.backbone if family else f"Hugging Face model_type {saved.get('model_type')!r}"


def nnx_ready(task: keras_hub.models.CausalLM) -> keras_hub.models.CausalLM:
    """Make ``nnx.state`` / ``nnx.split`` work on a KerasHub task.

    Keras keeps ``_compiled_trainable_state``, a dict keyed by layer objects, on every model; NNX
    sorts dict keys when it flattens a graph and fails with "'<' not supported between instances
    of 'GemmaBackbone' and 'GemmaCausalLM'". We never ``compile()`` the task, so the dict is unused.
    """
    if hasattr(task, "_compiled_trainable_state"):
        del task._compiled_trainable_state
    return task


def eval_shape_task(make: Callable[[], tuple]) -> tuple:
    """``nnx.eval_shape(make)`` for a ``make`` that builds a KerasHub task (and what else it
    returns after it), the task's preprocessor kept out of the traversal and put back on the
    abstract task. KerasHub tracks the preprocessor among the task's layers, and NNX flattens
    every entry of its tokenizer's vocabulary as a node of the graph: a 262,144-token
    vocabulary (Gemma 4's) made 524,400 nodes, 8.7 s to split against 0.13 s for the backbone.
    The preprocessor holds no weights."""
    aside = {}

    def made():
        task, *rest = make()
        aside["preprocessor"] = task.preprocessor
        if task.preprocessor is not None:
            aside["at"] = task._layers.index(task.preprocessor)
            del task._layers[aside["at"]]
            task.preprocessor = None
        return (task, *rest)

    task, *rest = nnx.eval_shape(made)
    if aside["preprocessor"] is not None:
        task.preprocessor = aside["preprocessor"]
        if aside["preprocessor"] not in task._layers:
            task._layers.insert(aside["at"], aside["preprocessor"])
    return (task, *rest)


def load(name: str, dtype: str = "float32", seed: int = 0,
         chat_format: str | None = None, weights: bool = True,
         quantize: str = "none") -> LanguageModel:
    """Load ``name``: a built-in tiny config, a short name, a KerasHub handle or a local directory.

    Local directories may be KerasHub presets (what ``save_to_preset`` writes) or Hugging Face
    checkpoints (config.json + safetensors), which KerasHub converts itself. The weights are
    created in ``dtype``'s variable dtype and the checkpoint read into them (no float32 copy of a
    bfloat16 model). ``chat_format``: the chat template (default: the family's; a family
    without a known template needs one, checked before the weights load when the directory says
    which family it holds). ``weights=False`` reads no weight file (the variables keep their
    initial values): for a model built abstractly (``nnx.eval_shape``) from its config alone.
    ``quantize`` 'int8': a KerasHub preset's layers are quantized as their weights are read
    (``quantize.while_loading``); other models are loaded as they are (``quantize.quantize``
    them after).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    policy = DTYPES[dtype]
    if name in TINY:
        task = _build_builtin(name, policy, seed)
    else:
        handle = PRESETS.get(name, name)
        if is_local_model(handle):
            handle = str(Path(handle).expanduser().resolve())
            family = _preset_backbone_class(handle)
            if family is not None and family.endswith("Backbone"):
                _chat_format(name, family, None, chat_format)  # refuse before the weights load
        elif not (handle.startswith(("kaggle://", "hf://", "modelscope://", "gs://"))
                  or handle in keras_hub.models.CausalLM.presets):
            raise ModelLoadError(
                f"unknown model {name!r}: not a built-in config ({', '.join(TINY) or 'none registered: nnx_posttrain.tasks.register() registers the built-in ones'}), a short name "
                f"({', '.join(PRESETS)}), a KerasHub preset name, a kaggle:// or hf:// handle, or "
                "an existing local directory"
            )
        with vision.preprocessor_without_tensorflow():
            task = _from_preset(name, handle, policy, weights, quantize)
        converters.restore(task, handle)  # a Gemma 4 converter KerasHub's save left defaults
    fmt = _chat_format(name, type(task.backbone).__name__, task.backbone, chat_format)
    tokenizer = getattr(task.preprocessor, "tokenizer", None)
    image_token = getattr(tokenizer, "image_placeholder_id",  # a Gemma 3 / 4 vision model's
                          getattr(tokenizer, "image_token_id", None))  # Qwen 3.5's
    if vision.reads_images(task.backbone) and image_token is not None:
        vision.set_image_token(task.backbone, image_token)
    prepare_tower(task.backbone)  # its blocks merged by NNX, its weights' names stable
    warm_up(task.backbone)
    return LanguageModel(
        task=nnx_ready(task),
        tokenizer=Tokenizer(_tokenizer_of(task, name)),
        chat_format=fmt,
        name=name,
    )


def load_tokenizer(name: str) -> Tokenizer | None:
    """``name``'s tokenizer alone, without its weights (``load``'s names), to compare two models'
    before the second loads; None where KerasHub cannot read it apart from the model."""
    if name in TINY:
        if TINY[name].get("family") in ("gemma4", "qwen3_5"):  # (Gemma 3: GemmaTokenizer)
            return Tokenizer(vision_builtin.tokenizer_of(TINY[name].get("family"),
                                                         _TOKENIZER_PROTOS[name]()))
        return Tokenizer(_builtin_gemma_tokenizer(name))
    handle = PRESETS.get(name, name)
    if is_local_model(handle):
        handle = str(Path(handle).expanduser().resolve())
    try:
        with hf_convert.own_converters():
            return Tokenizer(build_tokenizer(
                lambda: keras_hub.models.Tokenizer.from_preset(handle)))
    except Exception:  # noqa: BLE001 - the model's own load reports what is wrong with it
        return None


def _tokenizer_of(task, name):
    if task.preprocessor is None or getattr(task.preprocessor, "tokenizer", None) is None:
        raise ModelLoadError(f"model {name!r} has no tokenizer: the preset must include one")
    return task.preprocessor.tokenizer


def _reads_keras_weights(handle: str) -> bool:
    """Whether loading ``handle`` reads a KerasHub preset's weight file (every variable), rather
    than converting a Hugging Face checkpoint (which KerasHub ports tensor by tensor): one
    ``model.weights.h5`` or, past KerasHub's ``max_shard_size`` (10 GiB by default: Gemma 4
    E4B's 14.9 GB), ``model.weights.json`` and its shards (``dtypes.keras_weight_files``)."""
    if is_local_model(handle):
        return bool(keras_weight_files(handle))
    return handle in keras_hub.models.CausalLM.presets or handle.startswith("kaggle://")


def _from_preset(name: str, handle: str, policy: str, weights: bool = True,
                 quantize: str = "none"):
    try:
        with lean.first_failures() as failures:
            if not weights:
                return _task_from_preset(handle, dtype=policy, load_weights=False)
            if _reads_keras_weights(handle):
                skip = skipped(_preset_backbone_class(handle) or "")
                with (lean.made_on(lean.loading_device(quantize)), lean.no_initializers(),
                      while_loading(quantize, skip)):
                    return _task_from_preset(handle, dtype=policy)
            return _task_from_preset(handle, dtype=policy)
    except Exception as exc:  # noqa: BLE001 - any failure inside KerasHub becomes one clear message
        first_line = _cause(exc, failures)
        local = is_local_model(handle)
        if local:
            advice = (
                "The directory must be a KerasHub preset (written by save_to_preset: "
                "config.json, metadata.json, model.weights.h5 or model.weights.json and its "
                "shards, tokenizer assets) or a Hugging Face "
                "checkpoint of a family KerasHub converts (config.json, *.safetensors, tokenizer)."
            )
        else:
            advice = (
                "Downloading a preset needs network access to Kaggle or Hugging Face and, for "
                "gated models (Gemma, Llama), an accepted licence and credentials: KAGGLE_USERNAME "
                "and KAGGLE_KEY, or HF_TOKEN. Offline, download the preset on a connected machine "
                "and pass its local directory: --model /path/to/preset."
            )
        raise ModelLoadError(
            f"could not load model {name!r} (KerasHub handle {handle!r}): "
            f"{type(exc).__name__}: {first_line}\n{advice}"
        ) from None


def _cause(exc: Exception, failures: dict) -> str:
    """The first line of ``exc``'s message; where Keras reports objects it could not load
    ("A total of N objects could not be loaded. Example error message for object X:"), the
    first error of each where its weights are stored (``lean.first_failures``: Keras' example
    is its last retry's, at a path where nothing was saved), else Keras' example error."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if "could not be loaded" not in lines[0] or len(lines) < 2:
        return lines[0][:300]
    first = [(getattr(obj, "name", obj), *failures["first"][key])
             for key, (obj, _) in dict(failures["failed"]).items() if key in failures["first"]]
    if not first:
        return f"{lines[0][:300]} {lines[1][:500]}"
    return lines[0].split(".")[0] + "; the first error of each, where its weights are stored: " + \
        "; ".join(f"{name} at {path!r}: {type(error).__name__}: {str(error).strip()[:300]}"
                  for name, path, error in first[:4])


def _task_from_preset(handle: str, **kwargs):
    """``CausalLM.from_preset``; where the family's preprocessor needs TensorFlow (Gemma 3 and 4
    always, KerasHub's text-only path included), the task without it, holding its tokenizer in
    the generic ``CausalLMPreprocessor`` (tokenization is this package's, ``Tokenizer``). A local
    directory loads as its family's task (Gemma 4's backbone also has a draft-model task, which
    KerasHub could pick)."""
    family = families.of(_preset_backbone_class(handle) or "") or next(  # a named preset's
        (f for f in families.FAMILIES.values()
         if handle in getattr(keras_hub.models, f.backbone).presets), None)
    cls = getattr(keras_hub.models, family.classes[0]) if family else keras_hub.models.CausalLM
    with (families.building(family.backbone if family else "", kwargs.get("dtype")),
          hf_convert.own_converters()):  # (Phi-3's Hugging Face directories: ours)
        try:
            task = cls.from_preset(handle, **kwargs)
        except ImportError as exc:
            if "tensorflow" not in str(exc):
                raise
            task = cls.from_preset(handle, preprocessor=None, **kwargs)
    if task.preprocessor is None:
        tokenizer = build_tokenizer(lambda: keras_hub.models.Tokenizer.from_preset(handle))
        task.preprocessor = keras_hub.models.CausalLMPreprocessor(tokenizer=tokenizer)
    return task


def warm_up(backbone) -> None:
    """One abstract call (``load`` makes it; a tool that builds a KerasHub task itself makes it
    too): Keras flips build/bookkeeping flags on the first call, which would
    otherwise happen inside the first trace and cost a second compilation. ``jax.eval_shape``
    traces the call without running it: an eager call compiled and kept one small XLA executable
    per operation (about 110 MB of a tiny model's process). The family's repair of the backbone
    (``families.prepare``) runs first."""
    from nnx_posttrain.model.attention import own_calls

    families.prepare(backbone)
    ids = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    with own_calls(backbone):  # (SmolLM3's attention mutates itself in KerasHub's call)
        jax.eval_shape(lambda i, m: backbone(vision.backbone_inputs(backbone, i, m)), ids, ids)


def describe(lm: LanguageModel) -> str:
    graph_trainable = nnx.state(lm.module, trainable_filter)
    total = count_params(nnx.state(lm.module))
    trainable = count_params(graph_trainable)
    return (
        f"{lm.name}: {type(lm.module).__name__}, {total:,} parameters, {trainable:,} trainable "
        f"({100 * trainable / max(total, 1):.2f}%), vocab {lm.tokenizer.vocab_size}, chat format "
        f"{lm.chat_format}"
    )
