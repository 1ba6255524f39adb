"""The tokenizer of a loaded model (``Tokenizer``: a plain-Python view of a KerasHub tokenizer)
and building KerasHub tokenizers without Keras' attribute tracking (``untracked``, ``build``).

Keras tracks what is assigned to a layer's attributes: a list or dict is wrapped in a proxy
that checks every entry for variables and layers. A tokenizer's vocabulary is such a dict and
its merges such a list, so a 151,665-token byte-level BPE (Qwen's size) spent 0.7 of the 1.1
CPU-s of its build in that tracking, which finds nothing (strings and ints). ``build`` makes the
tokenizer with Keras' own switch for it off (``untracked``), in this thread and for the build
only: the same tokenizer (vocabulary, merges, ids), its vocabulary a plain dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Callable

import keras


@contextlib.contextmanager
def untracked():
    """Within the block, Keras wraps and tracks nothing assigned to a layer's attributes, in
    this thread; the switch is restored after (also on an error). Keras' own scope for its
    bookkeeping (``keras.src.utils.tracking.DotNotTrackScope``; where a Keras lacks it, the
    block runs tracked). For layers that hold no variable nor layer (``build`` checks it)."""
    try:
        from keras.src.utils.tracking import DotNotTrackScope
    except ImportError:  # another Keras: tracked, as before
        DotNotTrackScope = contextlib.nullcontext
    with DotNotTrackScope():
        yield


def build(make: Callable[[], object]):
    """``make()``, a function that builds a KerasHub tokenizer (its constructor, ``from_preset``),
    called ``untracked``: the same tokenizer, without the cost of tracking its vocabulary. One
    that holds a layer or a variable (none of KerasHub's causal LM tokenizers does) is built
    again as Keras builds it, so that Keras finds them."""
    with untracked():
        tokenizer = make()
    return make() if _holds_layers_or_variables(tokenizer) else tokenizer


_PLAIN = (str, bytes, int, float, bool, type(None))


def _holds_layers_or_variables(layer) -> bool:
    """Whether an attribute of ``layer`` is, or holds in a list, tuple, set or dict's values, a
    Keras layer or variable: what Keras' tracking would have recorded. (A container of plain
    values, a vocabulary, is passed over at once: its types are read in C.)"""
    pending = list(vars(layer).values())
    while pending:
        value = pending.pop()
        if isinstance(value, (keras.layers.Layer, keras.Variable)):
            return True
        items = value.values() if isinstance(value, dict) else value if isinstance(
            value, (list, tuple, set)) else ()
        if not set(map(type, items)).issubset(_PLAIN):
            pending.extend(items)
    return False


class Tokenizer:
    """Plain-Python view of a KerasHub tokenizer: encode to / decode from lists of ints.

    SentencePiece tokenizers (Gemma, Mistral, the built-in one) run through the ``sentencepiece``
    package directly: fast, and picklable for data-loading worker processes.
    """

    def __init__(self, keras_tokenizer):
        self.keras_tokenizer = keras_tokenizer
        proto = getattr(keras_tokenizer, "proto", None)
        self._sp = None
        if proto is not None:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        self.bos_id = _token_id(keras_tokenizer, "start_token_id")
        self.eos_id = _token_id(keras_tokenizer, "end_token_id")
        pad = _token_id(keras_tokenizer, "pad_token_id")
        self.pad_id = pad if pad is not None else (self.eos_id or 0)
        self.vocab_size = int(keras_tokenizer.vocabulary_size())
        self._fingerprint = None

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._sp is not None:
            return self._sp.encode(text)
        return [int(t) for t in keras.ops.convert_to_numpy(self.keras_tokenizer.tokenize(text))]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        out = self.keras_tokenizer.detokenize(ids)  # a str without TensorFlow, else a tensor
        if not isinstance(out, str):
            out = keras.ops.convert_to_numpy(out).item()
        return out.decode() if isinstance(out, bytes) else str(out)

    def token_id(self, piece: str) -> int | None:
        """Id of a single special piece (e.g. '<end_of_turn>'), or None if it is not one token."""
        ids = self.encode(piece)
        return ids[0] if len(ids) == 1 else None

    @property
    def fingerprint(self) -> str | None:
        """A SHA-256 of what decides this tokenizer's ids (a SentencePiece model's bytes, else
        the KerasHub tokenizer's class, config, vocabulary and merges; the special ids), for
        caches of tokenized data (``data.validate``); None where it cannot be told."""
        if self._fingerprint is None:
            digest = hashlib.sha256(repr((self.bos_id, self.eos_id, self.pad_id,
                                          self.vocab_size)).encode())
            data = (self._sp.serialized_model_proto() if self._sp is not None
                    else _keras_description(self.keras_tokenizer))
            if data is None:
                return None
            digest.update(data)
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def __getstate__(self):
        state = dict(self.__dict__)
        state["keras_tokenizer"] = None  # TensorFlow-backed; workers only need the fast path
        if self._sp is not None:
            state["_sp"] = self._sp.serialized_model_proto()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if isinstance(self._sp, bytes):
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=self._sp)


def _keras_description(tok) -> bytes | None:
    """A KerasHub tokenizer's class, config (less its name), vocabulary and merges as bytes;
    None where they cannot be read (an object in the config is named by its repr, which no
    other tokenizer shares: never the same description)."""
    try:
        config = {k: v for k, v in tok.get_config().items() if k != "name"}
        vocabulary = getattr(tok, "vocabulary", None)
        vocabulary = (list(vocabulary.items()) if isinstance(vocabulary, dict)
                      else list(tok.get_vocabulary()))
        merges = list(getattr(tok, "merges", None) or [])
        kind = f"{type(tok).__module__}.{type(tok).__qualname__}"
        return json.dumps([kind, config, vocabulary, merges], default=repr).encode()
    except Exception:  # noqa: BLE001 - not described: not cached
        return None


def _token_id(tok, attr):
    value = getattr(tok, attr, None)
    return None if value is None else int(value)
