"""Each preference pair's prompt through the model once (algorithms/shared_prompt.py): the
log-probs, losses and gradients equal the concatenated forward's, per family and attention path,
on ragged right-padded pairs; batches it cannot take keep the concatenated forward."""

import keras_hub
import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp

import support
from nnx_posttrain import model
from nnx_posttrain.algorithms import shared_prompt
from nnx_posttrain.algorithms.preference import CPOConfig, ORPOConfig, SimPOConfig
from nnx_posttrain.algorithms.preference import CPO, ORPO, SimPO
from nnx_posttrain.model import attention
from tools.bench.check_gpu import ragged_pairs

SEQ, PROMPT = 24, 10
SIDES = ("chosen", "rejected")


def _pairs(seq=SEQ, prompt=PROMPT, left_padded=False):
    """Two pairs of ragged, right-padded rows (row 0: the chosen answer shorter; row 1: the
    rejected one, and a shorter prompt), loss on the answers."""
    batch = ragged_pairs(seq, [prompt, prompt - 3], {"chosen": [seq - 5, seq],
                                                     "rejected": [seq, seq - 7]})
    if left_padded:
        for k in batch:
            batch[k] = np.roll(batch[k], 3, axis=1)
    return batch


def _both(algorithm, batch):
    """(the prepared batch with shared rows, the same without them)."""
    prepared = algorithm.prepare(dict(batch))
    assert "shared_input_ids" in prepared
    return prepared, {k: v for k, v in prepared.items()
                      if k not in shared_prompt.KEYS}


def _logps(algorithm, module, batch):
    # one jitted program (op by op, each operation of a new shape compiles on its own)
    out = support.jitted(algorithm.pair_logps, module)(jax.tree.map(jnp.asarray, batch))
    return {k: np.asarray(v) * (np.asarray(out[k.replace("tokens", "mask")]) if "tokens" in k else 1)
            for k, v in out.items() if not k.endswith("_mask")}


def _assert_same_logps(algorithm, module, batch, atol=1e-5):
    shared, concatenated = _both(algorithm, batch)
    want, got = _logps(algorithm, module, concatenated), _logps(algorithm, module, shared)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=atol, rtol=atol, err_msg=k)
    assert shared["shared_input_ids"].shape[1] < 2 * SEQ


def _windowless(family):
    """The family's tiny backbone; the windowed ones with a window no row here reaches."""
    if family == "gemma2":  # soft caps, grouped heads, local layers
        keras_hub_kwargs = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, hidden_dim=32,
                                intermediate_dim=48, head_dim=8, num_key_value_heads=2,
                                query_head_dim_normalize=False, use_post_ffw_norm=True,
                                use_post_attention_norm=True, attention_logit_soft_cap=5.0,
                                final_logit_soft_cap=30.0, use_sliding_window_attention=True,
                                sliding_window_size=64, dtype="float32")
        return keras_hub.models.GemmaBackbone(**keras_hub_kwargs)
    return support.tiny_backbone(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma", "gemma2", "llama3", "qwen3"])
def test_shared_rows_give_the_concatenated_log_probs(family):
    bb = _windowless(family)
    model.set_attention(bb, "xla", platform="cpu")
    algorithm = SimPO(SimPOConfig())
    algorithm.setup(bb)
    _assert_same_logps(algorithm, bb, _pairs())


@pytest.mark.slow
@pytest.mark.parametrize("path", ["keras", "blocked"])
def test_shared_rows_on_kerashub_attention_and_the_blocked_path(path):
    """KerasHub's own attention (the mask materialised from the segment ids) and the blocked
    ``xla`` path (tiles of 8: branches and prompt in different tiles) give the same."""
    bb = support.tiny_backbone("gemma")
    model.set_attention(bb, "keras" if path == "keras" else "xla", platform="cpu")
    if path == "blocked":
        object.__setattr__(bb, attention._ATTRIBUTE, attention.Choice("xla", chunk=8))
    algorithm = SimPO(SimPOConfig())
    algorithm.setup(bb)
    _assert_same_logps(algorithm, bb, _pairs())


@pytest.mark.slow
def test_training_gradients_equal_the_concatenated_forward():
    """The loss a step differentiates, and its gradient, for CPO (NLL term on the chosen)."""
    bb = support.tiny_backbone("gemma")
    model.set_attention(bb, "xla", platform="cpu")
    algorithm = CPO(CPOConfig())
    algorithm.setup(bb)
    shared, concatenated = _both(algorithm, _pairs())
    graphdef, params, rest = model.split(bb)

    def loss(params, batch):
        out = algorithm.loss(nnx.merge(graphdef, params, rest), batch)
        return out[0] if isinstance(out, tuple) else out

    step = jax.jit(jax.value_and_grad(loss))  # as a step runs it: one program, not op by op
    results = [step(params, jax.tree.map(jnp.asarray, b)) for b in (concatenated, shared)]
    (want, want_grad), (got, got_grad) = results
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_orpo_nll_over_the_prompt_reads_the_shared_prompt():
    """ORPO's chosen NLL covers the prompt tokens too: they come from the shared prompt."""
    bb = support.tiny_backbone("gemma")
    model.set_attention(bb, "xla", platform="cpu")
    algorithm = ORPO(ORPOConfig(nll_tokens="prompt_and_completion"))
    algorithm.setup(bb)
    shared, concatenated = _both(algorithm, _pairs())
    loss = support.jitted(algorithm.loss, bb)
    losses = [loss(jax.tree.map(jnp.asarray, b)) for b in (concatenated, shared)]
    want, got = (float(out[0] if isinstance(out, tuple) else out) for out in losses)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_batches_it_cannot_take_keep_the_concatenated_forward():
    batch = _pairs()
    assert shared_prompt.layout(batch) is not None
    assert shared_prompt.layout(_pairs(left_padded=True)) is None  # not right-padded
    assert shared_prompt.layout(_pairs(prompt=4)) is None  # saves less than MIN_SAVING
    assert shared_prompt.layout(batch, longest=16) is None  # longer than a sliding window
    different = dict(batch, rejected_input_ids=batch["rejected_input_ids"].copy())
    different["rejected_input_ids"][:, 1] += 1  # no common prompt
    assert shared_prompt.layout(different) is None


def test_a_batch_it_cannot_take_runs_both_rows_in_one_forward(monkeypatch):
    """The fallback is the concatenated forward (one pass over 2 x batch rows), not two."""
    from nnx_posttrain.algorithms import pairs

    bb = support.tiny_backbone("gemma")
    algorithm = SimPO(SimPOConfig())
    algorithm.setup(bb)
    batch = algorithm.prepare(_pairs(left_padded=True))
    assert "shared_input_ids" not in batch
    forwards, side_logps = [], pairs._side_logps
    monkeypatch.setattr(pairs, "_side_logps", lambda module, rows, *a: (
        forwards.append(rows["input_ids"].shape) or side_logps(module, rows, *a)))
    algorithm.pair_logps(bb, jax.tree.map(jnp.asarray, batch))
    assert forwards == [(4, SEQ)]


@pytest.mark.parametrize("family", ["gemma2", "mistral", "qwen2"])
def test_a_sliding_window_bounds_the_shared_row(family):
    """A window counts positions in the row: rows longer than the shortest window are not shared
    (the tiny families' windows are 8 positions)."""
    bb = support.tiny_backbone(family)
    algorithm = SimPO(SimPOConfig())
    algorithm.setup(bb)
    assert algorithm.longest_shared == 8
    assert "shared_input_ids" not in algorithm.prepare(_pairs())


def test_the_layout_places_each_token_where_its_own_row_has_it():
    batch = _pairs()
    rows = shared_prompt.layout(batch)
    ids, seg, rope = (rows[f"shared_{k}"] for k in ("input_ids", "segment_ids", "rope_positions"))
    for side, branch in zip(SIDES, (1, 2)):
        source, target, place = rows[f"{side}_gather"].transpose(1, 0, 2)
        for r in range(2):
            real = place[r] < SEQ
            # the token predicted is the side's own token at that position, at its own position
            np.testing.assert_array_equal(ids[r, target[r, real]],
                                          batch[f"{side}_input_ids"][r, place[r, real]])
            np.testing.assert_array_equal(rope[r, target[r, real]], place[r, real])
            # and it is predicted from the token before it in its own row
            np.testing.assert_array_equal(rope[r, source[r, real]], place[r, real] - 1)
            answer = target[r, real][batch[f"{side}_loss_mask"][r, place[r, real]] > 0]
            assert (seg[r, answer] == 1 + branch * shared_prompt.BRANCH).all()
