"""Training a vision-language model (Gemma 3 with its vision encoder, the built-in micro
``gemma3_vision_micro``): our forward with images equals KerasHub's own ``Gemma3CausalLM`` call,
a text-only record works on it, SFT and DPO train on TRL's ``messages`` / ``prompt`` + ``images``
JSONL (the vision tower frozen, LoRA on the language model), a resume equals the uninterrupted
run, and a local preset directory of it loads with its image handling."""

import json
import shutil

import jax
import numpy as np
import pytest
from PIL import Image

from nnx_posttrain import errors, model, runs
from nnx_posttrain.tasks import shapes
from support import MICRO, cli_error, losses, records, tokenized_batch, train_run, vision_model

NAME = "gemma3_vision_micro"
LENGTH = 40
STEPS = ["--steps", "6", "--log-every", "1", "--eval.every", "0", "--eval.exact-match", "0",
         "--batching.batch-size", "4", "--batching.grad-accum", "1", "--checkpoint.every", "3",
         "--optim.schedule", "constant", "--optim.warmup-steps", "0"]


@pytest.fixture(scope="module")
def lm():
    return vision_model(NAME)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """TRL's vision formats as a user writes them: PNG files beside a ``messages`` + ``images``
    JSONL (SFT) and a ``prompt`` / ``chosen`` / ``rejected`` + ``images`` JSONL (DPO)."""
    root = tmp_path_factory.mktemp("vision_data")
    sft, pairs = [], []
    for i in range(16):
        record, pair = shapes.sft_record(i), shapes.preference_record(i)
        Image.fromarray(record["images"][0]).save(root / f"{i}.png")
        sft.append(dict(record, images=[f"{i}.png"]))
        if i < 4:  # every DPO step reads the same four pairs: its loss must fall
            pairs.append(dict(pair, images=[f"{i}.png"]))
    unpaired = [dict(shapes.unpaired_record(i), images=[f"{i}.png"]) for i in range(8)]
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs), ("unpaired.jsonl", unpaired)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def batch(lm, records_):
    return tokenized_batch(lm, records_, LENGTH)


def keras_hub_inputs(b, tokens_per_image):
    """KerasHub's Gemma 3 inputs for a batch, by its preprocessor's rule (numpy): the images, the
    placeholder tokens' positions ascending, padded with 0 to max images x tokens per image."""
    count = b["pixel_values"].shape[1] * tokens_per_image
    indices = np.zeros((len(b["input_ids"]), count), np.int32)
    for row, mask in enumerate(b["vision_mask"]):
        where = np.flatnonzero(mask)
        indices[row, :len(where)] = where
    return {"token_ids": b["input_ids"], "padding_mask": b["attention_mask"],
            "images": b["pixel_values"], "vision_indices": indices,
            "vision_mask": b["vision_mask"]}


@jax.jit
def _logits(state, ids, mask, pixels):
    module = nnx_merge(state)
    with model.images(pixels):
        return model.full_logits(module, ids, mask)


def nnx_merge(state):
    from flax import nnx

    return nnx.merge(*state)


def keras_hub_call(lm, inputs):
    """``Gemma3CausalLM(inputs)``: KerasHub's own task call (jitted over its NNX state)."""
    from flax import nnx

    return np.asarray(jax.jit(lambda state, x: nnx_merge(state)(x))(nnx.split(lm.task), inputs))


@pytest.mark.slow
def test_logits_with_images_equal_keras_hubs_gemma3_causal_lm(lm):
    """The training forward (``model.full_logits`` under ``model.images``: the path of every
    log-prob) equals KerasHub's ``Gemma3CausalLM`` called on the inputs its preprocessor makes;
    the images change the logits (they are read), and a text-only record on the vision model
    equals KerasHub's call without images."""
    from flax import nnx

    b = batch(lm, [shapes.sft_record(i) for i in range(2)] + [
        {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                      {"role": "assistant", "content": "5"}]}])
    assert list(b["image_count"]) == [1, 1, 0] and b["vision_mask"][2].sum() == 0
    state = nnx.split(lm.module)
    ours = np.asarray(_logits(state, b["input_ids"], b["attention_mask"], b["pixel_values"]))
    theirs = keras_hub_call(lm, keras_hub_inputs(b, lm.images.tokens_per_image))
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    other = np.asarray(_logits(state, b["input_ids"], b["attention_mask"], b["pixel_values"][::-1]))
    assert np.abs(other[:2] - ours[:2]).max() > 1e-4  # the first two rows swapped their pictures
    text = {k: v[2:] for k, v in b.items()}
    alone = dict(keras_hub_inputs(text, lm.images.tokens_per_image),
                 images=np.zeros((1, 0, 16, 16, 3), np.float32),
                 vision_indices=np.zeros((1, 0), np.int32))
    np.testing.assert_allclose(ours[2:], keras_hub_call(lm, alone), atol=1e-5, rtol=1e-5)
    no_scope = np.asarray(jax.jit(lambda s, i, m: model.full_logits(nnx_merge(s), i, m))(
        state, text["input_ids"], text["attention_mask"]))
    np.testing.assert_allclose(no_scope, ours[2:], atol=1e-5, rtol=1e-5)


def run(algorithm, data_file, run_dir, *extra):
    return train_run(algorithm, "--model", NAME, "--data", data_file, "--batching.max-length",
                     LENGTH, *STEPS, "--run-dir", run_dir, *extra, echo=lambda _: None)


@pytest.mark.slow
def test_sft_on_messages_and_images_trains_and_resumes_exactly(files, tmp_path):
    """SFT on a ``messages`` + ``images`` JSONL: the loss falls, the vision tower does not
    train; stopped at step 3 and resumed, the run's losses equal the uninterrupted run's."""
    settings = ("--optim.learning-rate", "1e-2")
    run("sft", files / "sft.jsonl", tmp_path / "whole", *settings)
    whole = losses(tmp_path / "whole")
    assert sorted(whole) == list(range(1, 7)) and whole[6] < whole[1] - 0.5
    run("sft", files / "sft.jsonl", tmp_path / "cut", *settings, "--steps", "3")
    run("sft", files / "sft.jsonl", tmp_path / "cut", *settings, "--resume")
    assert losses(tmp_path / "cut") == whole  # every step once, bitwise-equal losses


@pytest.mark.slow
def test_dpo_on_images_with_lora_trains_the_language_model_only(files, tmp_path):
    """DPO with LoRA (the reference: the same weights with LoRA off, reading the same images) on
    a ``prompt`` / ``chosen`` / ``rejected`` + ``images`` JSONL: every step runs, the loss
    starts at log 2 and falls; the adapters sit in the language model only."""
    run("dpo", files / "pairs.jsonl", tmp_path / "dpo", "--lora.rank", "4",
        "--optim.learning-rate", "1e-2")
    rows = records(tmp_path / "dpo")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.03
    assert all(np.isfinite(r["rewards/margins"]) for r in rows)


@pytest.mark.slow
def test_lora_and_full_fine_tuning_leave_the_vision_tower_frozen(lm):
    """``runs.build_model``: LoRA ``all-linear`` adapts the language model's projections only
    trainably, full fine-tuning trains every language-model weight; the vision encoder (and its
    projection) never trains; the run's ``lm.images`` is the preprocessor's image handling."""
    from nnx_posttrain import config as config_lib
    from flax import nnx

    for lora in (config_lib.LoraConfig(rank=2, targets="all-linear"), config_lib.LoraConfig()):
        built, module = runs.build_model(runs.ModelSpec(NAME, "float32", 0, lora),
                                         echo=lambda _: None)
        every = [v.path for v in module.weights]
        trained = [v.path for _, v in nnx.to_flat_state(nnx.state(module, model.trainable_filter))]
        tower = [p for p in every if p.startswith(("image_encoder", "vision_output"))]
        assert tower and trained and not set(tower) & set(trained)
        assert not [p for p in tower if "lora" in p]  # no adapter on the tower either
        if lora.rank:
            assert all("lora" in p for p in trained)
        else:
            assert set(trained) == set(every) - set(tower)
        assert (built.images.tokens_per_image, built.images.max_images) == (4, 2)


def test_a_local_preset_directory_of_a_vision_model_loads_with_its_images(lm, tmp_path):
    """``save_to_preset`` then ``--model DIR``: KerasHub's own ``from_preset`` (its Gemma 3
    preprocessor built without TensorFlow), the same weights, the same image handling."""
    lm.task.save_to_preset(str(tmp_path / "preset"))
    built, _ = runs.build_model(runs.ModelSpec(str(tmp_path / "preset"), "float32"),
                                echo=lambda _: None)
    assert model.reads_images(built.module) and built.chat_format == "gemma"
    assert (built.images.tokens_per_image, built.images.max_images) == (4, 2)
    assert built.images.converter.image_size == lm.images.converter.image_size
    np.testing.assert_array_equal(
        np.asarray(built.module.vision_encoder.weights[0].value),
        np.asarray(lm.module.vision_encoder.weights[0].value))
    shutil.rmtree(tmp_path / "preset")


@pytest.mark.slow
def test_a_precomputed_reference_reads_the_images(files, tmp_path):
    """``--algo.reference precompute``: the reference log-probs, computed before training over
    the data with its images, equal the policy's at the first step (DPO's loss is log 2 there;
    without the images they would not be)."""
    run("dpo", files / "pairs.jsonl", tmp_path / "pre", "--lora.rank", "4",
        "--algo.reference", "precompute", "--steps", "1")
    first = records(tmp_path / "pre")[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=5e-5)  # without the images: 0.69350
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-4)


@pytest.mark.slow
def test_train_vision_trains_the_tower_against_a_copied_reference(lm, files, tmp_path):
    """``--train-vision``: every weight of the tower (its blocks too) trains beside the language
    model's LoRA;
    DPO's reference is then a frozen copy of the starting weights (LoRA off would keep the
    trained tower), so the first step's loss is log 2; the run loads back with its tower. A
    text model has no tower to train: refused."""
    said = []
    train_run("dpo", "--model", NAME, "--data", files / "pairs.jsonl", "--batching.max-length",
              LENGTH, *STEPS, "--run-dir", tmp_path / "tower", "--lora.rank", "4",
              "--train-vision", "--optim.learning-rate", "1e-2", "--steps", "2", echo=said.append)
    assert any(line.endswith("reference: copy") for line in said)
    assert records(tmp_path / "tower")[0]["loss"] == pytest.approx(np.log(2), abs=5e-5)
    assert json.loads((tmp_path / "tower" / "config.json").read_text())["train_vision"] is True
    loaded = runs.load(tmp_path / "tower", echo=lambda _: None)
    tower = {v.path: np.asarray(v.value) for v in loaded.module.vision_encoder.weights}
    start = {v.path: np.asarray(v.value) for v in lm.module.vision_encoder.weights}
    assert tower.keys() == start.keys()
    assert all(np.abs(tower[p] - start[p]).max() > 1e-4 for p in tower)  # its blocks too
    with pytest.raises(errors.ConfigError, match="lora_base: with --train-vision"):
        run("dpo", files / "pairs.jsonl", tmp_path / "refused", "--lora.rank", "4",
            "--train-vision", "--algo.reference", "lora_base")
    with pytest.raises(errors.ConfigError, match="no vision encoder"):
        train_run("sft", *MICRO, "--train-vision", *STEPS, "--run-dir", tmp_path / "text",
                  echo=lambda _: None)


@pytest.mark.slow
def test_eval_data_with_images_gives_the_eval_loss(files, tmp_path):
    """``--eval-data`` with images: the eval loss reads them; without an ``answer`` column exact
    match is left out with a word, as for text (with one, the sampler reads the images:
    ``test_vision_rl``)."""
    said = []
    train_run("sft", "--model", NAME, "--data", files / "sft.jsonl", "--batching.max-length",
              LENGTH, *STEPS, "--steps", "2", "--eval-data", files / "sft.jsonl",
              "--eval.every", "2", "--eval.exact-match", "8", "--run-dir", tmp_path / "eval",
              echo=said.append)
    assert any("has no 'answer' column" in line for line in said)
    evaluated = records(tmp_path / "eval", "eval")
    assert [r["step"] for r in evaluated] == [0, 2]
    assert all(np.isfinite(r["loss"]) and "exact_match" not in r for r in evaluated)


@pytest.mark.slow
def test_rows_that_copy_the_examples_read_their_images_encoded_once(lm):
    """A preference pair's rows (the examples twice: chosen, then rejected) each read their
    example's images, which the vision encoder encodes once: the log-probs equal those of each
    copy alone, and the encoder sees the examples' images only."""
    from flax import nnx

    b = batch(lm, [shapes.sft_record(i) for i in range(2)])
    twice = {k: np.concatenate([b[k], b[k]]) for k in b}
    seen = []
    encoder = next(layer for layer in lm.module.layers
                   if isinstance(layer, type(lm.module.vision_encoder)))
    original = type(encoder).call

    def counted(self, images, *args, **kwargs):
        seen.append(images.shape[0])
        return original(self, images, *args, **kwargs)

    state = nnx.split(lm.module)
    fn = jax.jit(lambda s, ids, mask, px: _scored(nnx_merge(s), ids, mask, px))
    try:
        type(encoder).call = counted
        both = np.asarray(fn(state, twice["input_ids"], twice["attention_mask"], b["pixel_values"]))
    finally:
        type(encoder).call = original
    once = np.asarray(fn(state, b["input_ids"], b["attention_mask"], b["pixel_values"]))
    np.testing.assert_allclose(both, np.concatenate([once, once]), atol=1e-6)
    assert seen == [2]  # the two examples, not the four rows


def _scored(module, ids, mask, pixels):
    with model.images(pixels):
        return model.token_logprobs(module, ids, mask)


@pytest.mark.slow
def test_kto_reads_each_prompts_images_in_its_kl_rows(files, tmp_path):
    """KTO on ``prompt`` / ``completion`` / ``label`` + ``images``: its KL rows (each prompt with
    another example's completion) are copies of the examples' rows, each reading its prompt's
    images; the steps run, the loss starts at KTO's 0.5 (policy = reference)."""
    run("kto", files / "unpaired.jsonl", tmp_path / "kto", "--lora.rank", "4", "--steps", "2")
    rows = records(tmp_path / "kto")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-4)


QUESTION = "How many shapes are there?"


def _image_prompts(lm, pictures, texts):
    """The sampler's left-padded prompts (width 32) with their pixel values, one picture each, as
    the sample command tokenizes them (the data pipeline's ``TokenizePrompt``)."""
    from nnx_posttrain.cli.sample import image_prompts
    from nnx_posttrain.sampling import sampler

    shown = [image_prompts(lm, [text], [picture]) for text, picture in zip(texts, pictures)]
    ids, mask = sampler.pad_prompts([s.ids[0] for s in shown], lm.tokenizer.pad_id, bucket=32)
    return ids, mask, np.concatenate([s.pixel_values for s in shown])


@pytest.mark.slow
def test_the_sampler_reads_a_prompts_images_as_the_training_forward(lm):
    """Greedy decoding with images (the prompt pass: the placeholder tokens' embeddings replaced
    by the vision tower's, KerasHub's attention over the image tokens; then the KV cache) gives,
    token by token, the argmax of the full training forward (no cache) over the prompt, its
    images and the tokens so far, and its log-probs; the same question about another picture
    gives other logits at the first new token."""
    from flax import nnx
    from nnx_posttrain.sampling import sampler

    pictures = [shapes.sft_record(i)["images"][0] for i in range(3)]
    ids, mask, pixels = _image_prompts(lm, pictures, [QUESTION, QUESTION,
                                                      "Look closely. " + QUESTION])
    assert (ids == lm.task.backbone._nnx_posttrain_image_token).sum(1).tolist() == [4, 4, 4]
    graphdef, *states = nnx.split(lm.module)
    n = 4
    out = sampler.make_sampler(graphdef, n)(states, ids, mask, jax.random.key(0),
                                             sampler.Draw(0.0, 1.0, [-1]), pixels)
    got, logps = np.asarray(out["completion_ids"]), np.asarray(out["logprobs"])
    width = ids.shape[1]
    tokens = np.concatenate([ids, got], 1)
    masks = np.concatenate([mask, np.ones_like(got)], 1)
    full = np.asarray(_logits(nnx.split(lm.module), tokens, masks, pixels))
    expected = full[:, width - 1:-1].argmax(-1)
    np.testing.assert_array_equal(got, expected)
    logp = np.asarray(jax.nn.log_softmax(full[:, width - 1:-1], -1))
    np.testing.assert_allclose(logps, np.take_along_axis(logp, got[..., None], -1)[..., 0],
                               atol=2e-5)
    first = full[:, width - 1]
    assert np.abs(first[0] - first[1]).max() > 1e-3  # the same question, another picture
    assert np.abs(logps[0, 0] - logps[1, 0]) > 1e-5


@pytest.mark.slow
def test_the_sample_command_shows_the_prompt_an_image(files, micro, tmp_path, monkeypatch, capsys):
    """``nnx-posttrain sample RUN --image FILE`` on a vision run: the answer is the sampler's
    with that image (``sample_texts`` of ``image_prompts``); a missing file or one that is no
    image is refused naming it, before the model loads; a text model has no vision tower."""
    from types import SimpleNamespace

    from nnx_posttrain import cli
    from nnx_posttrain.cli import sample as sample_command
    from nnx_posttrain.sampling import sampler

    run("sft", files / "sft.jsonl", tmp_path / "run", "--steps", "1")
    command = ["sample", str(tmp_path / "run"), "--prompt", QUESTION, "--max-new-tokens", "3"]
    assert cli.main(command + ["--image", str(files / "1.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    out = out[out.index(f"> {QUESTION}"):]  # after what training and loading print
    loaded = runs.load(tmp_path / "run", echo=lambda _: None)
    picture = np.asarray(Image.open(files / "1.png").convert("RGB"))
    shown = sample_command.image_prompts(loaded.lm, [QUESTION], [picture])
    assert out[:2] == [f"> {QUESTION}", sampler.sample_texts(
        loaded.lm, loaded.policy(), shown, sampler.Sampling(3))[0][0]]
    (tmp_path / "text.png").write_text("not a picture")
    for name, why in (("missing.png", "no such file"), ("text.png", "not a readable image")):
        cli_error(capsys, command + ["--image", str(tmp_path / name)],
                  match=f"error: --image {tmp_path / name}: .*{why}")
    monkeypatch.setattr(sample_command.runs, "load", lambda run_dir, step: SimpleNamespace(
        lm=micro, policy=lambda: micro.module))
    cli_error(capsys, command + ["--image", str(files / "1.png")],
              match="--image: gemma_micro has no vision tower")
