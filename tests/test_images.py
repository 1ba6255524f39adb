"""Vision-language records (TRL's vision formats): images read, placed, decoded and resized by
KerasHub's Gemma 3 image converter in the data transforms; image tokens out of the loss; bad
images refused by file, line and field (or skipped with ``skip_bad``)."""

import base64
import io
import json

import numpy as np
import pytest

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras_hub)
import keras_hub  # noqa: E402
import sentencepiece as spm  # noqa: E402
from PIL import Image  # noqa: E402

from nnx_posttrain import chat, data  # noqa: E402
from nnx_posttrain.data import DataError  # noqa: E402
from nnx_posttrain.data.images import ImageSpec, decode  # noqa: E402
from nnx_posttrain.model import Tokenizer  # noqa: E402

TOKENS_PER_IMAGE = 4
SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<img>", "\n"]


@pytest.fixture(scope="module")
def keras_tok():
    """A Gemma 3 tokenizer from a tiny SentencePiece vocabulary (with Gemma 3's image tokens)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["How many red shapes are in the picture? 0 1 2 3 4 user model"] * 20),
        model_writer=model, vocab_size=320, model_type="bpe", character_coverage=1.0,
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=SPECIAL,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return keras_hub.tokenizers.Gemma3Tokenizer(proto=model.getvalue())


@pytest.fixture(scope="module")
def tok(keras_tok):
    return Tokenizer(keras_tok)


@pytest.fixture(scope="module")
def converter():
    return keras_hub.layers.Gemma3ImageConverter(image_size=(8, 8), scale=1 / 127.5, offset=-1.0)


@pytest.fixture(scope="module")
def spec(converter):
    return ImageSpec(converter, TOKENS_PER_IMAGE, max_images=2)


def picture(seed, size=(12, 10)):
    return np.random.default_rng(seed).integers(0, 256, size + (3,), dtype=np.uint8)


def png(array) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def user(*parts):
    return {"role": "user", "content": list(parts)}


IMAGE, ASK = {"type": "image"}, {"type": "text", "text": "How many red shapes?"}
ANSWER = {"role": "assistant", "content": "3"}


def write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data.JsonlSource(path)


def test_a_record_with_images_is_read_placed_and_kept_out_of_the_loss(tmp_path, tok, spec, converter):
    (tmp_path / "a.png").write_bytes(png(picture(0)))
    src = write(tmp_path, [{"images": ["a.png"], "messages": [user(IMAGE, ASK), ANSWER]}])
    ex = data.Tokenize(tok, "gemma", 64, images=spec)(src[0])
    assert ex["pixel_values"].shape == (2, 8, 8, 3) and ex["image_count"] == 1
    expected = np.asarray(converter(picture(0)[None]))[0]
    np.testing.assert_array_equal(ex["pixel_values"][0], expected)
    np.testing.assert_array_equal(ex["pixel_values"][1], np.asarray(converter(np.zeros((1, 8, 8, 3))))[0])
    image_ids = [tok.token_id(t) for t in ("<start_of_image>", "<img>", "<end_of_image>")]
    assert ex["vision_mask"].sum() == TOKENS_PER_IMAGE
    assert np.all(ex["input_ids"][ex["vision_mask"] == 1] == image_ids[1])
    assert not ex["loss_mask"][np.isin(ex["input_ids"], image_ids)].any()
    text = data.Tokenize(tok, "gemma", 64)({"messages": [user(ASK), ANSWER]})
    learned = ex["input_ids"][ex["loss_mask"] == 1]
    np.testing.assert_array_equal(learned, text["input_ids"][text["loss_mask"] == 1])


def keras_hub_gemma3(keras_tok, converter, prompt, response, image):
    """What KerasHub's Gemma3CausalLMPreprocessor gives for (prompt, response, one image): its
    own call where TensorFlow is installed (it needs it); without TensorFlow its rule, step by
    step: each <start_of_image> replaced by "\\n\\n<start_of_image>" + <img> x n +
    "<end_of_image>\\n\\n", BOS + prompt + response + EOS tokenized, the converter on the image."""
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        block = (f"\n\n{keras_tok.start_of_image_token}"
                 f"{keras_tok.image_placeholder * TOKENS_PER_IMAGE}{keras_tok.end_of_image_token}\n\n")
        ids = [keras_tok.start_token_id] + [int(i) for i in keras_tok.tokenize(
            prompt.replace(keras_tok.start_of_image_token, block))]
        ids += [int(i) for i in keras_tok.tokenize(response)] + [keras_tok.end_token_id]
        return np.asarray(converter(image[None]))[0], np.array(ids), np.array(ids) == keras_tok.image_placeholder_id
    pre = keras_hub.models.Gemma3CausalLMPreprocessor(
        keras_tok, converter, sequence_length=64, num_vision_tokens_per_image=TOKENS_PER_IMAGE,
        max_images_per_prompt=1)
    x, _, _ = pre({"prompts": [prompt], "responses": [response], "images": [[image]]})
    n = int(np.asarray(x["padding_mask"][0]).sum())
    return (np.asarray(x["images"][0, 0]), np.asarray(x["token_ids"][0])[:n],
            np.asarray(x["vision_mask"][0])[:n])


def test_pixels_and_image_tokens_equal_keras_hubs_gemma3_preprocessor(keras_tok, tok, converter):
    """TRL's placement (the image before the first user text: what its
    ``prepare_multimodal_messages`` returns, ``test_images_are_placed_as_trl_places_them``)
    through the official Gemma 3 template (jinja), then KerasHub's preprocessor, equal the data
    pipeline's example: token ids, image-token positions and pixel values."""
    jinja2 = pytest.importorskip("jinja2")
    image = picture(1, (20, 14))
    messages = [{"role": "user", "content": "How many red shapes?"}]
    prepared = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "How many red shapes?"}]}]
    template = jinja2.Environment().from_string(chat.hf_template("gemma"))
    prompt = template.render(messages=prepared, bos_token="", add_generation_prompt=True)
    pixels, ids, vision = keras_hub_gemma3(keras_tok, converter, prompt, "3<end_of_turn>\n", image)
    spec = ImageSpec(converter, TOKENS_PER_IMAGE, max_images=1)
    record = {"images": [image], "prompt": messages,
              "completion": [{"role": "assistant", "content": "3"}]}
    ex = data.Tokenize(tok, "gemma", 64, images=spec)(record)
    n = int(ex["attention_mask"].sum())
    np.testing.assert_array_equal(ex["input_ids"][:n], ids[:n])
    # KerasHub's packer adds an EOS after the response; TRL's sequence ends with the turn's end
    assert len(ids) == n + 1 and ids[n] == tok.eos_id
    np.testing.assert_array_equal(ex["vision_mask"][:n], vision[:n])
    np.testing.assert_array_equal(ex["pixel_values"][0], pixels)


def test_every_image_form_decodes_to_the_same_pixels(tmp_path):
    array = picture(2)
    (tmp_path / "p.png").write_bytes(png(array))
    uri = "data:image/png;base64," + base64.b64encode(png(array)).decode()
    forms = [str(tmp_path / "p.png"), png(array), {"bytes": png(array), "path": None},
             {"bytes": None, "path": str(tmp_path / "p.png")}, uri, Image.fromarray(array), array]
    for form in forms:
        np.testing.assert_array_equal(decode(form), array)
    assert decode(array[..., 0]).shape == decode(array[..., :1]).shape == array.shape  # grey
    np.testing.assert_array_equal(decode(np.dstack([array, array[..., :1]])), array)  # RGBA
    with pytest.raises(DataError, match=r"x.jsonl:2: field 'images\[1\]': not an image .* got ndarray"):
        decode(array.astype(np.float32), "x.jsonl:2", "images[1]")


def test_the_spec_of_a_keras_hub_preprocessor(converter):
    """``ImageSpec.from_preprocessor`` reads what a KerasHub vision preprocessor holds (here a
    stand-in with its attribute names: building the real one needs TensorFlow)."""
    from types import SimpleNamespace

    tok = SimpleNamespace(start_of_image_token="<start_of_image>", image_placeholder="<img>",
                          end_of_image_token="<end_of_image>")
    pre = SimpleNamespace(tokenizer=tok, image_converter=converter, num_vision_tokens_per_image=256,
                          max_images_per_prompt=2)
    spec = ImageSpec.from_preprocessor(pre)
    assert (spec.tokens_per_image, spec.max_images, spec.converter) == (256, 2, converter)
    assert spec.expand("a<start_of_image>b") == ("a\n\n<start_of_image>" + "<img>" * 256
                                                  + "<end_of_image>\n\nb")


def test_bad_images_are_refused_by_file_line_and_field(tmp_path, tok, spec):
    good = {"messages": [user(IMAGE, ASK), ANSWER]}
    src = write(tmp_path, [dict(good, images=["missing.png"]),
                           dict(good, images=[base64.b64encode(b"x").decode() + ".png"]),
                           dict(good, image="data:image/png;base64," + base64.b64encode(b"no image").decode()),
                           dict(good, images=[]),
                           {"messages": [user(ASK), ANSWER], "images": ["a.png", "b.png", "c.png"]}])
    t = data.Tokenize(tok, "gemma", 64, images=spec)
    expected = [r"data.jsonl:1: field 'images\[0\]': no such image file 'missing.png'",
                r"data.jsonl:2: field 'images\[0\]': no such image file",
                r"data.jsonl:3: field 'image': not a readable image \(8 bytes",
                r"data.jsonl:4: field 'images' holds 0 image\(s\) but the conversation has 1",
                r"data.jsonl:5: field 'images' holds 3 images, over the 2"]
    for i, pattern in enumerate(expected):
        with pytest.raises(DataError, match=pattern):
            t(src[i])
    (tmp_path / "a.png").write_bytes(png(picture(0)))
    both = write(tmp_path, [dict(good, images=["a.png"])] + [src[i] for i in range(5)], "mix.jsonl")
    report = data.validate(both, t, skip_bad=True)
    assert (report.records, report.bad, list(report.good_indices)) == (6, 5, [0])
    with pytest.raises(DataError, match=r"mix.jsonl:1: field 'images': this model reads no images"):
        data.Tokenize(tok, "gemma", 64)(both[0])


def test_a_cut_image_is_refused_and_other_formats_carry_the_images(tok, spec):
    image = picture(3)
    prompt = [{"role": "user", "content": "How many red shapes?"}]
    with pytest.raises(DataError, match=r"keeps [0-3] of the 4 image tokens"):
        data.Tokenize(tok, "gemma", 8, images=spec)({"images": [image], "messages": prompt + [ANSWER]})
    pair = {"image": image, "prompt": prompt, "chosen": [ANSWER],
            "rejected": [{"role": "assistant", "content": "4"}]}
    ex = data.TokenizePreference(tok, "gemma", 64, images=spec)(pair)
    assert ex["pixel_values"].shape == (2, 8, 8, 3) and ex["image_count"] == 1
    assert ex["chosen_vision_mask"].sum() == ex["rejected_vision_mask"].sum() == TOKENS_PER_IMAGE
    implicit = {"images": [image], "chosen": prompt + [ANSWER], "rejected": pair["prompt"] + pair["rejected"]}
    assert data.TokenizePreference(tok, "gemma", 64, images=spec)(implicit)["chosen_vision_mask"].sum() == 4
    ex = data.TokenizePrompt(tok, "gemma", 32, images=spec)({"images": [image], "prompt": prompt})
    assert ex["prompt_vision_mask"].sum() == TOKENS_PER_IMAGE and ex["image_count"] == 1
    plain = {"images": [image], "prompt": "<start_of_image> How many red shapes?", "completion": " 3"}
    ex = data.Tokenize(tok, "gemma", 64, images=spec)(plain)  # TRL's standard format: the token
    assert ex["vision_mask"].sum() == TOKENS_PER_IMAGE
    assert ex["loss_mask"].sum() == len(tok.encode(" 3")) + 1  # the completion and EOS only
    with pytest.raises(DataError, match=r"holds 1 image\(s\) but field 'text' has 0 <start_of_image>"):
        data.Tokenize(tok, "gemma", 64, images=spec)({"images": [image], "text": "no marker"})
    unpaired = {"images": [image], "prompt": prompt, "completion": [ANSWER], "label": True}
    assert data.TokenizeUnpaired(tok, "gemma", 64, images=spec)(unpaired)["vision_mask"].sum() == 4
    with pytest.raises(DataError, match=r"field 'completion' has \{'type': 'image'\} parts"):
        data.Tokenize(tok, "gemma", 64, images=spec)(
            {"images": [image], "prompt": [user(IMAGE, ASK)], "completion": [user(IMAGE)]})


def test_text_parts_are_read_by_text_models_and_images_in_parquet(tmp_path, tok, spec):
    """Content parts without images (TRL's structured messages) work with any model; an Arrow /
    Parquet Image feature (a struct of bytes and path, as `datasets` writes it) is read."""
    parts = data.Tokenize(tok, "gemma", 64)({"messages": [user({"type": "text", "text": " How many red shapes? "}), ANSWER]})
    plain = data.Tokenize(tok, "gemma", 64)({"messages": [user(ASK), ANSWER]})
    np.testing.assert_array_equal(parts["input_ids"], plain["input_ids"])
    with pytest.raises(DataError, match=r"chat format 'qwen3' reads none"):
        data.Tokenize(tok, "qwen3", 64, images=spec)({"images": [picture(0)], "messages": [user(IMAGE, ASK), ANSWER]})
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.array([{"bytes": png(picture(4)), "path": "p.png"}],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    messages = pa.array([[user(IMAGE, ASK), {"role": "assistant", "content": [{"type": "text", "text": "3"}]}]])
    pq.write_table(pa.table({"image": image, "messages": messages}), tmp_path / "d.parquet")
    ex = data.Tokenize(tok, "gemma", 64, images=spec)(data.ParquetSource(tmp_path / "d.parquet")[0])
    assert ex["image_count"] == 1 and ex["vision_mask"].sum() == TOKENS_PER_IMAGE


@pytest.mark.slow  # imports TRL (and with it torch and transformers): seconds
def test_images_are_placed_as_trl_places_them():
    """``place_images`` puts and counts images as TRL 1.16's ``prepare_multimodal_messages``."""
    from nnx_posttrain.data.images import place_images

    trl_data = pytest.importorskip("trl.data_utils")
    cases = [([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."},
               ANSWER, {"role": "user", "content": "Again."}], 2),
             ([user(ASK, IMAGE), ANSWER], 1), ([user(ASK), ANSWER], 0)]
    for messages, n in cases:
        ours = place_images({"messages": messages}, n)["messages"]
        theirs = trl_data.prepare_multimodal_messages(messages, images=[object()] * n)
        kinds = [[p["type"] for p in m["content"]] if isinstance(m["content"], list) else ["text"]
                 for m in ours]
        assert kinds == [[p["type"] for p in m["content"]] for m in theirs]
    with pytest.raises(ValueError, match="does not match"):  # a placeholder without its image
        trl_data.prepare_multimodal_messages([user(IMAGE, ASK), ANSWER], images=[])
    with pytest.raises(DataError, match="holds 0 image"):
        place_images({"messages": [user(IMAGE, ASK), ANSWER]}, 0)


def test_grain_batches_carry_the_pixels_and_packing_refuses_them(tok, spec):
    from nnx_posttrain.tasks import shapes

    src = data.ListSource([shapes.sft_record(i) for i in range(4)], "shapes")
    t = data.Tokenize(tok, "gemma", 64, images=spec)
    batch = next(data.train_batches(src, t, batch_size=2, seed=0))
    assert batch["pixel_values"].shape == (2, 2, 8, 8, 3) and batch["vision_mask"].shape == (2, 64)
    assert list(batch["image_count"]) == [1, 1] and batch["vision_mask"].sum() == 2 * TOKENS_PER_IMAGE
    with pytest.raises(DataError, match=r"packing does not carry images.*TRL 1\.16 "
                       r"refuses it too.*leave out --batching.packing"):  # a choice, as TRL
        data.packed_train_batches(src, t, batch_size=2, seed=0)


def test_exact_match_prompts_read_text_parts_and_refuse_images():
    src = data.ListSource([{"messages": [user({"type": "text", "text": "2 + 3?"}), ANSWER]}], "parts")
    assert data.prompts_and_answers(src, "gemma", 1) == [
        ([("<start_of_turn>user\n2 + 3?<end_of_turn>\n<start_of_turn>model\n", False)], "3")]
    with pytest.raises(DataError, match=r"images\[0\]: field 'images': this model reads no images"):
        data.prompts_and_answers(data.ListSource([{"images": [picture(0)], "messages": [user(IMAGE, ASK), ANSWER]}],
                                                 "images"), "gemma", 1)
