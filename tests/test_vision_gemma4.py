"""Training Gemma 4 with images (the built-in micro ``gemma4_vision_micro``: KerasHub's
``Gemma4Backbone`` with per-layer inputs, KV-shared layers and a ``Gemma4VisionEncoder``): the
data pipeline's image tokens and pixel values are KerasHub's preprocessor's, our forward with
images equals KerasHub's own ``Gemma4CausalLM`` call, SFT and DPO train on TRL's ``messages`` /
``prompt`` + ``images`` JSONL with the tower frozen, and sampling with images is refused by name."""

import json

import jax
import numpy as np
import pytest
from PIL import Image

from nnx_posttrain import chat, data, errors, model, runs
from support import records, tokenized_batch, train_run, vision_model

NAME = "gemma4_vision_micro"
LENGTH = 40
STEPS = ["--steps", "2", "--log-every", "1", "--eval.every", "0", "--eval.exact-match", "0",
         "--batching.batch-size", "2", "--batching.grad-accum", "1", "--checkpoint.every", "0",
         "--optim.schedule", "constant", "--optim.warmup-steps", "0"]


@pytest.fixture(scope="module")
def lm():
    return vision_model(NAME)


def picture(seed, size=(16, 16)):
    return np.random.default_rng(seed).integers(0, 256, size + (3,), dtype=np.uint8)


def ask(text, answer):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": answer}]


def test_image_tokens_and_pixels_equal_keras_hubs_gemma4_preprocessor(lm):
    """The official Gemma 4 template (jinja) on TRL's placement, then KerasHub's
    ``Gemma4CausalLMPreprocessor`` rule (TensorFlow, which its call needs, is absent here: each
    ``<|image|>`` replaced by ``<|image>`` + ``<|image|>`` x n + ``<image|>``, BOS + prompt +
    response tokenized; its converter on the image) equal the data pipeline's example; a second
    image slot left empty is padding patches only."""
    jinja2 = pytest.importorskip("jinja2")
    image, pre, tok = picture(1, (20, 12)), lm.task.preprocessor, lm.task.preprocessor.tokenizer
    prepared = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "How many red shapes?"}]}]
    prompt = jinja2.Environment().from_string(chat.hf_template("gemma4")).render(
        messages=prepared, bos_token="", add_generation_prompt=True)
    block = "<|image>" + "<|image|>" * 4 + "<image|>"
    ids = [tok.start_token_id] + [int(i) for i in tok.tokenize(prompt.replace("<|image|>", block))]
    ids += [int(i) for i in tok.tokenize("3<turn|>")]
    record = {"images": [image], "prompt": [{"role": "user", "content": "How many red shapes?"}],
              "completion": [{"role": "assistant", "content": "3"}]}
    ex = data.Tokenize(lm.tokenizer, lm.chat_format, 64, images=lm.images)(record)
    n = int(ex["attention_mask"].sum())
    np.testing.assert_array_equal(ex["input_ids"][:len(ids)], ids)
    assert n == len(ids) + 1  # the template's newline after the turn
    placeholders = ex["input_ids"][:n] == tok.image_placeholder_id
    np.testing.assert_array_equal(ex["vision_mask"][:n], placeholders)
    assert ex["vision_mask"].sum() == 4
    theirs = pre.image_converter(image[None])
    patches, positions = ex["pixel_values"][..., :48], ex["pixel_values"][..., 48:]
    np.testing.assert_array_equal(patches[0], np.asarray(theirs["pixel_values"])[0])
    np.testing.assert_array_equal(positions[0], np.asarray(theirs["pixel_position_ids"])[0])
    assert (positions[0] == -1).all(-1).sum() == 8  # a 20 x 12 picture: 8 of 16 patches
    assert (patches[1] == 0).all() and (positions[1] == -1).all()  # the empty second slot


def batch(lm, records_):
    return tokenized_batch(lm, records_, LENGTH)


def keras_hub_inputs(b, tokens_per_image):
    """KerasHub's Gemma 4 inputs for a batch, by its preprocessor's rule: the patches and their
    positions, the placeholder tokens' positions padded with 0, sequential positions."""
    count = b["pixel_values"].shape[1] * tokens_per_image
    indices = np.zeros((len(b["input_ids"]), count), np.int32)
    for row, mask in enumerate(b["vision_mask"]):
        where = np.flatnonzero(mask)
        indices[row, :len(where)] = where
    rows, length = b["input_ids"].shape
    return {"token_ids": b["input_ids"], "padding_mask": b["attention_mask"],
            "position_ids": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
            "pixel_values": b["pixel_values"][..., :-2],
            "pixel_position_ids": b["pixel_values"][..., -2:].astype(np.int32),
            "vision_indices": indices, "vision_mask": b["vision_mask"]}


def test_logits_with_images_equal_keras_hubs_gemma4_causal_lm(lm):
    """The training forward (``model.full_logits`` under ``model.images``, eagerly) equals
    KerasHub's ``Gemma4CausalLM`` called on the inputs its preprocessor makes (per-layer inputs,
    KV-shared layers, image tokens attending to each other); the images are read (swapping two
    rows' pictures changes their logits); a text-only record equals KerasHub's call without."""
    b = batch(lm, [{"messages": ask("How many shapes?", "3"), "images": [picture(0)]},
                   {"messages": ask("What colour?", "red"), "images": [picture(1, (12, 20))]},
                   {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                 {"role": "assistant", "content": "5"}]}])
    assert list(b["image_count"]) == [1, 1, 0] and b["vision_mask"].sum(1).tolist() == [4, 4, 0]
    with model.images(b["pixel_values"]):
        ours = np.asarray(model.full_logits(lm.module, b["input_ids"], b["attention_mask"]))
    theirs = np.asarray(lm.task(keras_hub_inputs(b, 4)))
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    with model.images(b["pixel_values"][[1, 0, 2]]):
        other = np.asarray(model.full_logits(lm.module, b["input_ids"], b["attention_mask"]))
    assert np.abs(other[:2] - ours[:2]).max() > 1e-4
    text = {k: v[2:] for k, v in b.items()}
    alone = dict(keras_hub_inputs(text, 4), pixel_values=np.zeros((1, 0, 1, 48), np.float32),
                 pixel_position_ids=np.zeros((1, 0, 1, 2), np.int32),
                 vision_indices=np.zeros((1, 0), np.int32))
    np.testing.assert_allclose(ours[2:], np.asarray(lm.task(alone)), atol=1e-5, rtol=1e-5)
    no_scope = np.asarray(model.full_logits(lm.module, text["input_ids"], text["attention_mask"]))
    np.testing.assert_allclose(no_scope, ours[2:], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """PNG files (PIL) beside a ``messages`` + ``images`` JSONL and a ``prompt`` / ``chosen`` /
    ``rejected`` + ``images`` JSONL."""
    root = tmp_path_factory.mktemp("gemma4_vision_data")
    sft, pairs = [], []
    for i in range(4):
        Image.fromarray(picture(i, (16, 16) if i % 2 else (24, 16))).save(root / f"{i}.png")
        sft.append({"messages": ask("How many shapes?", str(i)), "images": [f"{i}.png"]})
        pairs.append({"prompt": [{"role": "user", "content": "How many shapes?"}],
                      "chosen": [{"role": "assistant", "content": str(i)}],
                      "rejected": [{"role": "assistant", "content": str(i + 1)}],
                      "images": [f"{i}.png"]})
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def run(algorithm, data_file, run_dir, *extra):
    return train_run(algorithm, "--model", NAME, "--data", data_file, "--batching.max-length",
                     LENGTH, *STEPS, "--run-dir", run_dir, *extra, echo=lambda _: None)


def test_sft_on_messages_and_images_runs_two_steps(files, tmp_path):
    """SFT with LoRA on a ``messages`` + ``images`` JSONL: two steps, finite losses."""
    run("sft", files / "sft.jsonl", tmp_path / "sft", "--lora.rank", "4")
    rows = records(tmp_path / "sft")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)


def test_dpo_on_images_starts_at_log_2(files, tmp_path):
    """DPO with LoRA (the reference: LoRA off, reading the same images): two steps, the first
    loss log 2 and zero margins."""
    run("dpo", files / "pairs.jsonl", tmp_path / "dpo", "--lora.rank", "4")
    rows = records(tmp_path / "dpo")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    assert all(np.isfinite(r["rewards/margins"]) for r in rows)


def test_the_vision_tower_is_frozen_by_default():
    """LoRA ``all-linear`` adapts the language model only; full fine-tuning trains every weight
    but the tower's (its encoder, pooling and projection) and the blocks' layer scalars (which
    KerasHub's Gemma 4 keeps fixed, as for its text models)."""
    from nnx_posttrain import config as config_lib
    from flax import nnx

    for lora in (config_lib.LoraConfig(rank=2, targets="all-linear"), config_lib.LoraConfig()):
        built, module = runs.build_model(runs.ModelSpec(NAME, "float32", 0, lora),
                                         echo=lambda _: None)
        tower = {v.path for v in module.vision_encoder.weights}
        every = [v.path for v in module.weights]
        trained = [v.path for _, v in nnx.to_flat_state(nnx.state(module, model.trainable_filter))]
        assert tower and trained and not tower & set(trained)
        assert not [p for p in tower if "lora" in p]
        scalars = {p for p in every if p.endswith("layer_scalar")}  # KerasHub's: not trainable
        assert all("lora" in p for p in trained) if lora.rank else \
            set(trained) == set(every) - tower - scalars
        assert (built.images.tokens_per_image, built.images.max_images) == (4, 2)


def test_sampling_with_images_is_refused_by_name(lm):
    """The sampler's image prompt pass does not handle Gemma 4 yet: prompts with images are
    refused naming why (the sample command before any forward); text prompts still sample."""
    from nnx_posttrain.cli.sample import image_prompts
    from nnx_posttrain.sampling import sampler

    with pytest.raises(errors.ConfigError, match="Gemma4Backbone with images.*per-layer inputs"):
        image_prompts(lm, ["How many shapes?"], [picture(0)])
    ex = data.TokenizePrompt(lm.tokenizer, lm.chat_format, 32, images=lm.images)(
        {"prompt": ask("How many?", "3")[:1], "images": [picture(0)]})
    shown = sampler.ImagePrompts([[int(t) for t, m in zip(ex["prompt_ids"], ex["prompt_mask"])
                                   if m]], ex["pixel_values"][None])
    with pytest.raises(errors.ConfigError, match="KV-shared layers"):
        sampler.sample_texts(lm, lm.module, shown, sampler.Sampling(2))
    texts = sampler.sample_texts(lm, lm.module, ["How many?"], sampler.Sampling(2))
    assert len(texts) == 1 and len(texts[0]) == 1


def test_an_online_run_with_image_prompts_is_refused_before_its_first_step(lm):
    """GRPO & co. sample their prompts: on Gemma 4 prompts with images are refused when the run
    builds its inputs (generation.check_image_sampling), not at the first rollout; text
    prompts pass."""
    from nnx_posttrain.algorithms.online import generation

    text = [{"prompt": "How many?"}] * 3
    generation.check_image_sampling(lm.module, text)
    with pytest.raises(errors.ConfigError, match="Gemma4Backbone with images"):
        generation.check_image_sampling(lm.module, text + [{"prompt": "How many?",
                                                            "images": [picture(0)]}])


def test_a_local_preset_directory_of_a_gemma4_vision_model_loads(lm, tmp_path):
    """``save_to_preset`` then ``--model DIR``: KerasHub's own ``from_preset`` (its Gemma 4
    preprocessor built without TensorFlow), the same tower weights and image handling; the
    built-in's chat format and tokenizer read without its weights are the loaded model's."""
    lm.task.save_to_preset(str(tmp_path / "preset"))
    built, _ = runs.build_model(runs.ModelSpec(str(tmp_path / "preset"), "float32"),
                                echo=lambda _: None)
    assert model.reads_images(built.module) and built.chat_format == "gemma4"
    assert (built.images.tokens_per_image, built.images.max_images, built.images.patches) == \
        (4, 2, True)
    assert model.chat_format_of(NAME) == "gemma4"  # read before loading, as the loaded model's
    alone = model.load_tokenizer(NAME)
    assert type(alone.keras_tokenizer).__name__ == "Gemma4Tokenizer"
    placeholder = lm.task.preprocessor.tokenizer.image_placeholder_id
    assert alone.keras_tokenizer.image_placeholder_id == placeholder
    np.testing.assert_array_equal(
        np.asarray(built.module.vision_encoder.weights[1].value),
        np.asarray(lm.module.vision_encoder.weights[1].value))


def test_rows_that_copy_the_examples_read_their_images_encoded_once(lm):
    """A preference pair's rows (the examples twice) read their example's patches, encoded once
    (Gemma 4's encoder takes a dict of patches and positions): the log-probs equal each copy's
    alone, and the encoder sees the two examples' images, not the four rows'."""
    b = batch(lm, [{"messages": ask("How many shapes?", str(i)), "images": [picture(i)]}
                   for i in range(2)])
    twice = {k: np.concatenate([b[k], b[k]]) for k in b}
    kind = type(lm.module.vision_encoder)
    original, seen = kind.call, []

    def counted(self, inputs, *args, **kwargs):
        seen.append(inputs["pixel_values"].shape[0])
        return original(self, inputs, *args, **kwargs)

    with model.images(b["pixel_values"]):
        try:
            kind.call = counted
            both = np.asarray(model.token_logprobs(lm.module, twice["input_ids"],
                                                   twice["attention_mask"]))
        finally:
            kind.call = original
        once = np.asarray(model.token_logprobs(lm.module, b["input_ids"], b["attention_mask"]))
    np.testing.assert_allclose(both, np.concatenate([once, once]), atol=1e-5)
    assert np.abs(once[0] - once[1]).max() > 1e-3 and seen == [2]
