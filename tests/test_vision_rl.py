"""Images beyond the offline losses, on the micro Gemma 3 vision model: exact-match evaluation
samples each held-out prompt with its images (the answers are ``sample_texts``'s with the same
images)."""

import json

import numpy as np
import pytest
from PIL import Image

from nnx_posttrain import data, metrics_log, runs
from nnx_posttrain.sampling import generate, sampler
from nnx_posttrain.tasks import shapes
from support import records, train_run

NAME = "gemma3_vision_micro"
LENGTH = 40
COMMON = ["--model", NAME, "--batching.max-length", LENGTH, "--log-every", "1",
          "--batching.grad-accum", "1", "--optim.schedule", "constant",
          "--optim.warmup-steps", "0", "--checkpoint.every", "0"]


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
