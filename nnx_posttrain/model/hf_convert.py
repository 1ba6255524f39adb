"""Hugging Face checkpoints of a family KerasHub 0.32 has no converter for (``--model DIR``),
read through the family's own export rules inverted: Phi-3 (``phi3``).

KerasHub picks a converter by the config's ``model_type`` (``TransformersPresetLoader``) and
knows none for ``phi3``; ``own_converters`` gives it ours for the duration of a load. Our
converter builds the backbone from the config (refusing scaled rotary frequencies, which the
export does not write; a sliding window, which transformers applies and KerasHub does not, is
not applied and said once), then reads every variable from the tensor the export writes it to
(the family's ``Export.rules``: a fused tensor's rows split back into its parts), so a directory
the export wrote loads back to the same weights; its tokenizer is the directory's
SentencePiece ``tokenizer.model`` with the directory's added tokens (``tokenizer.json``'s
``added_tokens`` or ``added_tokens.json``) past its pieces appended as user-defined pieces at their
ids: Microsoft's published checkpoints hold the chat markers only there (ids 32,000 and up), ours
in the model itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import types
from pathlib import Path

import numpy as np


def from_matrix(tensor: np.ndarray, layout, shape: tuple) -> np.ndarray:
    """The Keras array of ``shape`` that ``export.hf.to_matrix`` writes as ``tensor`` (layouts
    None, "flat" and (output axes, input axes))."""
    if layout is None or layout == "flat":
        return tensor.reshape(shape)
    out_axes, in_axes = layout
    order = out_axes + in_axes
    array = tensor.reshape([shape[a] for a in order])
    return np.transpose(array, np.argsort(order))


def _rows(shape: tuple, layout) -> int:
    """The rows (first axis) of ``export.hf.to_matrix``'s matrix of a Keras array of ``shape``."""
    return math.prod(shape[a] for a in layout[0])


def convert_weights(backbone, loader, config) -> None:
    """Every variable of ``backbone`` from the checkpoint's tensor its family's export rules
    (``Export.rules``) write it to; a part of a fused tensor (``("part", index, 0, layout)``)
    from its rows, after the earlier parts' (``export.hf.weight_map``'s concatenation read
    back). A variable no rule names, or two, stops the load by name."""
    from nnx_posttrain import families

    rules = [(re.compile(p + "$"), name, layout)
             for p, name, layout in families.of(backbone).export.rules(backbone)]
    placed, parts, total = [], {}, {}
    for v in backbone.weights:
        hits = [(m, name, layout) for rx, name, layout in rules if (m := rx.match(v.path))]
        if len(hits) != 1:
            raise ValueError(f"{v.path}: {len(hits)} Hugging Face names")
        m, name, layout = hits[0]
        name = name.format(*m.groups())
        if isinstance(layout, tuple) and layout[0] == "part":
            parts.setdefault(name, {})[layout[1]] = (v, layout[3])
        else:
            placed.append((v, name, layout))
    for name, pieces in parts.items():
        start = 0
        for i in range(len(pieces)):
            v, layout = pieces[i]
            stop = start + _rows(tuple(v.shape), layout)
            placed.append((v, (name, start, stop), layout))
            start = stop
        total[name] = start
    tensors = {}
    for v, name, layout in placed:
        key, rows = (name, None) if isinstance(name, str) else (name[0], name[1:])
        if key not in tensors:
            tensors = {key: np.asarray(loader.get_tensor(key))}  # one tensor held at a time
            if key in total and tensors[key].shape[0] != total[key]:
                raise ValueError(f"{key}: {tensors[key].shape[0]} rows, its parts {total[key]}")
        tensor = tensors[key] if rows is None else tensors[key][rows[0]:rows[1]]
        v.assign(from_matrix(tensor, layout, tuple(v.shape)))


def window_note(window: int) -> str:
    """The line a load of a checkpoint with a sliding window says."""
    return (f"note: this phi3 checkpoint's sliding_window={window} is not applied (KerasHub's "
            f"Phi-3 applies none, as its own Phi-3 presets): sequences longer than {window} "
            "tokens attend further back than transformers' model does")


def phi3_backbone_config(config: dict) -> dict:
    """``Phi3Backbone``'s arguments of a ``phi3`` config; ``ValueError`` for scaled rotary
    frequencies (what the export does not write, unverified). A sliding window is not applied
    (KerasHub applies none): ``window_note`` is said on stderr."""
    rope = config.get("rope_parameters") or {}
    problems = [f"rope_scaling={config['rope_scaling']!r}"] \
        if config.get("rope_scaling") is not None else []
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope['rope_type']!r}")
    if problems:
        raise ValueError(f"this phi3 checkpoint's {', '.join(problems)} is not read (scaled "
                         "rotary frequencies unverified)")
    if config.get("sliding_window") is not None:
        print(window_note(config["sliding_window"]), file=sys.stderr)
    heads = config["num_attention_heads"]
    if config["hidden_size"] % heads or config.get("head_dim", config["hidden_size"] // heads) \
            != config["hidden_size"] // heads:
        raise ValueError("this phi3 checkpoint's head_dim is not hidden_size / heads")
    return dict(
        vocabulary_size=config["vocab_size"], num_layers=config["num_hidden_layers"],
        hidden_dim=config["hidden_size"], intermediate_dim=config["intermediate_size"],
        num_query_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
        layer_norm_epsilon=config["rms_norm_eps"],
        max_sequence_length=config.get("max_position_embeddings", 4096),
        pretraining_sequence_length=config.get("original_max_position_embeddings", 4096),
        rope_max_wavelength=rope.get("rope_theta", config.get("rope_theta", 10_000.0)),
    )


class AddedTokensError(ValueError):
    """A directory's added tokens that cannot be appended to its ``tokenizer.model``."""


def added_tokens(directory) -> tuple[dict, Path | None]:
    """(id -> content, the file) of a Hugging Face directory's added tokens: ``tokenizer.json``'s
    ``added_tokens``, else ``added_tokens.json``'s; ({}, None) where it has neither."""
    directory = Path(directory)
    if (path := directory / "tokenizer.json").is_file():
        listed = json.loads(path.read_text()).get("added_tokens") or []
        if listed:
            return {int(t["id"]): t["content"] for t in listed}, path
    if (path := directory / "added_tokens.json").is_file():
        return {int(i): c for c, i in json.loads(path.read_text()).items()}, path
    return {}, None


def with_added_tokens(proto: bytes, added: dict, source: str = "tokenizer.json") -> bytes:
    """``proto`` (a SentencePiece model) with the ``added`` tokens past its pieces appended as
    user-defined pieces at their ids (those of its own pieces must be those pieces);
    ``AddedTokensError`` naming ``source`` and the token where they are not contiguous."""
    from sentencepiece import sentencepiece_model_pb2 as sp

    model = sp.ModelProto()
    model.ParseFromString(proto)
    n = len(model.pieces)
    for i, content in sorted(added.items()):
        if i < n:
            if model.pieces[i].piece != content:
                raise AddedTokensError(f"{source}: added token {content!r} at id {i}, where "
                                       f"tokenizer.model has {model.pieces[i].piece!r}")
            continue
        if i != len(model.pieces):
            raise AddedTokensError(f"{source}: added token {content!r} at id {i}, not next "
                                   f"after tokenizer.model's pieces (id {len(model.pieces)})")
        model.pieces.add(piece=content, score=0.0, type=sp.ModelProto.SentencePiece.USER_DEFINED)
    return model.SerializeToString() if len(model.pieces) > n else proto


def _sentencepiece_tokenizer(cls, preset, **kwargs):
    from keras_hub.src.utils.preset_utils import get_file

    path = get_file(preset, "tokenizer.model")
    added, source = added_tokens(Path(path).parent)
    if not added:
        return cls(path, **kwargs)
    return cls(proto=with_added_tokens(Path(path).read_bytes(), added, str(source)), **kwargs)


def _phi3():
    import keras_hub

    return types.SimpleNamespace(backbone_cls=keras_hub.models.Phi3Backbone,
                                 convert_backbone_config=phi3_backbone_config,
                                 convert_weights=convert_weights,
                                 convert_tokenizer=_sentencepiece_tokenizer)


CONVERTERS = {"phi3": _phi3}  # model_type -> our converter (a KerasHub converter's functions)


@contextlib.contextmanager
def own_converters():
    """KerasHub's loader of Hugging Face directories with ``CONVERTERS`` for the model types it
    has none for, while the block runs."""
    from keras_hub.src.utils.preset_utils import PresetLoader
    from keras_hub.src.utils.transformers import preset_loader

    cls = preset_loader.TransformersPresetLoader
    original = cls.__init__

    def init(self, preset, config):
        if config.get("model_type") not in CONVERTERS:
            return original(self, preset, config)
        PresetLoader.__init__(self, preset, config)
        self.converter = CONVERTERS[config["model_type"]]()

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


