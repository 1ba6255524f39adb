"""The methods beyond SFT, DPO and GRPO with images on Gemma 4 and Qwen 3.5 (the built-in micros
``gemma4_vision_micro``, ``qwen3_5_vision_micro``; Gemma 3's: ``test_vision.py``,
``test_vision_rl.py``): KTO's KL rows read each prompt's images, SimPO's and ORPO's pairs carry
their images as DPO's do, and RLOO samples and trains on image prompts with the vision tower
trained (``--train-vision``) against a reference copy of the starting weights."""

import zlib

import numpy as np
import pytest

from nnx_posttrain import data, model, runs
from nnx_posttrain.tasks import shapes
from support import image_prompt_file, jitted, records, train_run, vision_model

FAMILIES = ("gemma4_vision_micro", "qwen3_5_vision_micro")
LENGTH = {"gemma3_vision_micro": 48, "gemma4_vision_micro": 48, "qwen3_5_vision_micro": 96}


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return vision_model(request.param)


def _images_of(lm, record_list):
    return np.stack([lm.images.pixels(r["images"]) for r in record_list])


def _batch(lm, record_list):
    """``record_list`` through the data pipeline's transform for their format, stacked."""
    transform = data.make_transform(record_list, lm, LENGTH[lm.name])
    examples = [transform(r) for r in record_list]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


@pytest.mark.slow
def test_kto_kl_rows_read_each_prompts_images(lm):
    """KTO's KL rows (each prompt with the next example's completion, ``KTO.prepare``) go
    through the model after the examples' rows in one forward: each KL row's log-prob equals a
    forward of that row alone with its prompt's images (Qwen 3.5: at that row's M-RoPE
    positions), and other pictures change it (the images are read, not only the text)."""
    from nnx_posttrain.algorithms.kto import KTO, KTOConfig
    from nnx_posttrain.algorithms.pairs import sequence_logps

    unpaired = [shapes.unpaired_record(i) for i in range(3)]
    batch = _batch(lm, unpaired)
    pixels = batch["pixel_values"]
    np.testing.assert_array_equal(pixels, _images_of(lm, unpaired))
    algo = KTO(KTOConfig())
    prepared = algo.prepare({k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")})

    def both(module, arrays, pixels):
        with model.images(pixels):
            return algo._forward(module, arrays)

    def alone(module, ids, mask, loss_mask, pixels):
        with model.images(pixels):
            return sequence_logps(module, ids, mask, loss_mask, None)[0]

    forward, row = jitted(both, lm.module), jitted(alone, lm.module)
    _, kl = (np.asarray(x) for x in forward(prepared, pixels))
    want = [float(row(*(prepared[f"kl_{k}"][i:i + 1] for k in
                        ("input_ids", "attention_mask", "loss_mask")), pixels[i:i + 1])[0])
            for i in range(len(unpaired))]
    np.testing.assert_allclose(kl, want, rtol=1e-5, atol=1e-4)
    placeholders = [int(t) for t in np.unique(batch["input_ids"][batch["vision_mask"] > 0])]
    assert len(placeholders) == 1  # the KL rows keep their prompt's image tokens
    assert ((prepared["kl_input_ids"] == placeholders[0]).sum(1) ==
            batch["vision_mask"].sum(1)).all()
    other = np.asarray(forward(prepared, pixels[[1, 2, 0]])[1])
    assert np.abs(other - kl).min() > 1e-4


@pytest.mark.slow
def test_simpo_and_orpo_pairs_carry_their_images_as_dpos(lm):
    """SimPO's and ORPO's batches are DPO's (no compilation here): each pair's pixel values
    once, its chosen and rejected rows each holding the image tokens, run concatenated (never
    as shared-prompt rows, whose mask would not keep the image tokens' attention), the forward
    giving each row its pair's images (``model.vision``: rows that copy the examples). ORPO's
    default NLL over the chosen row's prompt and answer counts the image tokens, as TRL's
    ORPOTrainer (every attended token); ``--algo.nll-tokens completion`` leaves them out."""
    from nnx_posttrain.algorithms.pairs import PairAlgorithm
    from nnx_posttrain.algorithms.preference import ORPO, ORPOConfig, SimPO, SimPOConfig

    pairs = [shapes.preference_record(i) for i in range(2)]
    batch = _batch(lm, pairs)
    np.testing.assert_array_equal(batch["pixel_values"], _images_of(lm, pairs))
    for algo in (SimPO(SimPOConfig()), ORPO(ORPOConfig()),
                 ORPO(ORPOConfig(nll_tokens="completion"))):
        algo.setup(lm.module)
        assert algo.longest_shared == 0 and type(algo).pair_logps is PairAlgorithm.pair_logps
        prepared = algo.prepare(batch)
        assert "shared_input_ids" not in prepared
        vision = {side: prepared[f"{side}_vision_mask"] > 0 for side in ("chosen", "rejected")}
        for v in vision.values():  # each row: its pair's picture (one an example here)
            assert v.sum(1).tolist() == [lm.images.tokens_per_image] * len(pairs)
        if getattr(algo.cfg, "nll_tokens", None) == "prompt_and_completion":  # ORPO's default
            assert (prepared["chosen_nll_mask"][vision["chosen"]] > 0).all()
        else:
            assert "chosen_nll_mask" not in prepared


def varied_reward(prompts, completions, **_):
    """Test reward: a hash of the completion's text (completions differ, so do their rewards)."""
    return [float(zlib.crc32(c[0]["content"].encode()) % 7) for c in completions]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    """TRL's prompt-only vision format of the built-in image task, its pictures (one size) as
    PNG files beside it."""
    return image_prompt_file(tmp_path_factory.mktemp("vision_methods_prompts"))


@pytest.mark.slow
def test_rloo_trains_the_tower_on_image_prompts(lm, prompt_file, tmp_path):
    """RLOO on prompt-only image records with ``--train-vision`` (and LoRA), two iterations a
    rollout, a clip range of 1e-3: at each rollout's first step nothing is clipped (the
    sampler's log-probs, the tower's images included, are the training forward's: at step 3
    with the tower trained two steps), at its second something is; the KL to the reference is
    0 at step 1 and not after (the reference: a frozen copy of the starting weights, ``copy``,
    since LoRA off would keep the trained tower). Every trainable weight of the tower changed,
    the reference copy's did not, and the run loads back with its tower."""
    said = []
    result = train_run(
        "rloo", "--model", lm.name, "--data", prompt_file, "--batching.max-length",
        LENGTH[lm.name] + 32, "--steps", "4", "--log-every", "1", "--eval.every", "0",
        "--eval.exact-match", "0", "--batching.batch-size", "2", "--batching.grad-accum", "1",
        "--checkpoint.every", "0", "--optim.schedule", "constant", "--optim.warmup-steps", "0",
        "--run-dir", tmp_path / "rloo", "--algo.num-generations", "2",
        "--algo.max-completion-length", "4", "--algo.temperature", "1.0",
        "--algo.rewards", "test_vision_methods:varied_reward", "--lora.rank", "4",
        "--train-vision", "--optim.learning-rate", "3e-2", "--algo.num-iterations", "2",
        "--algo.epsilon", "1e-3", echo=said.append)
    assert any(line.endswith("reference: copy") for line in said)
    rows = records(tmp_path / "rloo")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)
    assert [r["clip_ratio/region_mean"] for r in rows[::2]] == [0.0, 0.0]
    assert all(r["clip_ratio/region_mean"] > 0.0 for r in rows[1::2])
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and abs(rows[2]["kl"]) > 1e-6

    start = {v.path: np.asarray(v.value) for v in lm.module.vision_encoder.weights}
    trained = {p: np.asarray(v) for p, v in model.named_variables(result.state["params"]).items()
               if p in start}
    reference = model.named_variables(result.frozen["reference"])
    assert len(trained) >= len(start) // 3  # (Gemma 4's clip bounds are no trainable weight)
    assert all(np.abs(trained[p] - start[p]).max() > 0 for p in trained)
    assert all(np.array_equal(np.asarray(reference[p]), start[p]) for p in trained)
    loaded = runs.load(tmp_path / "rloo", echo=lambda _: None)  # (Qwen's: its tower's names)
    back = {v.path: np.asarray(v.value) for v in loaded.module.vision_encoder.weights}
    assert all(np.array_equal(back[p], trained[p]) for p in trained)
