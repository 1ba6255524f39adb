"""Gemma 4 with images (the built-in micro ``gemma4_vision_micro``: KerasHub's
``Gemma4Backbone`` with per-layer inputs, KV-shared layers and a ``Gemma4VisionEncoder``): the
data pipeline's image tokens and pixel values are KerasHub's preprocessor's, our forward with
images equals KerasHub's own ``Gemma4CausalLM`` call, SFT and DPO train on TRL's ``messages`` /
``prompt`` + ``images`` JSONL with the tower frozen, the KV-cache sampler with images decodes as
the training forward (greedy tokens, log-probs), so ``sample --image`` answers and GRPO trains on
image prompts; a sampling batch mixing image widths (KerasHub's batch-wide pooling grid) is
refused."""

import zlib

import jax
import numpy as np
import pytest
from PIL import Image

from nnx_posttrain import chat, data, errors, model, runs
from support import (ask, image_data_files, image_logits, image_prompt_file, jitted, picture, records,
                     tokenized_batch, train_run, vision_model)

NAME = "gemma4_vision_micro"
LENGTH = 40
STEPS = ["--steps", "2", "--log-every", "1", "--eval.every", "0", "--eval.exact-match", "0",
         "--batching.batch-size", "2", "--batching.grad-accum", "1", "--checkpoint.every", "0",
         "--optim.schedule", "constant", "--optim.warmup-steps", "0"]


@pytest.fixture(scope="module")
def lm():
    return vision_model(NAME)




@pytest.mark.slow
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


@pytest.mark.slow
def test_logits_with_images_equal_keras_hubs_gemma4_causal_lm(lm):
    """The training forward (``model.full_logits`` under ``model.images``, jitted) equals
    KerasHub's ``Gemma4CausalLM`` called (jitted) on the inputs its preprocessor makes (per-layer inputs,
    KV-shared layers, image tokens attending to each other); the images are read (swapping two
    rows' pictures changes their logits); a text-only record equals KerasHub's call without."""
    b = batch(lm, [{"messages": ask("How many shapes?", "3"), "images": [picture(0)]},
                   {"messages": ask("What colour?", "red"), "images": [picture(1, (12, 20))]},
                   {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                 {"role": "assistant", "content": "5"}]}])
    assert list(b["image_count"]) == [1, 1, 0] and b["vision_mask"].sum(1).tolist() == [4, 4, 0]
    forward = jitted(image_logits, lm.module)  # one program for both pictures' orders
    keras_hub = jitted(lambda task, inputs: task(inputs), lm.task)
    ours = np.asarray(forward(b["input_ids"], b["attention_mask"], b["pixel_values"]))
    theirs = np.asarray(keras_hub(keras_hub_inputs(b, 4)))
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    other = np.asarray(forward(b["input_ids"], b["attention_mask"], b["pixel_values"][[1, 0, 2]]))
    assert np.abs(other[:2] - ours[:2]).max() > 1e-4
    text = {k: v[2:] for k, v in b.items()}
    alone = dict(keras_hub_inputs(text, 4), pixel_values=np.zeros((1, 0, 1, 48), np.float32),
                 pixel_position_ids=np.zeros((1, 0, 1, 2), np.int32),
                 vision_indices=np.zeros((1, 0), np.int32))
    np.testing.assert_allclose(ours[2:], np.asarray(keras_hub(alone)), atol=1e-5, rtol=1e-5)
    no_scope = np.asarray(jitted(model.full_logits, lm.module)(text["input_ids"],
                                                               text["attention_mask"]))
    np.testing.assert_allclose(no_scope, ours[2:], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """PNG files (PIL) beside a ``messages`` + ``images`` JSONL and a ``prompt`` / ``chosen`` /
    ``rejected`` + ``images`` JSONL."""
    return image_data_files(tmp_path_factory.mktemp("gemma4_vision_data"), [(24, 16), (16, 16)])


def run(algorithm, data_file, run_dir, *extra):
    return train_run(algorithm, "--model", NAME, "--data", data_file, "--batching.max-length",
                     LENGTH, *STEPS, "--run-dir", run_dir, *extra, echo=lambda _: None)


@pytest.mark.slow
def test_sft_on_messages_and_images_runs_two_steps(files, tmp_path, capsys):
    """SFT with LoRA on a ``messages`` + ``images`` JSONL: two steps, finite losses; then
    ``nnx-posttrain sample RUN --image FILE`` answers with the sampler's answer to that image
    (``sample_texts`` of ``image_prompts``)."""
    from nnx_posttrain import cli
    from nnx_posttrain.cli import sample as sample_command
    from nnx_posttrain.sampling import sampler

    run("sft", files / "sft.jsonl", tmp_path / "sft", "--lora.rank", "4")
    rows = records(tmp_path / "sft")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    command = ["sample", str(tmp_path / "sft"), "--prompt", "How many shapes?",
               "--max-new-tokens", "3", "--image", str(files / "1.png")]
    capsys.readouterr()
    assert cli.main(command) == 0
    out = capsys.readouterr().out.splitlines()
    out = out[out.index("> How many shapes?"):]  # after what loading prints
    loaded = runs.load(tmp_path / "sft", echo=lambda _: None)
    shown = sample_command.image_prompts(loaded.lm, ["How many shapes?"],
                                         [np.asarray(Image.open(files / "1.png").convert("RGB"))])
    assert out[1] == sampler.sample_texts(loaded.lm, loaded.policy(), shown,
                                          sampler.Sampling(3))[0][0]


@pytest.mark.slow
def test_dpo_on_images_starts_at_log_2(files, tmp_path):
    """DPO with LoRA (the reference: LoRA off, reading the same images): two steps, the first
    loss log 2 and zero margins."""
    run("dpo", files / "pairs.jsonl", tmp_path / "dpo", "--lora.rank", "4")
    rows = records(tmp_path / "dpo")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    assert all(np.isfinite(r["rewards/margins"]) for r in rows)


@pytest.mark.slow
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


QUESTION = "How many shapes?"


def image_prompts(lm, pictures, texts, width=32):
    """Left-padded prompts (``width``) and their pixel values, one picture each, as the sample
    command tokenizes them (``cli.sample.image_prompts``: the data pipeline's
    ``TokenizePrompt``)."""
    from nnx_posttrain.cli.sample import image_prompts as tokenized
    from nnx_posttrain.sampling import sampler

    shown = [tokenized(lm, [text], [picture]) for text, picture in zip(texts, pictures)]
    ids, mask = sampler.pad_prompts([s.ids[0] for s in shown], lm.tokenizer.pad_id, bucket=width)
    return ids, mask, np.concatenate([s.pixel_values for s in shown])


@pytest.mark.slow
def test_the_sampler_reads_a_prompts_images_as_the_training_forward(lm):
    """Greedy decoding with images (the prompt pass: the image tokens' embeddings the vision
    tower's, per-layer inputs with image tokens reading padding's, KV-shared blocks reading their
    source's keys, image tokens attending to each other on the local layers; then the KV cache,
    past the sliding window of 8) gives, token by token, the argmax of the training forward
    (``model.full_logits`` with the same pixel values, no cache) over the prompt, its image and
    the tokens so far, and its log-probs; sampled tokens' log-probs (temperature 1) equal
    ``model.token_logprobs`` of prompt + completion with the images; another picture gives other
    logits, and so does the same prompt without its image."""
    from flax import nnx
    from nnx_posttrain.sampling import sampler

    ids, mask, pixels = image_prompts(lm, [picture(i) for i in range(3)],
                                      [QUESTION, QUESTION, "Look closely. " + QUESTION])
    placeholder = lm.task.preprocessor.tokenizer.image_placeholder_id
    assert (ids == placeholder).sum(1).tolist() == [4, 4, 4]
    graphdef, *states = nnx.split(lm.module)
    sample, width = sampler.make_sampler(graphdef, 6), ids.shape[1]

    def run(temperature, images=True):
        out = sample(states, ids, mask, jax.random.key(1), sampler.Draw(temperature, 1.0, [-1]),
                     pixels if images else None)
        got = np.asarray(out["completion_ids"])
        seq = np.concatenate([ids, got], 1)
        seq_mask = np.concatenate([mask, np.asarray(out["completion_mask"])], 1)
        return got, np.asarray(out["logprobs"]), seq, seq_mask

    got, logps, seq, seq_mask = run(0.0)
    with model.images(pixels):
        full = np.asarray(model.full_logits(lm.module, seq, seq_mask))[:, width - 1:-1]
    np.testing.assert_array_equal(got, full.argmax(-1))
    logp = np.asarray(jax.nn.log_softmax(full, -1))
    np.testing.assert_allclose(logps, np.take_along_axis(logp, got[..., None], -1)[..., 0],
                               atol=2e-5)
    assert np.abs(full[0, 0] - full[1, 0]).max() > 1e-3  # the same question, another picture
    assert np.abs(run(0.0, images=False)[1][:, 0] - logps[:, 0]).max() > 1e-5

    _, logps, seq, seq_mask = run(1.0)
    with model.images(pixels):
        want = np.asarray(model.token_logprobs(lm.module, seq, seq_mask))[:, width:]
    np.testing.assert_allclose(logps, want, atol=2e-5)


@pytest.mark.slow
def test_a_sampling_batch_mixing_image_widths_is_refused(lm):
    """KerasHub's Gemma 4 pools every image of a call on the widest image's grid: a sampling
    batch of pictures of two patch-grid widths is refused naming them (not sampled with a
    narrower picture's embeddings pooled wrong); ``sample_texts`` of one such prompt too, a
    prompt with one picture answers."""
    from flax import nnx
    from nnx_posttrain.cli.sample import image_prompts as tokenized
    from nnx_posttrain.sampling import sampler

    ids, mask, pixels = image_prompts(lm, [picture(0), picture(1, (16, 8))], [QUESTION] * 2)
    graphdef, *states = nnx.split(lm.module)
    sample = sampler.make_sampler(graphdef, 2)
    with pytest.raises(errors.DataError, match=r"2 patch-grid widths \(2, 4 patches\)"):
        sample(states, ids, mask, jax.random.key(0), sampler.Draw(0.0, 1.0, [-1]), pixels)
    both = tokenized(lm, [QUESTION], [picture(0), picture(1, (16, 8))])
    with pytest.raises(errors.DataError, match="patch-grid widths"):
        sampler.sample_texts(lm, lm.module, both, sampler.Sampling(2))
    one = sampler.sample_texts(lm, lm.module, tokenized(lm, [QUESTION], [picture(1, (16, 8))]),
                               sampler.Sampling(2))
    assert len(one) == 1 and len(one[0]) == 1


def varied_reward(prompts, completions, **_):
    """Test reward: a hash of the completion's text (completions differ, so do their rewards)."""
    return [float(zlib.crc32(c[0]["content"].encode()) % 7) for c in completions]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """TRL's prompt-only vision format (``prompt`` + ``images`` + ``answer``) of the built-in
    image task, its pictures (one size) as PNG files beside it."""
    return image_prompt_file(tmp_path_factory.mktemp("gemma4_vision_prompts"))


@pytest.mark.slow
def test_grpo_samples_and_trains_on_image_prompts(prompt_file, tmp_path):
    """GRPO on prompt-only records with images, two iterations per rollout and a clip range of
    1e-3: the rollouts are sampled with each prompt's image, and at the first step the
    ratio is 1 at every token (nothing clipped: the sampler's log-probs are the training
    forward's, per-layer inputs and KV-shared layers included), at the second it is not; the
    loss is finite. (Held-out prompts answered with their images: the sampler test above and
    tests/test_vision_rl.py's exact-match test.)"""
    run_dir = tmp_path / "grpo"
    train_run("grpo", "--model", NAME, "--data", prompt_file, "--batching.max-length", LENGTH,
              *STEPS, "--run-dir", run_dir, "--algo.num-generations", "2",
              "--algo.max-completion-length", "4", "--algo.temperature", "1.0",
              "--algo.rewards", "test_vision_gemma4:varied_reward", "--lora.rank", "4",
              "--optim.learning-rate", "3e-2", "--algo.num-iterations", "2",
              "--algo.epsilon", "1e-3", echo=lambda _: None)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["clip_ratio/region_mean"] == 0.0
    assert rows[1]["clip_ratio/region_mean"] > 0.0


@pytest.mark.slow
def test_a_local_preset_directory_of_a_gemma4_vision_model_loads(lm, tmp_path):
    """``save_to_preset`` then ``--model DIR``: KerasHub's own ``from_preset`` (its Gemma 4
    preprocessor built without TensorFlow), the same tower weights and image handling (the
    converter's soft tokens and pooling, which KerasHub's config leaves out, the preprocessor's
    and the encoder's: not its defaults' 2520 patches a picture); the built-in's chat format
    and tokenizer read without its weights are the loaded model's. The export's preset holds
    them (``converters.complete_preset``): KerasHub's ``from_preset`` reads them."""
    import keras_hub

    lm.task.save_to_preset(str(tmp_path / "preset"))
    built, _ = runs.build_model(runs.ModelSpec(str(tmp_path / "preset"), "float32"),
                                echo=lambda _: None)
    assert model.reads_images(built.module) and built.chat_format == "gemma4"
    assert (built.images.tokens_per_image, built.images.max_images, built.images.patches) == \
        (4, 2, True)
    image = picture(0, (32, 24))
    assert built.images.pixels([image]).shape == (2, 16, 50)
    np.testing.assert_array_equal(built.images.pixels([image]), lm.images.pixels([image]))
    model.converters.complete_preset(lm.task, tmp_path / "preset")
    theirs = keras_hub.layers.ImageConverter.from_preset(str(tmp_path / "preset"))
    assert (theirs.max_soft_tokens, theirs.pooling_kernel_size) == (4, 2)
    assert model.chat_format_of(NAME) == "gemma4"  # read before loading, as the loaded model's
    alone = model.load_tokenizer(NAME)
    assert type(alone.keras_tokenizer).__name__ == "Gemma4Tokenizer"
    placeholder = lm.task.preprocessor.tokenizer.image_placeholder_id
    assert alone.keras_tokenizer.image_placeholder_id == placeholder
    np.testing.assert_array_equal(
        np.asarray(built.module.vision_encoder.weights[1].value),
        np.asarray(lm.module.vision_encoder.weights[1].value))


@pytest.mark.slow
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

    def logprobs(module, ids, mask, pixels):
        with model.images(pixels):
            return model.token_logprobs(module, ids, mask)

    forward = jitted(logprobs, lm.module)  # the encoder's call counted as the trace runs it
    try:
        kind.call = counted
        both = np.asarray(forward(twice["input_ids"], twice["attention_mask"], b["pixel_values"]))
    finally:
        kind.call = original
    once = np.asarray(forward(b["input_ids"], b["attention_mask"], b["pixel_values"]))
    np.testing.assert_allclose(both, np.concatenate([once, once]), atol=1e-5)
    assert np.abs(once[0] - once[1]).max() > 1e-3 and seen == [2]
