"""Phi-3's Hugging Face export (transformers' ``Phi3ForCausalLM``), on the micro Phi-3 preset (the
family's tiny configuration with a synthetic Phi-3 SentencePiece tokenizer of 1,024 tokens:
tests/test_newer_families.py's) loaded as a run loads it: the export's logits equal
transformers' on the same weights (its fused ``qkv_proj`` and ``gate_up_proj`` built from
KerasHub's separate kernels); a mis-mapped part of a fused tensor moves them far past that
tolerance, as a sliding window would (the config has none: KerasHub applies none); its
tokenizer files give our ids; LoRA merged gives the LoRA model's logits; the 128k variant's
scaled rotary frequencies and ``--adapters-only`` (fused modules) are refused by name; the
export loads back as ``--model DIR``, and so does a copy laid out as Microsoft publishes
Phi-3-mini (a 2,047 window, not applied and said; the chat markers only as added tokens). The
generic round trip is tests/test_hf_export.py's (``phi3``)."""

import json

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import keras_hub
import numpy as np
import pytest

from nnx_posttrain import families, inspection, model
from nnx_posttrain.export import hf as hf_export

from test_hf_export import (IDS, MASK, exported_micro, hf_logits, loaded_randomized,
                              micro_preset)
from test_hf_export_smollm3 import _copy

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.numpy")
TOLERANCE = 1e-4  # the round trip's (tests/test_hf_export.py)
TOKENS = 1024
TINY = families.FAMILIES["phi3"].tiny["phi3"]
HEAD = TINY["hidden_dim"] // TINY["num_query_heads"]
Q, KV = TINY["num_query_heads"] * HEAD, TINY["num_key_value_heads"] * HEAD


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_preset(tmp_path_factory, "phi3", TOKENS)


@pytest.fixture(scope="module")
def exported(micro, tmp_path_factory):
    """(the model, our logits, its export with the chat template, transformers' logits)."""
    return exported_micro(micro, tmp_path_factory)


@pytest.mark.slow
def test_the_micro_presets_export_gives_transformers_logits(exported):
    lm, ours, directory, theirs = exported
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["model_type"] == "phi3"
    assert config["sliding_window"] is None and config["rope_scaling"] is None
    assert config["rms_norm_eps"] == TINY["layer_norm_epsilon"] and config["vocab_size"] == TOKENS
    tensors = safetensors.load_file(directory / "model.safetensors")
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == (Q + 2 * KV, 32)
    gate_up = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    assert gate_up.shape == (2 * TINY["intermediate_dim"], 32)
    assert "lm_head.weight" in tensors  # untied
    assert np.abs(ours).max() > 1.0  # a scale at which a wrong mapping shows
    np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)


def _rows_swapped(a, b, c, d):
    """The rows [a:b] and [c:d] (of equal size) of a tensor exchanged."""
    def change(t):
        t = t.copy()
        t[a:b], t[c:d] = t[c:d].copy(), t[a:b].copy()
        return t
    return change


MISMAPPED = [
    ("model.layers.0.self_attn.qkv_proj.weight",
     _rows_swapped(Q, Q + KV, Q + KV, Q + 2 * KV)),  # k <-> v
    ("model.layers.1.self_attn.qkv_proj.weight", _rows_swapped(0, KV, Q, Q + KV)),  # q heads <-> k
    ("model.layers.0.mlp.gate_up_proj.weight", _rows_swapped(0, 64, 64, 128)),  # gate <-> up
    ("model.layers.1.self_attn.o_proj.weight", lambda t: t[:, ::-1]),
    ("model.layers.0.input_layernorm.weight", lambda t: t[::-1]),
]


@pytest.mark.slow
def test_a_mis_mapped_tensor_fails_the_round_trip(exported, tmp_path):
    _, ours, directory, _ = exported
    for i, (name, change) in enumerate(MISMAPPED):
        tensors = safetensors.load_file(directory / "model.safetensors")
        tensors[name] = np.ascontiguousarray(change(tensors[name]))
        wrong, _ = hf_logits(_copy(directory, tmp_path / str(i), tensors=tensors))
        assert np.abs(wrong - ours).max() > 100 * TOLERANCE, name


def test_a_sliding_window_in_the_config_fails_the_round_trip(exported, tmp_path):
    """transformers applies ``sliding_window`` (Phi-3-mini-4k's config has 2,047) where KerasHub
    applies none: the export writes none; a window shorter than the 48 positions moves them."""
    _, ours, directory, _ = exported
    config = json.loads((directory / "config.json").read_text())
    wrong, _ = hf_logits(_copy(directory, tmp_path / "w", config=dict(config, sliding_window=8)))
    assert np.abs(wrong - ours).max() > 100 * TOLERANCE


def test_tokenizer_files_give_our_ids(exported):
    """transformers' tokenizer of the export reads a Phi-3 conversation as ours, its markers
    whole, and ends where the config does; a text starting with a marker lacks only ours'
    lone leading SentencePiece "\u2581" (transformers' conversion prepends it to none but a
    text's first word: a known difference, pinned here)."""
    lm, _, directory, _ = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = "What is 12 + 30?<|end|>\n<|assistant|>\n42<|end|>\n<|endoftext|>"
    ours = lm.tokenizer.encode(text)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours
    assert hf_tok.convert_tokens_to_ids("<|assistant|>") in ours
    config = json.loads((directory / "config.json").read_text())
    end = lm.tokenizer.encode("<|endoftext|>")[-1]
    assert hf_tok.eos_token_id == config["eos_token_id"] == end
    turn = "<|user|>\n" + text
    space = lm.tokenizer.encode(" ")[0]
    theirs = hf_tok(turn, add_special_tokens=False)["input_ids"]
    assert [space] + theirs == lm.tokenizer.encode(turn)
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())


def _with_random_lora(lm, targets="all-linear"):
    adapted = model.enable_lora(lm.module, 2, alpha=4.0, targets=targets)
    rng = np.random.default_rng(1)
    for v in lm.module.weights:
        if "lora_kernel" in v.path:
            v.assign(rng.normal(0.0, 0.3, v.shape).astype("float32"))
    return adapted


@pytest.mark.slow
def test_a_merged_lora_exports_with_its_logits(micro, tmp_path):
    """LoRA on every linear layer (q / k / v and gate / up: parts of fused tensors), merged as
    ``nnx-posttrain export`` merges it: transformers' logits are ours; ``--adapters-only`` is
    refused (a fused module's adapter has no verified PEFT form)."""
    lm = loaded_randomized(micro)
    base = np.asarray(model.full_logits(lm.module, IDS, MASK))
    assert len(_with_random_lora(lm)) == 2 * 7
    ours = np.asarray(model.full_logits(lm.module, IDS, MASK))
    assert np.abs(ours - base).max() > 1e-2  # the adapters change the model
    with pytest.raises(hf_export.ExportError, match="fused .*qkv_proj|fused .*gate_up_proj"):
        hf_export.export_adapters(lm.module, tmp_path / "adapter", "float32", base_model="base")
    assert len(inspection.merge_lora(lm.module)) == 2 * 7
    hf_export.export_model(lm.task, tmp_path / "merged", "float32")
    theirs, _ = hf_logits(tmp_path / "merged")
    np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)


def test_scaled_rotary_frequencies_are_refused(tmp_path):
    """Phi-3-mini-128k's "su" scaled rotary frequencies (transformers' ``longrope``) were not
    verified: refused by name, nothing written."""
    half = HEAD // 2
    backbone = keras_hub.models.Phi3Backbone(**dict(
        TINY, rope_scaling_type="su", rope_scaling_short_factor=[1.0] * half,
        rope_scaling_long_factor=[2.0] * half, max_sequence_length=256,
        pretraining_sequence_length=64))
    task = type("Task", (), {"backbone": backbone, "preprocessor": None})()
    with pytest.raises(hf_export.ExportError, match="rope_scaling_type='su'"):
        hf_export.export_model(task, tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- read back


def test_the_export_loads_back_as_model_dir_with_the_same_logits(exported, tmp_path):
    """``--model DIR`` of the export (our converter, ``model.hf_convert``: KerasHub 0.32 has
    none for ``phi3``): a Phi3Backbone of the same weights (the fused tensors split back), the
    family's chat format, the same tokenizer."""
    lm, ours, directory, _ = exported
    back = model.load(str(directory))
    assert type(back.module).__name__ == "Phi3Backbone" and back.chat_format == "phi3"
    np.testing.assert_array_equal(np.asarray(model.full_logits(back.module, IDS, MASK)), ours)
    turn = "<|user|>\nWhat is 12 + 30?<|end|>\n<|assistant|>\n"
    assert back.tokenizer.encode(turn) == lm.tokenizer.encode(turn)
    assert model.load_tokenizer(str(directory)).encode(turn) == lm.tokenizer.encode(turn)


def test_a_checkpoint_with_scaled_rotary_is_refused(exported, tmp_path):
    """What was not verified (the 128k variant's longrope) is refused by name."""
    from nnx_posttrain import errors

    _, _, directory, _ = exported
    config = json.loads((directory / "config.json").read_text())
    long = dict(rope_type="longrope", rope_theta=10_000.0, short_factor=[1.0] * (HEAD // 2),
                long_factor=[2.0] * (HEAD // 2))
    target = _copy(directory, tmp_path / "long", config=dict(config, rope_parameters=long))
    for f in ("tokenizer.model", "tokenizer_config.json"):
        (target / f).symlink_to(directory / f)
    with pytest.raises(errors.ModelError, match="longrope"):
        model.load(str(target))


MARKERS = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")


def _published_style(directory, target, added_json=False):
    """The export as Microsoft publishes Phi-3-mini-4k-instruct: ``sliding_window`` 2,047, a
    ``tokenizer.model`` without the chat markers, which are added tokens past its pieces in
    ``tokenizer.json`` (or ``added_tokens.json``). The ids past the markers' move down: the
    tokenizer's pieces, not its ids, are ours. Returns (the directory, marker -> its id)."""
    from sentencepiece import sentencepiece_model_pb2 as sp

    config = json.loads((directory / "config.json").read_text())
    _copy(directory, target, config=dict(config, sliding_window=2047))
    proto = sp.ModelProto()
    proto.ParseFromString((directory / "tokenizer.model").read_bytes())
    kept = [p for p in proto.pieces if p.piece not in MARKERS]
    assert len(kept) == len(proto.pieces) - len(MARKERS)
    del proto.pieces[:]
    proto.pieces.extend(kept)
    (target / "tokenizer.model").write_bytes(proto.SerializeToString())
    ids = {m: len(kept) + i for i, m in enumerate(MARKERS)}
    listed = {p.piece: i for i, p in enumerate(kept[:3])} | ids  # <unk>, <s>, </s> listed too
    if added_json:
        (target / "added_tokens.json").write_text(json.dumps(ids))
    else:
        (target / "tokenizer.json").write_text(json.dumps({"added_tokens": [
            dict(id=i, content=c, single_word=False, lstrip=False, rstrip=c != "<|endoftext|>",
                 normalized=False, special=True) for c, i in listed.items()]}))
    (target / "tokenizer_config.json").symlink_to(directory / "tokenizer_config.json")
    return target, ids


def test_a_published_style_checkpoint_loads_unwindowed_with_its_added_markers(
        exported, tmp_path, capfd):
    """Microsoft's Phi-3-mini-4k-instruct layout (``_published_style``) loads: the window is not
    applied (as KerasHub's own Phi-3 presets, converted from it) and said once, the logits are
    the export's, the chat markers (added tokens appended as user-defined pieces at their ids)
    encode as single ids, a turn as ours does piece for piece; from ``added_tokens.json``
    too."""
    lm, ours, directory, _ = exported
    turn = "<|user|>\nWhat is 12 + 30?<|end|>\n<|assistant|>\n42<|end|>\n<|endoftext|>"
    pieces = [lm.tokenizer.decode([i]) for i in lm.tokenizer.encode(turn)]
    for i, added_json in enumerate((False, True)):
        target, ids = _published_style(directory, tmp_path / str(i), added_json)
        capfd.readouterr()
        back = model.load(str(target))
        said = capfd.readouterr().err
        assert said.count("sliding_window=2047 is not applied") == 1
        assert "longer than 2047" in said
        logits = np.asarray(model.full_logits(back.module, IDS, MASK))
        np.testing.assert_array_equal(logits, ours)
        encoded = back.tokenizer.encode(turn)
        assert [back.tokenizer.decode([i]) for i in encoded] == pieces
        assert {m: back.tokenizer.encode("x" + m)[-1] for m in MARKERS} == ids
        assert all(ids[m] in encoded for m in MARKERS if m in turn)
        assert len(encoded) == len(lm.tokenizer.encode(turn))


def test_added_tokens_not_next_after_the_pieces_are_refused(exported, tmp_path):
    """An added token whose id leaves a gap after ``tokenizer.model``'s pieces is refused by
    file and token."""
    from nnx_posttrain import errors

    _, _, directory, _ = exported
    target, ids = _published_style(directory, tmp_path / "gap", added_json=True)
    (target / "added_tokens.json").write_text(json.dumps(dict(ids, **{"<|user|>": 2000})))
    with pytest.raises(errors.ModelError, match=r"added_tokens\.json.*<\|user\|>.*2000"):
        model.load(str(target))
