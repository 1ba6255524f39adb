"""What the pairwise preference algorithms share: chosen and rejected through the model in ONE
forward (``pair_logps``: each prompt once, ``shared_prompt``, else the two rows concatenated), the
reference's log-probs the configured way, and the host-side ``nll_scale`` that keeps TRL's
token-mean NLL terms exact under gradient accumulation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from nnx_posttrain import model
from nnx_posttrain.algorithms import shared_prompt
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.losses.common import token_mean_terms


def sequence_logps(module, ids, attention, loss_mask, chunk, positions=None):
    """(summed, averaged, lengths) completion log-probs of each row, float32 [rows];
    ``positions`` as in ``model.token_logprobs``."""
    token = model.token_logprobs(module, ids, attention, model.Projection(chunk), positions)
    mask = loss_mask.astype(jnp.float32)
    summed = jnp.sum(token * mask, axis=-1)
    lengths = jnp.sum(mask, axis=-1)
    return summed, summed / jnp.maximum(lengths, 1.0), lengths


def _side_logps(module, rows: dict, chunk, with_log_sum_sq):
    """``_side`` of ``rows`` (``input_ids``, ``attention_mask``, ``loss_mask`` and, if any,
    ``positions``) through the model."""
    out = model.token_logprobs(module, rows["input_ids"], rows["attention_mask"],
                               model.Projection(chunk, log_sum_sq=with_log_sum_sq),
                               rows.get("positions"))
    return _side(out if with_log_sum_sq else (out, None), rows["loss_mask"], with_log_sum_sq)


def _side(token_and_lss, loss_mask, with_log_sum_sq):
    token, lss = token_and_lss
    mask = loss_mask.astype(jnp.float32)
    summed = jnp.sum(token * mask, axis=-1)
    lengths = jnp.sum(mask, axis=-1)
    return {"": summed, "_avg": summed / jnp.maximum(lengths, 1.0), "_len": lengths,
            "_tokens": token, "_mask": mask, **({"_lss": lss} if with_log_sum_sq else {})}


def pair_logps(module, batch, chunk, concatenated: bool = True, with_log_sum_sq: bool = False):
    """Chosen and rejected log-probs. A batch with shared rows (``shared_prompt.layout``) runs
    each pair as one row; else ``concatenated`` runs both rows through the model in ONE forward,
    False in two (a benchmark variant). Returns a dict of ``[batch]`` arrays
    ``chosen`` / ``rejected`` (summed over the completion), ``*_avg`` (averaged), ``*_len``
    (completion tokens), and of ``[batch, length]`` arrays ``*_tokens`` (per-token log-probs:
    LD-DPO's split, NLL terms), ``*_mask`` (the loss mask as float) and, with
    ``with_log_sum_sq``, ``*_lss`` (log sum_v p_v^2 per position: WPO's weights)."""
    out = {}
    if "shared_input_ids" in batch:
        sides = shared_prompt.pair_logps(module, batch, chunk, with_log_sum_sq)
        for name, token_and_lss in sides.items():
            side = _side(token_and_lss, batch[f"{name}_loss_mask"], with_log_sum_sq)
            out.update({name + k: v for k, v in side.items()})
        return out
    keys = ("input_ids", "attention_mask", "loss_mask") + (
        ("positions",) if "chosen_positions" in batch else ())
    if not concatenated:
        for name in ("chosen", "rejected"):
            side = _side_logps(module, {k: batch[f"{name}_{k}"] for k in keys}, chunk,
                               with_log_sum_sq)
            out.update({name + k: v for k, v in side.items()})
        return out
    both = _side_logps(module, {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]],
                                                   axis=0) for k in keys}, chunk, with_log_sum_sq)
    n = batch["chosen_input_ids"].shape[0]
    for k, v in both.items():
        out["chosen" + k], out["rejected" + k] = v[:n], v[n:]
    return out


def nll_scale(nll_mask) -> np.ndarray:
    """Host side, on the whole batch before it is split into micro-batches: pairs / NLL tokens,
    as a [batch] float32 column (``nll_scale``) for :func:`nll_terms`."""
    mask = np.asarray(nll_mask)
    return np.full(mask.shape[0], mask.shape[0] / max(float((mask > 0).sum()), 1.0), np.float32)


def nll_terms(batch, nll_sums, nll_tokens):
    """TRL's token-mean NLL as per-pair terms (``losses.common.token_mean_terms``), scaled by the
    whole accumulated batch's pairs / tokens when the batch carries ``nll_scale`` (prepared
    batches always do), else by this batch's own."""
    scale = batch["nll_scale"][0] if "nll_scale" in batch else None
    return token_mean_terms(nll_sums, nll_tokens, scale)


class PairAlgorithm(AlgorithmBase):
    """Trains on chosen / rejected pairs. ``pair_forward``: "shared" (each prompt once where the
    model's rotary layers take positions and the batch allows, ``shared_prompt``; else
    concatenated), "concatenated" and "separate" (benchmark variants)."""

    pair_forward = "shared"
    with_log_sum_sq = False  # WPO's per-token log sum p^2 from the policy forward
    longest_shared = 0  # set by setup: shared_prompt.longest_row of the model (0: never)

    def setup(self, module):
        super().setup(module)
        self.longest_shared = (shared_prompt.longest_row(module)
                               if self.pair_forward == "shared" else 0)

    def prepare(self, batch):
        batch = self.prepare_pairs(batch)
        if self.longest_shared != 0 and "chosen_loss_mask" in batch:
            batch.update(shared_prompt.layout(batch, self.longest_shared) or {})
        return batch

    def prepare_pairs(self, batch):
        """``prepare`` before the shared rows: scored positions, NLL scale."""
        batch = super().prepare(batch)
        if "chosen_loss_mask" in batch:
            batch = dict(batch, nll_scale=nll_scale(self.nll_mask(batch)))
        return batch

    def nll_mask(self, batch):
        """The tokens of the chosen NLL term: the chosen completion (TRL's DPO ``sft`` and CPO)."""
        return batch["chosen_loss_mask"]

    def pair_logps(self, module, batch, with_log_sum_sq=None):
        return pair_logps(module, batch, self.logprob_chunk, self.pair_forward != "separate",
                          self.with_log_sum_sq if with_log_sum_sq is None else with_log_sum_sq)

    def chosen_nll(self, batch, lp):
        """Per-pair terms whose mean is the token-mean NLL of the chosen completions."""
        return nll_terms(batch, -lp["chosen"], lp["chosen_len"])

    def reference_pair(self, module, reference_module, batch):
        """The reference's ``pair_logps`` dict (``chosen`` / ``rejected`` only for precompute)."""
        if self.reference_mode == "precompute":
            return {"chosen": batch["ref_chosen_logps"], "rejected": batch["ref_rejected_logps"]}
        return self.reference(module, reference_module,
                              lambda m: self.pair_logps(m, batch, with_log_sum_sq=False))
