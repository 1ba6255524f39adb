"""The built-in tokenizer: a SentencePiece model trained, in memory, on the built-in task's text.

Its id layout follows Gemma's (pad 0, eos 1, bos 2, unk 3) and it carries Gemma's chat turn
markers as single tokens, so KerasHub's ``GemmaTokenizer`` accepts it unchanged. Byte fallback lets
it encode any text, so user data also works with the tiny built-in models. Digits are split into
single tokens, which is what lets a tiny model learn arithmetic.
"""

from __future__ import annotations

import functools
import io

import sentencepiece as spm

from nnx_posttrain.tasks import arithmetic, shapes

VOCAB_SIZE = 512
CHAT_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Kept verbatim: the chat templates put meaning in newlines.
_USER_SYMBOLS = (*CHAT_TOKENS, "\n")
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<img>")  # Gemma 3's
GEMMA4_TOKENS = ("<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>")  # chat, image


# Qwen 3.5's special tokens a built-in model's byte-level BPE needs: its chat turns, the think
# and tool tags of its template, the vision tokens of KerasHub's Qwen3_5Tokenizer
QWEN3_5_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<think>", "</think>")


@functools.cache
def qwen3_5_vocabulary() -> tuple[dict, list]:
    """(vocabulary, merges) of the built-in Qwen 3.5 vision model's byte-level BPE: the 256 byte
    symbols (no merges: every text encodes, a character a token) and ``QWEN3_5_TOKENS``."""
    from keras_hub.src.tokenizers.byte_pair_tokenizer import bytes_to_unicode

    symbols = [c for _, c in sorted(zip(*bytes_to_unicode()))]
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({name: len(symbols) + i for i, name in enumerate(QWEN3_5_TOKENS)})
    return vocab, []


@functools.cache
def builtin_proto() -> bytes:
    """Serialized SentencePiece model (deterministic: same bytes on every call and machine)."""
    return _train(arithmetic.corpus() + ["user model\n"] * 10, _USER_SYMBOLS)


@functools.cache
def vision_proto() -> bytes:
    """The built-in vision models' SentencePiece model: the arithmetic and image tasks' text,
    with Gemma 3's image tokens as single pieces (KerasHub's ``Gemma3Tokenizer`` needs them)."""
    questions = [shapes.question(colour) for colour in shapes.COLOURS] * 20
    return _train(arithmetic.corpus() + questions + ["user model\n"] * 10,
                  _USER_SYMBOLS + IMAGE_TOKENS)


@functools.cache
def gemma4_vision_proto() -> bytes:
    """The built-in Gemma 4 vision model's SentencePiece model: the same text, with Gemma 4's
    chat and image tokens as single pieces (KerasHub's ``Gemma4Tokenizer`` needs the latter)."""
    questions = [shapes.question(colour) for colour in shapes.COLOURS] * 20
    return _train(arithmetic.corpus() + questions + ["user model\n"] * 10,
                  _USER_SYMBOLS + GEMMA4_TOKENS)


def _train(corpus: list[str], symbols: tuple) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=VOCAB_SIZE,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=list(symbols),
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()
