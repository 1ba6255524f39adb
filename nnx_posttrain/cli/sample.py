"""``nnx-posttrain sample RUN_DIR --prompt "..." [...]``: answer prompts with a run's checkpoint.

    nnx-posttrain sample runs/sft --prompt "What is 12 + 30?" --prompt "What is 47 + 38?"
    nnx-posttrain sample runs/sft --prompt "Tell me a story." --temperature 0.8 --top-p 0.95 \\
        --num-samples 4 --seed 1
    nnx-posttrain sample runs/vision --image shapes.png --prompt "How many shapes are there?"

Each prompt is a user message rendered with the run's chat template and decoded by the compiled
KV-cache sampler (``nnx_posttrain.sampling.sampler``): greedy by default (``--temperature 0``),
else sampled at that temperature, with optional top-k / top-p truncation. ``--image FILE``
(repeatable; a vision model's, Gemma 3's or Gemma 4's) shows every prompt the images, decoded
and resized as the training data's are; they go before the prompt's text, or where it names them
with the model's image marker (Gemma 3's ``<start_of_image>``, Gemma 4's ``<|image|>``), one per
image.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from nnx_posttrain import data, errors, model, runs
from nnx_posttrain.sampling import sampler

# The longest prompt (tokens) an image prompt may take before its sampling is refused: the
# generation's own check (its context) bounds it again.
PROMPT_ROOM = 1 << 15


def read_images(files: list) -> list:
    """The ``--image`` files as ``uint8`` arrays (height, width, 3), decoded as the data
    pipeline decodes a record's images; a ``ConfigError`` naming a file that is missing or is
    no readable image."""
    arrays = []
    for name in files:
        if not Path(name).is_file():
            raise errors.ConfigError(f"--image {name}: no such file")
        try:
            arrays.append(data.images.decode(Path(name).read_bytes(), f"--image {name}", "image"))
        except errors.DataError as exc:
            raise errors.ConfigError(str(exc)) from None
    return arrays


def _user_message(text: str, marker: str) -> list[dict]:
    """A user message naming its images where ``text`` holds ``marker`` (content parts), else
    the text alone (the images then go before it, as TRL places them)."""
    if marker not in text:
        return [{"role": "user", "content": text}]
    pieces = text.split(marker)
    parts = [{"type": "text", "text": pieces[0]}]
    for piece in pieces[1:]:
        parts += [{"type": "image"}, {"type": "text", "text": piece}]
    return [{"role": "user", "content": [p for p in parts if p.get("text") != ""]}]


def image_prompts(lm, prompts: list[str], images: list) -> sampler.ImagePrompts:
    """User messages that each show ``images`` (``uint8`` arrays, paths, ...), tokenized by the
    data pipeline's prompt transform (``data.TokenizePrompt``: the images placed, decoded,
    resized and rescaled by the model's image converter, their token blocks expanded), for
    ``sampler.sample_texts``. A model with no vision tower is refused."""
    spec = lm.images or data.ImageSpec.of_model(lm)
    if spec is None or not model.reads_images(lm.module):
        raise errors.ConfigError(f"--image: {lm.name} has no vision tower (a text model): "
                                 "sample with a vision-language model (Gemma 3, Gemma 4)")
    transform = data.TokenizePrompt(lm.tokenizer, lm.chat_format, PROMPT_ROOM, images=spec)
    ids, pixels = [], []
    for i, text in enumerate(prompts):
        ex = transform({"prompt": _user_message(text, spec.marker), "images": list(images),
                        "_where": f"--prompt {i + 1}"})
        if ex["truncated"]:
            raise errors.ConfigError(f"--prompt {i + 1}: over {PROMPT_ROOM:,} tokens with its "
                                     "images")
        ids.append([int(t) for t, m in zip(ex["prompt_ids"], ex["prompt_mask"]) if m])
        pixels.append(ex["pixel_values"])
    return sampler.ImagePrompts(ids, np.stack(pixels))


def answers(run_dir, prompts: list[str], step: int | None = None, images: list | None = None,
            **sampling) -> list[list[str]]:
    """The answers of ``run_dir``'s checkpoint ``step`` (default: the latest) to ``prompts``,
    each showing ``images`` (image files, read by ``read_images``; a vision model's), with
    ``sampling``: ``sampler.sample_texts``' options."""
    pictures = read_images(images or [])  # a bad file: refused before the model loads
    runs.check_policy(run_dir)  # a reward model: refused before it loads
    run = runs.load(run_dir, step)
    shown = image_prompts(run.lm, prompts, pictures) if pictures else prompts
    return sampler.sample_texts(run.lm, run.policy(), shown, sampler.Sampling(**sampling))


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image every prompt shows (repeatable; a vision model's)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="at least 1")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1, help="answers per prompt")
    args = parser.parse_args(argv)
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1 or args.num_samples < 1 \
            or args.max_new_tokens < 1:
        parser.error("need --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1, --num-samples >= 1, "
                     "--max-new-tokens >= 1")
    out = answers(args.run_dir, args.prompt, args.step, args.image,
                  max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, num_samples=args.num_samples)
    for prompt, texts in zip(args.prompt, out):
        print(f"> {prompt}")
        for i, text in enumerate(texts):
            print(f"[{i + 1}] {text}" if len(texts) > 1 else text)
        print()
    return 0
