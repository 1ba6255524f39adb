"""Tokenizers built without Keras' attribute tracking (``model.tokenizer.build``) are KerasHub's
tokenizers: the same vocabulary and ids, and nothing of Keras' state left changed."""

import json

import keras
import keras_hub
import pytest
from keras.src.utils import tracking

from nnx_posttrain.model import tokenizer as tokenizer_build
from nnx_posttrain.tasks import tokenizer as builtin
from tools import make_preset

TEXTS = ["12 + 34 = 46", "<start_of_turn>user\nWhat is 7 + 8?<end_of_turn>\n",
         "<|im_start|>user\nhello wörld 🙂<|im_end|>\n", " leading  spaces\tand tabs"]


def _ids(tok, text):
    return [int(i) for i in keras.ops.convert_to_numpy(tok.tokenize(text))]


def _same_tokenizer(ours, keras_hubs):
    assert type(ours) is type(keras_hubs)
    assert ours.get_vocabulary() == keras_hubs.get_vocabulary()
    assert {**ours.get_config(), "name": ""} == {**keras_hubs.get_config(), "name": ""}
    for name in ("start_token_id", "end_token_id", "pad_token_id"):
        assert getattr(ours, name, None) == getattr(keras_hubs, name, None)
    for text in TEXTS:
        assert _ids(ours, text) == _ids(keras_hubs, text)
        assert ours.detokenize(_ids(ours, text)) == keras_hubs.detokenize(_ids(ours, text))


def test_the_builtin_tokenizer_built_untracked_is_kerashubs():
    proto = builtin.builtin_proto()
    make = lambda: keras_hub.models.GemmaTokenizer(proto=proto)  # noqa: E731
    _same_tokenizer(tokenizer_build.build(make), make())
    assert tracking.is_tracking_enabled()


def test_a_bpe_preset_built_untracked_is_kerashubs(tmp_path):
    """A byte-level BPE preset (Qwen's layout) read back by ``Tokenizer.from_preset``: the
    vocabulary and merges stay plain containers (no tracking proxies), the ids are the same."""
    make_preset.qwen_tokenizer(4096).save_to_preset(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(  # a preset's tokenizer, no weights at all
        {"module": "keras_hub.src.models.qwen.qwen_backbone", "class_name": "QwenBackbone",
         "config": {}, "registered_name": "keras_hub>QwenBackbone"}))
    make = lambda: keras_hub.models.Tokenizer.from_preset(str(tmp_path))  # noqa: E731
    ours, keras_hubs = tokenizer_build.build(make), make()
    _same_tokenizer(ours, keras_hubs)
    assert type(keras_hubs.vocabulary) is tracking.TrackedDict  # what the build saves
    assert type(ours.vocabulary) is dict and type(ours.merges) is list
    assert ours.merges == keras_hubs.merges
    assert tracking.is_tracking_enabled()


def test_tracking_is_restored_after_an_error_and_a_layer_inside_is_tracked():
    """The switch is Keras' state again after an error in the block; a tokenizer that holds a
    layer (in a list) is built again tracked, so that Keras finds the layer."""

    def fails():
        with tokenizer_build.untracked():
            assert not tracking.is_tracking_enabled()
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError):
        fails()
    assert tracking.is_tracking_enabled()

    class Holder(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.parts = [keras.layers.Dense(2)]

    held = tokenizer_build.build(Holder)
    assert [type(layer) for layer in held._layers] == [keras.layers.Dense]


def test_fingerprints_tell_tokenizers_apart():
    """``model.Tokenizer.fingerprint`` (what ``data.validate`` keeps its reports by): equal for
    tokenizers built from the same data, different for another vocabulary or special tokens."""
    from nnx_posttrain.model import Tokenizer

    def sp(proto):
        return Tokenizer(keras_hub.models.GemmaTokenizer(proto=proto)).fingerprint

    bpe = [Tokenizer(make_preset.qwen_tokenizer(4096, qwen3=q)).fingerprint
           for q in (False, False, True)]
    assert bpe[0] == bpe[1] != bpe[2] and None not in bpe
    assert sp(builtin.builtin_proto()) == sp(builtin.builtin_proto()) != sp(
        make_preset.gemma_proto(4096))
