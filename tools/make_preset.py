"""Build a KerasHub preset with a real model's dimensions, random weights and a tokenizer of the
full vocabulary size, for offline runs at real scale (no weights can be downloaded here).

    python -m tools.make_preset --like gemma_2b --out /tmp/gemma_2b_like          # 5.0 GB, bf16
    python -m tools.make_preset --like qwen2.5_0.5b --out DIR --scale 0.05         # same path, small

The preset is what ``save_to_preset`` writes (config.json, metadata.json, model.weights.h5 or,
past its 10 GiB ``max_shard_size``, model.weights.json and its shards as the published presets,
preprocessor and tokenizer assets) and loads through KerasHub's own ``from_preset``, so
``--model DIR`` exercises the real loading path. The tokenizer is synthetic but of the real kind
and size: a SentencePiece BPE model (Gemma's id layout and chat markers, byte fallback) or a
byte-level BPE (Llama 3's / Qwen's special tokens at their real ids), built deterministically
from generated merges rather than trained (a corpus that yields 256,000 merges does not exist
offline). ``--scale F`` shrinks the width, head size, MLP and depth by F (the vocabulary and the
head counts stay): the small version of the same path that the tests run. ``--config-only``
writes the preset without its weight file (config, metadata, tokenizer: a few MB whatever the
size): enough for ``nnx-posttrain plan``, which builds the model abstractly and reads no weight.
The dimensions are those of the published presets' config.json, kept with each family
(``nnx_posttrain.families``: ``Family.presets``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import string
import time
from pathlib import Path

from nnx_posttrain import families
from tools import ToolError, block_init, exit_status

# name -> (family, KerasHub backbone arguments, tokenizer size): every family's presets
# (``nnx_posttrain.families``: ``Family.presets``)
LIKE = {like: (family.name, preset.dims, preset.tokens)
        for like, (family, preset) in families.presets().items()}

# ----------------------------------------------------------------------------- tokenizers

GEMMA_SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
                 106: "<start_of_turn>", 107: "<end_of_turn>"}
# Gemma 4's chat, tool and thinking markers (user-defined: single tokens in text); <|turn> /
# <turn|> at 105 / 106, the others at ids of this package's choosing
GEMMA4_SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
                  **{46 + i: m for i, m in enumerate((
                      "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                      "<tool_response|>", '<|"|>', "<|channel>", "<channel|>"))},
                  105: "<|turn>", 106: "<turn|>"}
GPT_OSS_SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                   "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")
PHI3_SPECIAL = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")
LLAMA3_SPECIAL = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                  6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>",
                  9: "<|eot_id|>", 10: "<|python_tag|>"}  # offsets from 128,000
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN3_SPECIAL = QWEN_SPECIAL + ["<tool_response>", "</tool_response>", "<think>", "</think>"]

# Characters the generated merges combine (frequent ones first, so short merges come first).
_ALPHABET = (string.ascii_lowercase + " " + string.ascii_uppercase + string.digits
             + ".,:;!?'\"-()[]{}<>/\\_=+*&%$#@|~`^\n\t")


def _grow(base: list[str], count: int) -> list[tuple[str, str]]:
    """``count`` merges (left, right) over ``base`` symbols: every pair of base symbols, then
    every earlier merge extended by a base symbol, and so on (each merge joins two tokens that
    exist, so the result is a valid BPE)."""
    merges, level = [], list(base)
    while len(merges) < count:
        nxt = []
        for left in level:
            for right in base:
                merges.append((left, right))
                nxt.append(left + right)
                if len(merges) == count:
                    return merges
        level = nxt
    return merges


@functools.cache
def gemma_proto(vocab_size: int = 256_000) -> bytes:
    """A SentencePiece BPE model of exactly ``vocab_size`` pieces in Gemma's layout: pad 0,
    eos 1, bos 2, unk 3, the chat turn markers at 106 / 107 (user-defined, so they are single
    tokens in text), newlines kept verbatim, byte fallback (any text encodes), no dummy prefix."""
    return sentencepiece_proto(vocab_size, "gemma")


@functools.cache
def sentencepiece_proto(vocab_size: int, layout: str = "gemma") -> bytes:
    """A SentencePiece BPE model of exactly ``vocab_size`` pieces: ``gemma``'s layout (see
    ``gemma_proto``; ``gemma4``: Gemma 4's markers, ``GEMMA4_SPECIAL``) or ``llama``'s (Llama 2 / Mistral: unk 0, <s> 1, </s> 2, SentencePiece's
    dummy prefix on; ``phi3``: with Phi-3's chat markers), byte fallback, generated merges."""
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    P = spm_pb2.ModelProto.SentencePiece
    proto = spm_pb2.ModelProto()
    t = proto.trainer_spec
    t.model_type = spm_pb2.TrainerSpec.BPE
    t.vocab_size, t.byte_fallback = vocab_size, True
    n = proto.normalizer_spec
    n.name, n.remove_extra_whitespaces, n.escape_whitespaces = "identity", False, True
    pieces: list[tuple[str, int]] = []
    if layout in ("gemma", "gemma4"):
        specials = GEMMA_SPECIAL if layout == "gemma" else GEMMA4_SPECIAL
        t.pad_id, t.eos_id, t.bos_id, t.unk_id = 0, 1, 2, 3
        t.pad_piece, t.eos_piece, t.bos_piece, t.unk_piece = "<pad>", "<eos>", "<bos>", "<unk>"
        n.add_dummy_prefix = False
        special_type = {"<pad>": P.CONTROL, "<eos>": P.CONTROL, "<bos>": P.CONTROL,
                        "<unk>": P.UNKNOWN}
        for i in range(max(specials) + 1):
            name = specials.get(i, f"<unused{i}>")
            kind = special_type.get(name, P.USER_DEFINED if i in specials else P.CONTROL)
            pieces.append((name, kind))
        pieces += [("\n", P.USER_DEFINED), ("\n\n", P.USER_DEFINED)]
    elif layout in ("llama", "phi3"):
        t.unk_id, t.bos_id, t.eos_id, t.pad_id = 0, 1, 2, -1
        t.unk_piece, t.bos_piece, t.eos_piece = "<unk>", "<s>", "</s>"
        n.add_dummy_prefix = True
        pieces += [("<unk>", P.UNKNOWN), ("<s>", P.CONTROL), ("</s>", P.CONTROL)]
        if layout == "phi3":  # Phi-3's chat markers (its ids are 32,000 and up; ours follow </s>)
            pieces += [(m, P.USER_DEFINED) for m in PHI3_SPECIAL]
    else:
        raise ValueError(f"layout must be 'gemma', 'gemma4', 'llama' or 'phi3', got {layout!r}")
    pieces += [(f"<0x{b:02X}>", P.BYTE) for b in range(256)]
    symbols = [c if c != " " else "\u2581" for c in _ALPHABET if c not in "\n"]
    pieces += [(s, P.NORMAL) for s in symbols]
    for left, right in _grow(symbols, vocab_size - len(pieces)):
        pieces.append((left + right, P.NORMAL))
    for i, (name, kind) in enumerate(pieces[:vocab_size]):
        piece = proto.pieces.add()
        piece.piece, piece.type = name, kind
        piece.score = 0.0 if kind != P.NORMAL else -float(i)
    if len(proto.pieces) != vocab_size:
        raise ValueError(f"built {len(proto.pieces)} pieces, expected {vocab_size}")
    return proto.SerializeToString()


@functools.cache
def _byte_unicode() -> list[str]:
    """GPT-2's byte -> printable unicode character table (byte-level BPE's base symbols)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def byte_bpe(num_merged: int, special: dict[int, str]) -> tuple[dict[str, int], list[str]]:
    """(vocabulary, merges) of a byte-level BPE: the 256 byte symbols, ``num_merged`` merged
    tokens, and the ``special`` tokens at their ids (which must follow the others)."""
    base = _byte_unicode()
    to_sym = {chr(b): base[b] for b in range(256)}
    symbols = list(dict.fromkeys(to_sym[c] for c in _ALPHABET))
    vocab = {s: i for i, s in enumerate(base)}
    merges = []
    for left, right in _grow(symbols, num_merged):
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append(f"{left} {right}")
    for i, name in sorted(special.items()):
        if i != len(vocab):
            raise ValueError(f"special token {name} at {i}, but {len(vocab)} tokens precede it")
        vocab[name] = i
    return vocab, merges


def build_tokenizer(make):
    """``make()``, a KerasHub tokenizer's constructor, without Keras' tracking of its vocabulary
    (``nnx_posttrain.model.tokenizer.build``: the same tokenizer, ~3-10x cheaper to build)."""
    from nnx_posttrain.model.tokenizer import build

    return build(make)


def llama3_tokenizer(vocab_size: int = 128_256):
    """A Llama3Tokenizer of ``vocab_size`` tokens: byte-level BPE, 256 special tokens at the end
    (``<|begin_of_text|>`` at vocab_size - 256, ``<|eot_id|>`` at vocab_size - 247, ...)."""
    import keras_hub

    first = vocab_size - 256
    special = {first + i: LLAMA3_SPECIAL.get(i, f"<|reserved_special_token_{i}|>")
               for i in range(256)}
    vocab, merges = byte_bpe(first - 256, special)
    return build_tokenizer(lambda: keras_hub.models.Llama3Tokenizer(
        vocabulary=vocab, merges=merges,
        misc_special_tokens={"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}))


def gpt_oss_tokenizer(vocab_size: int = 200_019):
    """A GptOssTokenizer of ``vocab_size`` tokens: byte-level BPE and the harmony format's
    special tokens at the end (``GPT_OSS_SPECIAL``; o200k_harmony's ids are 199,998 and up)."""
    import keras_hub

    first = vocab_size - len(GPT_OSS_SPECIAL)
    vocab, merges = byte_bpe(first - 256, {first + i: n for i, n in enumerate(GPT_OSS_SPECIAL)})
    return build_tokenizer(lambda: keras_hub.models.GptOssTokenizer(
        vocabulary=vocab, merges=merges, unsplittable_tokens=list(GPT_OSS_SPECIAL)))


def smollm3_tokenizer(vocab_size: int = 128_256):
    """A SmolLM3Tokenizer of ``vocab_size`` tokens: Llama 3's layout (byte-level BPE, 256 special
    tokens at the end, ``<|begin_of_text|>`` / ``<|end_of_text|>`` first) with the ChatML turn
    tokens and the think tags among them, as SmolLM3's vocabulary has them (their ids here are
    this tool's)."""
    import keras_hub

    first = vocab_size - 256
    own = {**LLAMA3_SPECIAL, 2: "<|im_start|>", 3: "<|im_end|>", 5: "<think>",
           11: "</think>"}
    special = {first + i: own.get(i, f"<|reserved_special_token_{i}|>") for i in range(256)}
    vocab, merges = byte_bpe(first - 256, special)
    return build_tokenizer(lambda: keras_hub.models.SmolLM3Tokenizer(
        vocabulary=vocab, merges=merges, unsplittable_tokens=["<|im_start|>", "<|im_end|>"]))


def qwen_tokenizer(vocab_size: int = 151_665, qwen3: bool = False, cls: str | None = None):
    """A QwenTokenizer (Qwen3Tokenizer; ``cls``: another class of the same layout, Qwen 3.5's)
    of ``vocab_size`` tokens: byte-level BPE and Qwen's special tokens at the end
    (``<|endoftext|>`` first, ``<|im_start|>``, ``<|im_end|>``, ..., the vision tokens; Qwen 3's
    and 3.5's end with the tool-response and think tags)."""
    import keras_hub

    names = QWEN3_SPECIAL if qwen3 else QWEN_SPECIAL
    first = vocab_size - len(names)
    vocab, merges = byte_bpe(first - 256, {first + i: n for i, n in enumerate(names)})
    cls = cls or ("Qwen3Tokenizer" if qwen3 else "QwenTokenizer")
    return build_tokenizer(lambda: getattr(keras_hub.models, cls)(
        vocabulary=vocab, merges=merges, unsplittable_tokens=list(names)))


# ----------------------------------------------------------------------------- the preset


@dataclasses.dataclass
class Built:
    out: Path
    parameters: int
    bytes_on_disk: int
    seconds: float
    dims: dict


def scaled(dims: dict, scale: float) -> dict:
    """``dims`` with width, head size, MLP and depth multiplied by ``scale`` (head counts and the
    vocabulary kept; sizes stay multiples of 8, head sizes even for rotary embeddings)."""
    if scale == 1:
        return dict(dims)
    out = dict(dims)

    def r8(x, low):
        return max(low, 8 * round(x * scale / 8))

    heads = dims.get("num_query_heads") or dims["num_attention_heads"]  # SmolLM3's name
    head_dim = dims.get("head_dim") or dims["hidden_dim"] // heads
    new_head = r8(head_dim, 8)
    out["num_layers"] = max(2, round(dims["num_layers"] * scale))
    if "intermediate_dim" in dims:  # (Qwen 3.5 MoE has experts and a shared expert only)
        out["intermediate_dim"] = r8(dims["intermediate_dim"], 16)
    if "head_dim" in dims:
        out["head_dim"] = new_head
        out["hidden_dim"] = r8(dims["hidden_dim"], 16)
    else:  # hidden = heads x head size
        out["hidden_dim"] = heads * new_head
    for key in ("sliding_window_size", "sliding_window"):
        if dims.get(key):
            out[key] = max(16, round(dims[key] * scale))
    for key, low in (("global_head_dim", 8), ("moe_intermediate_dim", 16),
                     ("expert_intermediate_dim", 16), ("hidden_size_per_layer_input", 8),
                     ("linear_key_head_dim", 8), ("linear_value_head_dim", 8),
                     ("shared_expert_intermediate_size", 16)):
        if dims.get(key):  # Gemma 4's global layers, the experts, per-layer inputs, Qwen 3.5's
            # Gated DeltaNet heads, Qwen 3.5 MoE's shared expert
            out[key] = r8(dims[key], low)
    for key in ("rope_layer_enabled_list", "layer_types"):  # SmolLM3's, Qwen 3.5's per layer
        if key in dims:
            out[key] = list(dims[key][-out["num_layers"]:])  # Qwen 3.5's ends in attention
    if dims.get("num_kv_shared_layers"):  # Gemma 4 E2B / E4B: a share of the layers, not all
        share = dims["num_kv_shared_layers"] / dims["num_layers"]
        out["num_kv_shared_layers"] = min(out["num_layers"] - 1,
                                          max(1, round(out["num_layers"] * share)))
    return out


def build(like: str, out: str | Path, scale: float = 1.0, dtype: str = "bfloat16",
          seed: int = 0, echo=print, config_only: bool = False) -> Built:
    """Write the preset ``like`` (a key of LIKE) to ``out`` (new or empty); ``config_only``:
    without the weight file (the model is built abstractly, no memory taken)."""
    import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
    import keras

    if like not in LIKE:
        raise ToolError(f"--like must be one of {', '.join(LIKE)}, got {like!r}")
    if not 0 < scale <= 1:
        raise ToolError(f"--scale must be in (0, 1], got {scale}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ToolError(f"--out {out}: exists and is not an empty directory")
    family, dims, tokens = LIKE[like]
    dims = scaled(dims, scale)
    start = time.perf_counter()
    keras.utils.set_random_seed(seed)
    if config_only:
        from nnx_posttrain import model

        def abstract():  # (nnx_ready: Keras' compile bookkeeping is not NNX state)
            return (model.nnx_ready(_task(family, dims, tokens, dtype)),)

        with families.building(families.FAMILIES[family].backbone, None):
            task, = model.eval_shape_task(abstract)
    else:
        with block_init.by_blocks(seed):  # the largest tensors a block of rows at a time
            task = _task(family, dims, tokens, dtype)
    tokenizer, backbone = task.preprocessor.tokenizer, task.backbone
    if tokenizer.vocabulary_size() != tokens:
        raise RuntimeError(f"tokenizer has {tokenizer.vocabulary_size()} tokens, expected {tokens}")
    out.mkdir(parents=True, exist_ok=True)
    if config_only:
        _save_config_only(task, out)
    else:
        task.save_to_preset(str(out))
    params = int(sum(math.prod(v.shape) for v in backbone.weights))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    built = Built(out, params, size, time.perf_counter() - start, dims)
    echo(f"wrote {out}: a {like}-shaped {type(backbone).__name__}"
         + (f" scaled by {scale}" if scale != 1 else "")
         + f", {params:,} parameters ({dtype}{', config only: no weights' * config_only}), "
         f"tokenizer {type(tokenizer).__name__} of {tokens:,} tokens, embedding "
         f"{dims['vocabulary_size']:,} rows; {size / 1e9:.2f} GB, {built.seconds:.0f} s\n  "
         f"{json.dumps(dims)}")
    return built


def _save_config_only(task, out: Path) -> None:
    """What ``save_to_preset`` writes, less the weight file: the task's task.json and the
    backbone's config.json and metadata.json (KerasHub's own preset saver), the preprocessor
    and tokenizer assets. (Without task.json, KerasHub builds the preprocessor from its parts'
    files: Gemma 4's asks for an audio converter's that no text model has.)"""
    from keras_hub.src.utils.preset_utils import CONFIG_FILE, TASK_CONFIG_FILE, KerasPresetSaver

    saver = KerasPresetSaver(str(out))
    task.get_compile_config = lambda: None  # its optimizer's variables are abstract here
    saver._save_serialized_object(task, config_file=TASK_CONFIG_FILE)
    saver._save_serialized_object(task.backbone, config_file=CONFIG_FILE)
    saver._save_metadata(task.backbone)
    task.preprocessor.save_to_preset(str(out))


# synthetic tokenizer kind (``Family.tokenizer``) -> tokenizer of that many tokens
TOKENIZERS = {
    "sentencepiece-gemma": lambda n: _sentencepiece("GemmaTokenizer", gemma_proto(n)),
    "sentencepiece-gemma3": lambda n: _sentencepiece("Gemma3Tokenizer", gemma_proto(n),
                                                     has_vision_tokens=False),
    "sentencepiece-gemma4": lambda n: _sentencepiece(
        "Gemma4Tokenizer", sentencepiece_proto(n, "gemma4"), has_vision_tokens=False,
        has_video_tokens=False),
    "sentencepiece-llama": lambda n: _sentencepiece("LlamaTokenizer", sentencepiece_proto(n, "llama")),
    "sentencepiece-phi3": lambda n: _sentencepiece("Phi3Tokenizer", sentencepiece_proto(n, "phi3")),
    "bpe-gpt_oss": lambda n: gpt_oss_tokenizer(n),
    "bpe-llama3": lambda n: llama3_tokenizer(n),
    "bpe-smollm3": lambda n: smollm3_tokenizer(n),
    "bpe-qwen2": lambda n: qwen_tokenizer(n),
    "bpe-qwen3": lambda n: qwen_tokenizer(n, qwen3=True),
    "bpe-qwen3_5": lambda n: qwen_tokenizer(n, qwen3=True, cls="Qwen3_5Tokenizer"),
    "bpe-qwen3_5_moe": lambda n: qwen_tokenizer(n, qwen3=True, cls="Qwen3_5MoeTokenizer"),
}


def _sentencepiece(cls: str, proto: bytes, **kwargs):
    import keras_hub

    return build_tokenizer(lambda: getattr(keras_hub.models, cls)(proto=proto, **kwargs))


def _task(family: str, dims: dict, tokens: int, dtype: str):
    """The KerasHub causal LM of ``family`` (a ``families.FAMILIES`` name) with backbone
    ``dims`` and a synthetic tokenizer of ``tokens`` ids (random weights)."""
    import keras_hub

    fam = families.FAMILIES[family]
    task, preprocessor, _ = (getattr(keras_hub.models, c) for c in fam.classes)
    tokenizer = TOKENIZERS[fam.tokenizer](tokens)
    with families.building(fam.backbone, dtype):
        backbone = getattr(keras_hub.models, fam.backbone)(dtype=dtype, **dims)
    families.prepare(backbone)
    return task(backbone=backbone, preprocessor=preprocessor(tokenizer))


def main(argv=None) -> Built:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", required=True, choices=sorted(LIKE))
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply width, head size, MLP and depth by this (default 1: real)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weight dtype saved (default bfloat16, as the real presets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-only", action="store_true",
                        help="no weight file: config and tokenizer only (for nnx-posttrain plan)")
    args = parser.parse_args(argv)
    return build(args.like, args.out, args.scale, args.dtype, args.seed,
                 config_only=args.config_only)


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
