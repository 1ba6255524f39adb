"""Images beyond the offline losses, on the micro Gemma 3 vision model: exact-match evaluation
samples each held-out prompt with its images (the answers are ``sample_texts``'s with the same
images), and GRPO samples its rollouts from TRL's prompt-only vision format (``prompt`` with an
``{"type": "image"}`` part + ``images``) with the images, which the training forward reads too:
the rollout's log-probs are the sampler's, and at a rollout's first step the importance ratio is
1 (no token clipped under a tiny clip range). So for RLOO and PPO (whose rollout values are its
value head's forward with the images), and online DPO's pairs read their prompt's images."""

import json
import zlib

import jax
import numpy as np
import pytest
from PIL import Image

from nnx_posttrain import data, errors, metrics_log, model, runs, train
from nnx_posttrain.algorithms import online, pairs
from nnx_posttrain.sampling import generate, sampler
from nnx_posttrain.tasks import shapes
from support import jitted, records, train_run

NAME = "gemma3_vision_micro"
LENGTH = 40
COMMON = ["--model", NAME, "--batching.max-length", LENGTH, "--log-every", "1",
          "--batching.grad-accum", "1", "--optim.schedule", "constant",
          "--optim.warmup-steps", "0", "--checkpoint.every", "0"]


def varied_reward(prompts, completions, **_):
    """Test reward: a hash of the completion's text (completions differ: so do their rewards,
    and the advantages are not all 0)."""
    return [float(zlib.crc32(c[0]["content"].encode()) % 7) for c in completions]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """PNG files beside a ``messages`` + ``images`` JSONL (SFT; its ``answer`` column: exact match
    applies) and a prompt-only ``prompt`` + ``images`` + ``answer`` JSONL (GRPO), as TRL's vision
    formats have them."""
    root = tmp_path_factory.mktemp("vision_rl")
    sft, prompts = [], []
    for i in range(8):
        record = shapes.sft_record(i)
        Image.fromarray(record["images"][0]).save(root / f"{i}.png")
        sft.append(dict(record, images=[f"{i}.png"], answer=record["messages"][-1]["content"]))
        prompts.append(dict(shapes.prompt_record(i), images=[f"{i}.png"]))
    for name, rows in (("sft.jsonl", sft), ("prompts.jsonl", prompts)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _recording_greedy(monkeypatch):
    """The evaluator's greedy sampler, recording the pixel values it is called with."""
    seen, make = [], generate.make_greedy

    def make_greedy(graphdef, max_new_tokens):
        sample = make(graphdef, max_new_tokens)

        def recorded(*args):
            seen.append(None if len(args) < 6 or args[5] is None else np.asarray(args[5]))
            return sample(*args)
        return recorded

    monkeypatch.setattr(generate, "make_greedy", make_greedy)
    return seen


def _image_prompts(lm, path, limit, conversation):
    """The first ``limit`` records of a JSONL as the sampler reads them (their prompt, or the
    conversation before its last turn, with its images: ``data.TokenizePrompt``)."""
    transform = data.TokenizePrompt(lm.tokenizer, lm.chat_format, LENGTH, images=lm.images)
    src = data.source(str(path), "eval")
    ids, pixels = [], []
    for i in range(limit):
        record = dict(src[i])
        if conversation:
            record["prompt"] = record.pop("messages")[:-1]
        ex = transform(record)
        ids.append([int(t) for t, m in zip(ex["prompt_ids"], ex["prompt_mask"]) if m])
        pixels.append(ex["pixel_values"])
    return sampler.ImagePrompts(ids, np.stack(pixels))


def _eval_answers(run_dir, step):
    return [r["completion"] for r in metrics_log.read_completions(run_dir)
            if r["step"] == step and r["split"] == "eval"]


@pytest.mark.slow
def test_exact_match_samples_the_held_out_prompts_with_their_images(files, tmp_path,
                                                                     monkeypatch):
    """SFT with ``--eval-data`` holding images: exact match is evaluated (no longer left out),
    the greedy sampler is given each held-out record's pixel values, and the logged answers
    equal ``sample_texts`` of the trained run on the same prompts and images."""
    seen = _recording_greedy(monkeypatch)
    said = []
    train_run("sft", *COMMON, "--data", files / "sft.jsonl", "--steps", "1",
              "--batching.batch-size", "4", "--eval-data", files / "sft.jsonl",
              "--eval.every", "1", "--eval.exact-match", "6", "--eval.max-new-tokens", "3",
              "--optim.learning-rate", "1e-2", "--run-dir", tmp_path / "sft", echo=said.append)
    assert not any("no exact match" in line for line in said)
    evaluated = records(tmp_path / "sft", "eval")
    assert [r["step"] for r in evaluated] == [0, 1]
    assert all(0 <= r["exact_match"] <= 1 for r in evaluated)
    loaded = runs.load(tmp_path / "sft", echo=lambda _: None)
    shown = _image_prompts(loaded.lm, files / "sft.jsonl", 6, conversation=True)
    assert len(seen) == 2 and all(s is not None for s in seen)  # one call per evaluation
    np.testing.assert_array_equal(seen[-1], shown.pixel_values)  # batch of 6: no padding row
    expected = [t[0] for t in sampler.sample_texts(loaded.lm, loaded.policy(), shown,
                                                   sampler.Sampling(3))]
    assert _eval_answers(tmp_path / "sft", 1) == expected
    keys = [json.loads(line)["keys"] for line in
            (tmp_path / "sft" / "exact_match.jsonl").read_text().splitlines()]
    assert len(set(keys[-1])) == 6  # one key per problem: the prompt and its picture


def _grpo(files, run_dir, *extra, algorithm="grpo"):
    return train_run(algorithm, *COMMON, "--data", files / "prompts.jsonl", "--run-dir", run_dir,
                     "--batching.batch-size", "4", "--algo.num-generations", "2",
                     "--algo.max-completion-length", "4", "--algo.temperature", "1.0",
                     "--algo.rewards", "test_vision_rl:varied_reward", "--lora.rank", "4",
                     "--optim.learning-rate", "3e-2", *extra, echo=lambda _: None)


@pytest.mark.slow
def test_grpo_rollouts_and_training_forward_read_the_prompts_images(files, tmp_path,
                                                                   monkeypatch):
    """GRPO on prompt-only records with images, two iterations per rollout and a clip range of
    1e-3: step 1's ratio is 1 at every token (nothing clipped: the rollout's log-probs and the
    training forward's read the same images), step 2's is not (the update changed the policy);
    the loss is finite. A rollout's log-probs equal the sampler's with the images, which differ
    from the sampler's without them. Held-out prompts are answered with their images too."""
    seen = _recording_greedy(monkeypatch)
    result = _grpo(files, tmp_path / "grpo", "--steps", "2", "--algo.num-iterations", "2",
                   "--algo.epsilon", "1e-3", "--eval-data", files / "prompts.jsonl",
                   "--eval.every", "2", "--eval.exact-match", "4", "--eval.max-new-tokens", "3")
    rows = records(tmp_path / "grpo")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["clip_ratio/region_mean"] == 0.0
    assert rows[1]["clip_ratio/region_mean"] > 0.0
    assert all(s is not None and s.shape[0] == 4 for s in seen)  # the 4 held-out prompts
    assert "reward" in records(tmp_path / "grpo", "eval")[-1]

    rollouts, state = result.source, result.state
    lm = result.lm
    transform = data.TokenizePrompt(lm.tokenizer, lm.chat_format, LENGTH, images=lm.images)
    prompts = next(data.train_batches(rollouts.train_src, transform, 2, seed=0))
    assert list(prompts["image_count"]) == [1, 1]
    batch, _ = rollouts.rollout(7, state, prompts)
    np.testing.assert_array_equal(batch["pixel_values"],
                                  np.repeat(prompts["pixel_values"], 2, axis=0))
    width = prompts["prompt_ids"].shape[1]
    states = result.algorithm.policy_view(rollouts.graphdef, state["params"],
                                          result.frozen["model"])[1]
    ids, mask = batch["input_ids"][:, :width], batch["attention_mask"][:, :width]
    draw = sampler.Draw(1.0, 1.0, rollouts.stop_ids)
    key = jax.random.fold_in(jax.random.key(0), 7)
    sampled = rollouts._sample(states, ids, mask, key, draw, batch["pixel_values"])
    done = np.asarray(sampled["completion_mask"])
    np.testing.assert_array_equal(batch["attention_mask"][:, width:], done)  # the same sample
    old = rollouts.logps(batch, state, True, False)["old_logps"][:, width:]
    np.testing.assert_allclose(old * done, np.asarray(sampled["logprobs"]), atol=2e-4)
    blind = rollouts._sample(states, ids, mask, key, draw)  # the same prompts, no image
    assert np.abs(np.asarray(blind["logprobs"])[:, 0] - old[:, 0]).max() > 1e-4


@pytest.mark.slow
def test_rloo_reads_the_images_on_both_sides_of_its_ratio(files, tmp_path):
    """RLOO (one ratio per sequence) on the same prompts: nothing clipped at a rollout's first
    step under a clip range of 1e-3, something at its second."""
    _grpo(files, tmp_path / "rloo", "--steps", "2", "--algo.num-iterations", "2",
          "--algo.epsilon", "1e-3", "--eval.every", "0", algorithm="rloo")
    rows = records(tmp_path / "rloo")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["clip_ratio/region_mean"] == 0.0
    assert rows[1]["clip_ratio/region_mean"] > 0.0


@pytest.mark.slow
def test_grpo_with_images_resumes_exactly(files, tmp_path):
    """Stopped after its first rollout and resumed, a GRPO run on images logs the losses and
    rewards of the uninterrupted run."""
    _grpo(files, tmp_path / "whole", "--steps", "3", "--eval.every", "0")
    _grpo(files, tmp_path / "cut", "--steps", "1", "--eval.every", "0", "--checkpoint.every", "1")
    _grpo(files, tmp_path / "cut", "--steps", "3", "--eval.every", "0", "--resume")
    whole = [(r["step"], r["loss"], r["reward"]) for r in records(tmp_path / "whole")]
    cut = [(r["step"], r["loss"], r["reward"]) for r in records(tmp_path / "cut")]
    assert [s for s, *_ in cut] == [1, 2, 3]
    np.testing.assert_allclose(np.array(cut)[:, 1:], np.array(whole)[:, 1:], rtol=1e-5,
                               atol=1e-6)


def _rollout(result, step=7):
    """A rollout of the trained ``result`` on the first two prompts of its data (one image
    each): (prompts, training batch)."""
    lm = result.lm
    transform = data.TokenizePrompt(lm.tokenizer, lm.chat_format, LENGTH, images=lm.images)
    prompts = next(data.train_batches(result.source.train_src, transform, 2, seed=0))
    assert list(prompts["image_count"]) == [1, 1]
    return prompts, result.source.rollout(step, result.state, prompts)[0]


@pytest.mark.slow
def test_ppo_rollout_values_and_ratio_read_the_prompts_images(files, tmp_path):
    """PPO on prompt-only records with images, two epochs per rollout and clip ranges of 1e-3:
    at each rollout's first epoch nothing is clipped, the policy's ratio nor the values (the
    second rollout starts after the value head trained), at its second something is; the loss is
    finite. A rollout's log-probs and values are a direct forward's with its images, and its
    values differ from the forward's without them."""
    result = _grpo(files, tmp_path / "ppo", "--steps", "4", "--algo.num-iterations", "2",
                   "--algo.cliprange", "1e-3", "--algo.cliprange-value", "1e-3",
                   "--eval.every", "0", algorithm="ppo")
    rows = records(tmp_path / "ppo")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert [r["policy/clipfrac_avg"] for r in rows[::2]] == [0.0, 0.0]
    assert rows[2]["val/clipfrac_avg"] == 0.0
    assert all(r["policy/clipfrac_avg"] > 0.0 for r in rows[1::2])

    prompts, batch = _rollout(result)
    np.testing.assert_array_equal(batch["pixel_values"],
                                  np.repeat(prompts["pixel_values"], 2, axis=0))
    module, _ = model.merge(result.graphdef, result.state["params"], result.frozen)
    algo = result.algorithm

    def forward(pixels):  # jitted: one program, not an operation at a time
        def run(module, ids, mask, positions, *pixels):
            with model.images(pixels[0] if pixels else None):
                return module.logps_and_values(ids, mask, algo.logprob_chunk,
                                               algo.logprob_temperature, positions=positions)
        out = jitted(run, module)(batch["input_ids"], batch["attention_mask"],
                                  batch["positions"], *[] if pixels is None else [pixels])
        return [np.asarray(x) for x in out]

    mask = batch["loss_mask"]
    logps, values = forward(batch["pixel_values"])
    np.testing.assert_allclose(batch["old_logps"] * mask, logps * mask, atol=2e-4)
    np.testing.assert_allclose(batch["old_values"], values, atol=2e-4)
    assert np.abs(values).max() > 1e-2  # the value head trained: it reads the hidden states
    blind = forward(None)[1]
    assert np.abs((blind - batch["old_values"]) * mask).max() > 1e-3


@pytest.mark.slow
def test_online_dpo_pairs_read_their_prompts_images(files, tmp_path):
    """Online DPO on prompt-only records with images: a 2-step run trains with a finite loss;
    each pair built from a rollout carries its prompt's pixel values, and the pair log-probs the
    training step computes are those of a direct forward of each pair's rows with its prompt's
    images (which differ from the forward's without them)."""
    result = _grpo(files, tmp_path / "online_dpo", "--steps", "2", "--eval.every", "0",
                   algorithm="online_dpo")
    rows = records(tmp_path / "online_dpo")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)

    prompts, batch = _rollout(result)
    np.testing.assert_array_equal(batch["pixel_values"], prompts["pixel_values"])  # one a pair
    algo, state = result.algorithm, result.state
    evaluate = jax.jit(train.make_eval_step(result.graphdef, algo.loss))
    sums = evaluate(state["params"], result.frozen, result.source.to_device(batch))[2]
    module, _ = model.merge(result.graphdef, state["params"], result.frozen)

    def logps(module, ids, mask, loss_mask, *pixels):
        with model.images(pixels[0] if pixels else None):
            return pairs.sequence_logps(module, ids, mask, loss_mask, algo.logprob_chunk)[0]

    forward = jitted(logps, module)  # one program with the images, one without

    def direct(side, images):
        out = []
        for i in range(len(prompts["pixel_values"])):  # pair i: prompt i's two completions
            pixels = [prompts["pixel_values"][i:i + 1]] if images else []
            out.append(float(forward(*(batch[f"{side}_{k}"][i:i + 1] for k in
                                       ("input_ids", "attention_mask", "loss_mask")),
                                     *pixels)[0]))
        return np.mean(out)

    for side in ("chosen", "rejected"):
        total, count = (float(x) for x in sums[f"logps/{side}"])
        np.testing.assert_allclose(total / count, direct(side, True), rtol=1e-4, atol=1e-3)
        assert abs(total / count - direct(side, False)) > 1e-2


@pytest.mark.slow
def test_rollouts_with_tools_refuse_image_prompts(files, tmp_path):
    """Tool-calling rollouts read no image yet: prompts with images are refused by name rather
    than sampled without them."""
    with pytest.raises(errors.DataError, match="rollouts with tools do not read yet"):
        _grpo(files, tmp_path / "tools", "--steps", "1", "--eval.every", "0",
              "--algo.tools", "agent_tools:multiply")
    assert all(getattr(online, name).reads_images for name in ("GRPO", "RLOO", "PPO",
                                                               "OnlineDPO"))
