"""What a rollout generated (``Generated``), what the rewards score (``Completions``), and the
metrics of generations."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


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
    logged, the completions as chat messages (tool runs) and metrics of the generation."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    model_mask: np.ndarray
    finished: np.ndarray
    texts: list[str]
    conversations: list | None = None
    metrics: dict = dataclasses.field(default_factory=dict)

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
