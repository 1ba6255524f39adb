"""A preference pair's prompt through the model once: ``[prompt | chosen | rejected]`` in one row.

The concatenated forward (``pairs.pair_logps``) runs ``2 x batch`` rows of ``[prompt | answer]``,
so every prompt token goes through every layer twice. Here each pair is one row holding the prompt
once and both completions after it; the attention keeps the branches apart (segment ids
``flash.BRANCH``: a completion token sees the prompt and its own completion, never the other one)
and the rotary positions of the rejected completion continue the prompt (``rope_positions``), so
every token sees exactly the context it has in its own row: the log-probs equal the concatenated
forward's (float32 rounding aside; a test checks 1e-5 per family). The prompt's share of the
tokens is what it saves: a pair of prompt P and answers A, B costs P + A + B tokens instead of
2P + A + B (the benchmark's 64 + 64 + 64: 25% fewer).

``layout`` (host side, numpy, in ``prepare``) builds the row and the gather of each side's scored
positions; ``pair_logps`` (device) reads it. A batch whose rows are not right-padded, or where
sharing would not save ``MIN_SAVING`` of the tokens, keeps the concatenated forward.
"""

from __future__ import annotations

import numpy as np

from nnx_posttrain import model
from nnx_posttrain.model.attention import layer_spec
from nnx_posttrain.model.flash import BRANCH

MIN_SAVING = 0.15  # share the prompt when the shared rows are at most 85% of the concatenated
KEYS = ("shared_input_ids", "shared_segment_ids", "shared_rope_positions",
        "chosen_gather", "rejected_gather")


def longest_row(module) -> int | None:
    """The longest shared row ``module`` can take: 0 when it cannot (its rotary layers take no
    positions, or an attention layer is not one ``model.attention`` knows), the shortest sliding
    window (a window counts positions in the row, and the rejected completion sits further from
    the prompt there than in its own row: rows within the window are never cut either way), else
    None (any). A vision backbone takes none: its image tokens attend both ways, which the
    shared row's mask does not keep; nor a backbone with recurrent blocks (Qwen 3.5's Gated
    DeltaNet): their state would carry the chosen completion into the rejected one."""
    if not model.takes_positions(module) or model.reads_images(module):
        return 0
    specs = [layer_spec(block) for block in model.decoder_blocks(module)]
    if any(spec is None or isinstance(spec, str) for spec in specs):
        return 0
    windows = [spec.window for spec in specs if spec.window]
    return min(windows) if windows else None


def _right_padded(attention: np.ndarray) -> tuple[np.ndarray, bool]:
    """(tokens per row, whether every row is its tokens then padding)."""
    lengths = attention.sum(axis=1)
    return lengths, bool((attention == (np.arange(attention.shape[1]) < lengths[:, None])).all())


def _prompt_lengths(batch: dict, n_c, n_r) -> np.ndarray:
    """Per pair: the tokens both rows begin with, up to the first one that carries loss."""
    ids_c, ids_r = batch["chosen_input_ids"], batch["rejected_input_ids"]
    t = ids_c.shape[1]
    first_loss = lambda m: np.where(m.any(axis=1), (m > 0).argmax(axis=1), t)  # noqa: E731
    differ = (ids_c != ids_r) | (np.arange(t) >= np.minimum(n_c, n_r)[:, None])
    common = np.where(differ.any(axis=1), differ.argmax(axis=1), t)
    return np.minimum.reduce([common, first_loss(batch["chosen_loss_mask"]),
                              first_loss(batch["rejected_loss_mask"])])


def layout(batch: dict, longest: int | None = None, granule: int | None = None) -> dict | None:
    """Host side: the shared rows of a prepared pair batch (``KEYS``), or None where they do not
    apply, would not pay or would be longer than ``longest``. Rows are padded to a multiple of
    ``granule`` (default: a quarter of the pair rows' length), so that few shapes compile. Each
    side's gather is [batch, 3, k]: the hidden state that predicts, the token predicted (indices
    into the shared row) and the position of that token in the side's own row (``*_positions``
    when the batch has them, else every position; out of range: padding)."""
    att_c, att_r = batch["chosen_attention_mask"], batch["rejected_attention_mask"]
    (n_c, ok_c), (n_r, ok_r) = _right_padded(att_c), _right_padded(att_r)
    if not (ok_c and ok_r) or att_c.shape != att_r.shape:
        return None
    b, t = att_c.shape
    p = _prompt_lengths(batch, n_c, n_r)
    granule = granule or max(1, t // 4)
    need = int((n_c + n_r - p).max())
    length = -(-max(need, 1) // granule) * granule
    if length > (1 - MIN_SAVING) * 2 * t or (longest is not None and length > longest):
        return None
    col = np.arange(length)[None]
    in_r = (col >= n_c[:, None]) & (col < (n_c + n_r - p)[:, None])  # the rejected completion
    r_src = np.clip(col - n_c[:, None] + p[:, None], 0, t - 1)  # its index in the rejected row
    ids = np.where(col < n_c[:, None], np.take_along_axis(batch["chosen_input_ids"],
                                                          np.minimum(col, t - 1), axis=1), 0)
    ids = np.where(in_r, np.take_along_axis(batch["rejected_input_ids"], r_src, axis=1), ids)
    seg = np.where(col < p[:, None], 1, np.where(col < n_c[:, None], 1 + BRANCH, 0))
    seg = np.where(in_r, 1 + 2 * BRANCH, seg)
    rope = np.where(in_r, r_src, np.where(col < n_c[:, None], col, 0))
    out = {"shared_input_ids": ids.astype(batch["chosen_input_ids"].dtype),
           "shared_segment_ids": seg.astype(np.int32),
           "shared_rope_positions": rope.astype(np.int32)}
    for name, rejected in (("chosen", False), ("rejected", True)):
        places = batch.get(f"{name}_positions")
        if places is None:
            places = np.broadcast_to(np.arange(t), (b, t))
        places = np.where(places >= 1, places, t)  # position 0 has no prediction
        valid = places < np.where(rejected, n_r, n_c)[:, None]
        target = places
        if rejected:  # past the prompt, the rejected tokens follow the chosen row's
            target = np.where(places >= p[:, None], places - p[:, None] + n_c[:, None], places)
        source = target - 1
        if rejected:  # its first token is predicted from the prompt's last one
            source = np.where(places == p[:, None], p[:, None] - 1, source)
        gather = np.stack([np.where(valid, source, 0), np.where(valid, target, 0),
                           np.where(valid, places, t)], axis=1)
        out[f"{name}_gather"] = gather.astype(np.int32)
    return out


def pair_logps(module, batch, chunk, with_log_sum_sq: bool):
    """Per side, as ``pairs._side_logps`` returns them, from one forward of the shared rows."""
    ids = batch["shared_input_ids"]
    h = model.hidden_states(module, ids, None, batch["shared_segment_ids"],
                            rope_positions=batch["shared_rope_positions"])
    out = {}
    for name in ("chosen", "rejected"):
        g = batch[f"{name}_gather"]
        length = batch[f"{name}_input_ids"].shape[1]
        res = model.logprobs_from_hidden(module, h, ids,
                                         model.Projection(chunk, log_sum_sq=with_log_sum_sq),
                                         gather=(g[:, 0], g[:, 1], g[:, 2], length))
        token, lss = res if with_log_sum_sq else (res, None)
        out[name] = (token, lss)
    return out
