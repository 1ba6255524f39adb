"""What a rollout generated (``Generated``), what the rewards score (``Completions``), and the
metrics of generations."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from nnx_posttrain import errors


class Completions(NamedTuple):
    """Completions as the reward functions score them (``rewards.score_batch``): their texts,
    the left-padded prompts [B, P] with their mask, the completions' ids [B, N] with the mask
    of the model's own tokens, and each completion as chat messages (tool-calling rollouts;
    None otherwise)."""

    texts: list[str]
    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    conversations: list | None = None


@dataclasses.dataclass
class Generated:
    """One rollout's sequences: left-padded prompts [B, P], completions [B, N] with their mask,
    the model's own tokens (``model_mask``: 0 on tool results), ``finished`` [B], the texts
    logged, the completions as chat messages (tool runs), metrics of the generation, and the
    prompts' images (a vision model's ``pixel_values`` [B, max images, H, W, 3], or None)."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    model_mask: np.ndarray
    finished: np.ndarray
    texts: list[str]
    conversations: list | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    pixel_values: np.ndarray | None = None

    @property
    def completions(self) -> Completions:
        """What the rewards score: the model's own tokens of each completion."""
        return Completions(self.texts, self.prompt_ids, self.prompt_mask, self.completion_ids,
                           self.model_mask, self.conversations)


def completion_metrics(mask, finished) -> dict:
    lengths = mask.sum(axis=1).astype(np.float32)
    done = lengths[finished]
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(1.0 - finished.mean()),
        "completions/mean_terminated_length": float(done.mean()) if len(done) else 0.0,
        "completions/min_terminated_length": float(done.min()) if len(done) else 0.0,
        "completions/max_terminated_length": float(done.max()) if len(done) else 0.0,
    }


def means(rows: list[dict]) -> dict:
    """Per-key mean of host-side metrics (rollouts) since the last log, NaN-ignoring."""
    out = {}
    for key in sorted({k for r in rows for k in r}):
        values = [r[key] for r in rows if key in r and np.isfinite(r[key])]
        out[key] = float(np.mean(values)) if values else float("nan")
    return out


def prompt_pixels(algorithm, prompts: dict, g: int, tools: bool) -> np.ndarray | None:
    """The images of a batch of prompts (a vision model's ``pixel_values``), one copy per
    completion (``g`` per prompt), for the sampler and the training forward; None for a text
    model. Images in the prompts of an algorithm that reads none (``reads_images``; the online
    methods here all read them) or of a run with tools are refused."""
    if "pixel_values" not in prompts:
        return None
    if tools or not algorithm.reads_images:
        if np.asarray(prompts["image_count"]).any():
            why = "with tools" if tools else f"of {algorithm.name}"
            raise errors.DataError(f"the prompts hold images, which the rollouts {why} do not "
                                   "read yet: GRPO, RLOO, PPO and online DPO without tools do")
        return None
    return np.repeat(np.asarray(prompts["pixel_values"], np.float32), g, axis=0)


def decode_texts(lm, stop_ids, ids, mask) -> list[str]:
    """The text of each completion row (its masked tokens, stop tokens left out); a tokenizer
    failure names the row and its ids."""
    stops = set(np.asarray(stop_ids).tolist())
    out = []
    for i, (row, mrow) in enumerate(zip(ids, mask)):
        kept = [int(t) for t, m in zip(row, mrow) if m and int(t) not in stops]
        try:
            out.append(lm.tokenizer.decode(kept))
        except Exception as exc:  # noqa: BLE001 - a tokenizer failure names the row and ids
            size = lm.tokenizer.vocab_size
            bad = [t for t in kept if not 0 <= t < size]
            raise errors.ModelError(
                f"the tokenizer cannot decode completion {i} of the rollout "
                f"({type(exc).__name__}: {exc}); ids {kept[:16]}"
                + (f", of which {bad[:8]} are outside the tokenizer's {size} ids" if bad else "")
            ) from None
    return out
