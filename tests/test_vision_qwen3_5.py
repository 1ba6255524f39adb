"""Qwen 3.5 with images (the built-in micro ``qwen3_5_vision_micro``: KerasHub's
``Qwen3_5Backbone`` with a Gated DeltaNet block, a full-attention block with multimodal rotary
positions, and a ``Qwen3_5VisionEncoder``): the data pipeline's tokens are KerasHub's
preprocessor's, its patches KerasHub's converter's put in the merge-window order the encoder reads
(each patch where the encoder's positions place it), our forward with images equals KerasHub's
``Qwen3_5CausalLM`` (its cached forward, which reads the preprocessor's M-RoPE positions), SFT and
DPO train on TRL's vision JSONL with the tower frozen, the sampler with images decodes as the
training forward, so ``sample --image`` answers and GRPO trains on image prompts."""

import types
import zlib

import jax
import numpy as np
import pytest
from PIL import Image

from nnx_posttrain import chat, data, model, runs
from support import (ask, image_data_files, image_logits, image_prompt_file, jitted, picture, records,
                     tokenized_batch, train_run, vision_model)

NAME = "qwen3_5_vision_micro"
LENGTH = 64
STEPS = ["--steps", "2", "--log-every", "1", "--eval.every", "0", "--eval.exact-match", "0",
         "--batching.batch-size", "2", "--batching.grad-accum", "1", "--checkpoint.every", "0",
         "--optim.schedule", "constant", "--optim.warmup-steps", "0"]


@pytest.fixture(scope="module")
def lm():
    return vision_model(NAME)




@pytest.fixture
def keras_hub_rules(monkeypatch):
    """KerasHub's Qwen 3.5 preprocessor's own token and M-RoPE rules, run without TensorFlow
    (they build their results with ``tf.constant``: numpy's here)."""
    from keras_hub.src.models.qwen3_5 import qwen3_5_causal_lm_preprocessor as module

    monkeypatch.setattr(module, "tf", types.SimpleNamespace(
        constant=lambda x, dtype=None: np.asarray(x, dtype or None)))
    return module


@pytest.mark.slow
def test_tokens_and_patches_equal_keras_hubs_qwen3_5_preprocessor(lm, keras_hub_rules):
    """The official Qwen 3.5 template (jinja) on TRL's placement, then KerasHub's
    ``Qwen3_5CausalLMPreprocessor`` rule (its ``_tokenize_with_special_tokens``: each
    ``<|image_pad|>`` expanded to the image's tokens) equal the data pipeline's example; the
    patches are KerasHub's ``Qwen3_5ImageConverter``'s (a square picture of another size resized
    by it) listed by merge window, a second image slot left empty is zeros; the M-RoPE
    positions of the example equal the preprocessor's ``_compute_position_ids``."""
    jinja2 = pytest.importorskip("jinja2")
    from nnx_posttrain.model import vision_qwen3_5

    image, pre = picture(1, (24, 24)), lm.task.preprocessor
    prepared = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "How many red shapes?"}]}]
    prompt = jinja2.Environment().from_string(chat.hf_template(lm.chat_format)).render(
        messages=prepared, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>How many" in prompt
    ids = pre._tokenize_with_special_tokens(prompt + "3<|im_end|>", [4], [])
    record = {"images": [image], "prompt": [{"role": "user", "content": "How many red shapes?"}],
              "completion": [{"role": "assistant", "content": "3"}]}
    ex = data.Tokenize(lm.tokenizer, lm.chat_format, LENGTH, images=lm.images)(record)
    n = int(ex["attention_mask"].sum())
    np.testing.assert_array_equal(ex["input_ids"][:len(ids)], ids)
    assert n == len(ids) + 1  # the template's newline after the turn
    np.testing.assert_array_equal(ex["vision_mask"][:n],
                                  ex["input_ids"][:n] == pre.image_token_id)
    assert ex["vision_mask"].sum() == 4
    theirs = pre.image_converter(image)
    np.testing.assert_array_equal(np.asarray(theirs["grid_thw"]), [1, 4, 4])
    np.testing.assert_array_equal(ex["pixel_values"][0], data.images.qwen_window_order(
        np.asarray(theirs["patches"]), 4, 4, 2))
    assert ex["pixel_values"].shape == (2, 16, 2, 4, 4, 3) and (ex["pixel_values"][1] == 0).all()
    # two images and text around them: the positions of KerasHub's rule
    two = data.Tokenize(lm.tokenizer, lm.chat_format, LENGTH, images=lm.images)(
        {"images": [image, picture(2)], "messages": ask("Which has more?", "the first", 2)})
    ours = vision_qwen3_5.mrope_positions(two["vision_mask"][None] > 0, 2)
    grid = np.asarray([[1, 4, 4], [1, 4, 4]])
    want = pre._compute_position_ids(two["input_ids"][None], grid, None)
    np.testing.assert_array_equal(np.asarray(ours), want)
    assert int(np.asarray(ours)[0, 0].max()) < int(two["attention_mask"].sum()) - 1


def encoder_grid_positions(encoder, side):
    """(row, column) of each patch slot of a ``side x side`` grid as KerasHub's
    ``Qwen3_5VisionEncoder`` places it: its rotary angles at the first frequency (1) of the row
    half and of the column half."""
    cos, sin = (np.asarray(a) for a in encoder._rot_pos_emb(np.asarray([[1, side, side]])))
    quarter = cos.shape[-1] // 4
    angle = np.arctan2(sin[:, [0, quarter]], cos[:, [0, quarter]])
    return np.rint(angle).astype(int)


def test_each_patch_sits_where_the_encoder_places_it(lm):
    """KerasHub 0.32's converter lists a picture's patches row by row, its encoder reads them by
    2 x 2 merge window (rotary positions and position embeddings laid out by window, the merger
    joining each 4 consecutive patches): the pipeline's patch at each slot is the picture's patch
    at the (row, column) the encoder's positions give that slot, every 4 consecutive slots one
    2 x 2 window; the converter's own list is not (fails if the pipeline's reorder is removed)."""
    image = picture(5)
    ours = lm.images.pixels([image])[0]
    rows = np.asarray(lm.images.converter(image)["patches"], np.float32)  # row by row
    where = encoder_grid_positions(lm.module.vision_encoder, 4)
    assert sorted(map(tuple, where)) == [(r, c) for r in range(4) for c in range(4)]
    assert (np.ptp(where.reshape(4, 4, 2), axis=1) == 1).all()  # each merged 4: one 2 x 2 window
    np.testing.assert_array_equal(ours, rows[where[:, 0] * 4 + where[:, 1]])
    assert np.abs(ours - rows).max() > 0.1


def batch(lm, records_):
    return tokenized_batch(lm, records_, LENGTH)


def keras_hub_logits(lm, b, pre, mrope=True):
    """KerasHub's ``Qwen3_5CausalLM`` on a batch, as its ``generate`` runs it: the encoder on
    every image of the batch (its grid), the image tokens scattered at the preprocessor's flat
    ``vision_indices``, its cached forward with the preprocessor's M-RoPE ``position_ids`` (or,
    not ``mrope``, none: sequential positions, as its plain call rotates). The encoder runs
    eagerly (its call reads the grid's values), the cached forward and the logits as one jitted
    program (``jitted``: KerasHub's own layers, traced once instead of dispatched an operation
    at a time)."""
    rows = [(i, int(c)) for i, c in enumerate(b["image_count"])]
    patches = np.concatenate([b["pixel_values"][i, :c] for i, c in rows if c])
    grid = np.asarray([[1, 4, 4]] * len(patches))
    embeddings = lm.module.vision_encoder(patches.reshape(-1, 2, 4, 4, 3), grid)
    indices = pre._compute_vision_indices(b["input_ids"])
    positions = pre._compute_position_ids(b["input_ids"], grid, None)

    def forward(task, ids, mask, embeddings, indices, *positions):
        h, _ = task._build_cache(ids, mask, embeddings, indices, *positions or [None])
        return task.backbone.token_embedding(h, reverse=True)

    logits = jitted(forward, lm.task)(b["input_ids"], b["attention_mask"], embeddings,
                                      np.asarray(indices), *[positions] if mrope else [])
    return np.asarray(logits), positions


@pytest.mark.slow
def test_logits_with_images_equal_keras_hubs_qwen3_5_causal_lm(lm, keras_hub_rules):
    """The training forward (``model.full_logits`` under ``model.images``, jitted) with one
    image, two images and a text-only row equals KerasHub's ``Qwen3_5CausalLM`` cached forward
    on the preprocessor's inputs (image embeddings, flat indices, M-RoPE positions) at every real
    position; the images are read (swapping two rows' pictures changes their logits), and the
    positions matter (KerasHub's cached forward at sequential positions, as its plain call
    rotates image tokens, differs after the images); the text-only row equals KerasHub's plain
    call."""
    b = batch(lm, [{"messages": ask("How many shapes?", "3"), "images": [picture(0)]},
                   {"messages": ask("Which has more?", "the first", 2),
                    "images": [picture(1), picture(2, (32, 32))]},
                   {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                 {"role": "assistant", "content": "5"}]}])
    assert list(b["image_count"]) == [1, 2, 0] and b["vision_mask"].sum(1).tolist() == [4, 8, 0]
    forward = jitted(image_logits, lm.module)  # one program for both pictures' orders
    ours = np.asarray(forward(b["input_ids"], b["attention_mask"], b["pixel_values"]))
    theirs, positions = keras_hub_logits(lm, b, lm.task.preprocessor)
    real = b["attention_mask"] > 0
    print("max |ours - KerasHub's|:", np.abs(ours[real] - theirs[real]).max())
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-5, rtol=1e-5)
    assert (positions[:2, 2] != positions[:2, 0]).any()  # M-RoPE: the grid's own positions
    other = np.asarray(forward(b["input_ids"], b["attention_mask"], b["pixel_values"][[1, 0, 2]]))
    assert np.abs(other[:2] - ours[:2]).max() > 1e-4
    sequential = keras_hub_logits(lm, b, lm.task.preprocessor, mrope=False)[0]
    after = real & (np.cumsum(b["vision_mask"], 1) == b["vision_mask"].sum(1, keepdims=True))
    after[2] = False
    assert np.abs(sequential[after] - ours[after]).max() > 1e-4
    rows = len(b["input_ids"])
    plain = np.asarray(jitted(lambda task, inputs: task(inputs), lm.task)({
        "token_ids": b["input_ids"], "padding_mask": b["attention_mask"],
        "pixel_values": np.zeros((rows, 0, 2, 4, 4, 3), np.float32),
        "image_grid_thw": np.zeros((rows, 0, 3), np.int32),
        "vision_indices": np.zeros((rows, 0), np.int32)}))
    np.testing.assert_allclose(ours[2][real[2]], plain[2][real[2]], atol=1e-5, rtol=1e-5)
    text = {k: v[2:] for k, v in b.items()}
    no_scope = np.asarray(jitted(model.full_logits, lm.module)(text["input_ids"],
                                                               text["attention_mask"]))
    np.testing.assert_allclose(no_scope[0][real[2]], ours[2][real[2]], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """PNG files (PIL) beside a ``messages`` + ``images`` JSONL and a ``prompt`` / ``chosen`` /
    ``rejected`` + ``images`` JSONL."""
    return image_data_files(tmp_path_factory.mktemp("qwen3_5_vision_data"), [(32, 32), (16, 16)])


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
    out = capsys.readouterr().out.split("> How many shapes?\n", 1)[1]  # after loading's lines
    loaded = runs.load(tmp_path / "sft", echo=lambda _: None)
    shown = sample_command.image_prompts(loaded.lm, ["How many shapes?"],
                                         [np.asarray(Image.open(files / "1.png").convert("RGB"))])
    answer = sampler.sample_texts(loaded.lm, loaded.policy(), shown, sampler.Sampling(3))[0][0]
    assert out == answer + "\n\n"  # the answer (the micro's: whitespace), then an empty line


@pytest.mark.slow
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
    but the tower's (its patch embedding, blocks and merger into the language model)."""
    from flax import nnx
    from nnx_posttrain import config as config_lib

    for lora in (config_lib.LoraConfig(rank=2, targets="all-linear"), config_lib.LoraConfig()):
        built, module = runs.build_model(runs.ModelSpec(NAME, "float32", 0, lora),
                                         echo=lambda _: None)
        tower = {v.path for v in module.vision_encoder.weights}
        every = [v.path for v in module.weights if v.trainable or "lora" in v.path or
                 v.path in tower]
        trained = [v.path for _, v in nnx.to_flat_state(nnx.state(module, model.trainable_filter))]
        assert tower and trained and not tower & set(trained)
        assert not [p for p in tower if "lora" in p]
        assert all("lora" in p for p in trained) if lora.rank else \
            set(trained) == set(every) - tower
        assert (built.images.tokens_per_image, built.images.max_images, built.images.side) == \
            (4, 2, 16)


def test_lora_on_the_tower_is_refused_naming_the_family(lm):
    """``--lora.targets projector`` / ``vision-attention`` name Gemma's tower layers: on Qwen
    3.5's tower a ``ConfigError`` naming the option and the backbone, before any layer is
    adapted (``--train-vision`` trains its tower: ``test_vision_methods``)."""
    from nnx_posttrain import errors

    for group in ("projector", "vision-attention"):
        with pytest.raises(errors.ConfigError, match=rf"^--lora.targets {group}: no such layer "
                           r"in the vision encoder of Qwen3_5Backbone \(LoRA on the tower is "
                           r"wired for Gemma 3's and Gemma 4's\); --train-vision"):
            model.enable_lora(lm.module, 2, targets=f"attention,{group}")
    assert not model.has_lora(lm.module)


QUESTION = "How many shapes?"


def image_prompts(lm, pictures, texts, width=48):
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
    tower's, the full-attention layer at the M-RoPE positions, the Gated DeltaNet from its
    state; then the cache, each new token at its position plus the prompt's M-RoPE offset) gives,
    token by token, the argmax of the training forward (``model.full_logits`` with the same
    pixel values, no cache) and its log-probs; sampled tokens' log-probs (temperature 1) equal
    ``model.token_logprobs`` of prompt + completion with the images; another picture gives other
    logits, and so does the same prompt without its image."""
    from flax import nnx
    from nnx_posttrain.sampling import sampler

    ids, mask, pixels = image_prompts(lm, [picture(i) for i in range(3)],
                                      [QUESTION, QUESTION, "Look closely. " + QUESTION])
    assert (ids == lm.task.preprocessor.image_token_id).sum(1).tolist() == [4, 4, 4]
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


def varied_reward(prompts, completions, **_):
    """Test reward: a hash of the completion's text (completions differ, so do their rewards)."""
    return [float(zlib.crc32(c[0]["content"].encode()) % 7) for c in completions]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """TRL's prompt-only vision format (``prompt`` + ``images`` + ``answer``) of the built-in
    image task, its pictures as PNG files beside it."""
    return image_prompt_file(tmp_path_factory.mktemp("qwen3_5_vision_prompts"))


@pytest.mark.slow
def test_grpo_samples_and_trains_on_image_prompts(prompt_file, tmp_path):
    """GRPO on prompt-only records with images, two iterations per rollout and a clip range of
    1e-3: the rollouts are sampled with each prompt's image, and at the first step the ratio is
    1 at every token (nothing clipped: the sampler's log-probs, M-RoPE positions included, are
    the training forward's), at the second it is not. (Held-out prompts answered with their
    images: the sampler test above and tests/test_vision_rl.py's exact-match test.)"""
    run_dir = tmp_path / "grpo"
    train_run("grpo", "--model", NAME, "--data", prompt_file, "--batching.max-length", 128,
              *STEPS, "--run-dir", run_dir, "--algo.num-generations", "2",
              "--algo.max-completion-length", "4", "--algo.temperature", "1.0",
              "--algo.rewards", "test_vision_qwen3_5:varied_reward", "--lora.rank", "4",
              "--optim.learning-rate", "3e-2", "--algo.num-iterations", "2",
              "--algo.epsilon", "1e-3", echo=lambda _: None)
    rows = records(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["clip_ratio/region_mean"] == 0.0
    assert rows[1]["clip_ratio/region_mean"] > 0.0


def test_a_local_preset_directory_of_a_qwen3_5_vision_model_loads(lm, tmp_path):
    """``save_to_preset`` then ``--model DIR``: KerasHub's own ``from_preset``, the same tower
    weights and image handling (one grid, 4 tokens an image; 2 images a sequence, the default
    where the preprocessor says none), its vision tokens kept whole; the built-in's chat format
    and tokenizer read without its weights are the loaded model's."""
    lm.task.save_to_preset(str(tmp_path / "preset"))
    built, _ = runs.build_model(runs.ModelSpec(str(tmp_path / "preset"), "float32"),
                                echo=lambda _: None)
    assert model.reads_images(built.module) and built.chat_format == lm.chat_format
    assert (built.images.tokens_per_image, built.images.max_images, built.images.side) == \
        (4, 2, 16)
    pad = lm.task.preprocessor.tokenizer.image_token_id
    assert built.tokenizer.encode("<|image_pad|><|image_pad|>") == [pad, pad]
    assert model.chat_format_of(NAME) == lm.chat_format  # read before loading
    assert model.load_tokenizer(NAME).encode("<|image_pad|>") == [pad]
    np.testing.assert_array_equal(
        np.asarray(built.module.vision_encoder.weights[0].value),
        np.asarray(lm.module.vision_encoder.weights[0].value))
