"""The KV-cache sampler: equal to no-cache decoding, log-probs equal to one full forward pass,
truncation, stop tokens, and one compilation per shape."""

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import jax
import jax.numpy as jnp
import keras_hub
import numpy as np
import pytest
from types import SimpleNamespace
from flax import nnx

import support
from nnx_posttrain import model
from nnx_posttrain.errors import ConfigError
from nnx_posttrain.model import attention
from nnx_posttrain.sampling import generate, sampler

N = 8
NO_STOP = np.array([-1, -2], np.int32)  # the shape of the real stop ids: one compilation
PROMPTS = [[2, 5, 6, 7], [2, 9, 10, 11, 12, 13, 14, 15, 16, 17, 3, 4, 5, 6, 7, 8, 9, 10], [2, 40]]


@pytest.fixture(scope="module")
def micro_sampler(micro):
    lm = micro
    graphdef, *states = nnx.split(lm.module)
    return lm, graphdef, states, sampler.make_sampler(graphdef, N)


@pytest.fixture(scope="module")
def reference(micro_sampler):
    """Greedy tokens of PROMPTS by plain no-cache decoding."""
    ids, mask = _batch()
    return argmax_reference(micro_sampler[0].module, ids, mask, N)


def _batch(prompts=PROMPTS, bucket=16):
    # bucket 16: the width ``sampler.sample_ids`` uses, so every test shares one compilation
    return sampler.pad_prompts(prompts, 0, bucket=bucket)


def argmax_reference(module, ids, mask, n):
    """Plain decoding without a cache: the whole left-padded buffer through the model per token
    (one jitted program serves every token of the fixed-width buffer: ``support.jitted``; op by
    op, each operation of a new shape compiles on its own)."""
    batch, width = ids.shape
    tokens = np.concatenate([ids, np.zeros((batch, n), np.int32)], 1)
    masks = np.concatenate([mask, np.zeros((batch, n), np.int32)], 1)
    full_logits = support.jitted(model.full_logits, module)
    for j in range(n):
        logits = full_logits(jnp.asarray(tokens), jnp.asarray(masks))
        tokens[:, width + j] = np.asarray(jnp.argmax(logits[:, width + j - 1], -1))
        masks[:, width + j] = 1
    return tokens[:, width:]


def test_pad_prompts_left_pads_to_a_bucket():
    ids, mask = sampler.pad_prompts([[5, 6, 7], [8]], pad_id=0, bucket=4)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 8]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert sampler.pad_prompts([[1] * 17], 0)[0].shape == (1, 32)


@pytest.mark.slow
def test_greedy_equals_no_cache_argmax_with_different_prompt_lengths(micro_sampler, reference):
    lm, _, states, sample = micro_sampler
    ids, mask = _batch()
    out = sample(states, ids, mask, jax.random.key(0), sampler.Draw(0.0, 1.0, NO_STOP))
    np.testing.assert_array_equal(np.asarray(out["completion_ids"]), reference)
    assert np.asarray(out["completion_mask"]).all() and not np.asarray(out["finished"]).any()


@pytest.mark.slow
def test_greedy_equals_no_cache_argmax_gemma2_sliding_window_soft_caps_and_lora():
    lm = model.load("gemma2_tiny", seed=0)
    model.enable_lora(lm.module, rank=2, targets="attention")
    lora_b = [v for v in lm.module.weights if "lora_kernel_b" in v.path]
    rng = np.random.default_rng(0)
    for v in lora_b:
        v.assign(rng.normal(0, 0.5, v.shape).astype("float32"))
    # a 30-token prompt in a width of 32, then 6 new tokens: the last queries are further than the
    # sliding window (32) from the first prompt tokens
    prompts = PROMPTS + [list(range(2, 32))]
    graphdef, *states = nnx.split(lm.module)
    ids, mask = _batch(prompts, 32)
    sample = sampler.make_sampler(graphdef, 6)
    out = sample(states, ids, mask, jax.random.key(0), sampler.Draw(0.0, 1.0, NO_STOP))
    ref = argmax_reference(lm.module, ids, mask, 6)
    np.testing.assert_array_equal(np.asarray(out["completion_ids"]), ref)
    # the sampler reads the weights from the states it is given, not from the module they were
    # split from (a merged module's ``transformer_layers`` still lists the original blocks)
    other = jax.tree.map(lambda x: x * 1.25, states)
    out = sample(other, ids, mask, jax.random.key(0), sampler.Draw(0.0, 1.0, NO_STOP))
    other_ref = argmax_reference(nnx.merge(graphdef, *other), ids, mask, 6)
    np.testing.assert_array_equal(np.asarray(out["completion_ids"]), other_ref)
    assert not np.array_equal(other_ref, ref)


def _decoding(variant) -> bool:
    from nnx_posttrain import families

    return any(variant in f.tiny and f.decoding for f in families.FAMILIES.values())


@pytest.mark.slow
@pytest.mark.parametrize("family", [v for v in support.TINY_FAMILIES if _decoding(v)])
def test_every_family_decodes_as_a_full_forward_pass(family):
    """The cached decoding (KerasHub's blocks, this package's cache and attention kernel) of every
    family equals plain decoding through KerasHub's own attention: greedy tokens, and sampled
    tokens' log-probs equal to one full forward pass. Left-padded prompts of 4, 18 and 2 tokens
    and 8 new tokens: the last queries are past the sliding windows (8) of Gemma 2 / 3 / 4, Qwen 2
    and Mistral. Gemma 4's variants: per-layer inputs and KV-shared blocks reading an earlier
    block's cache (gemma4), global blocks with their own head dim and one kv head whose keys are
    the values (gemma4_kv, gemma4_moe), experts; Qwen 3.5's Gated DeltaNet block carrying its
    recurrent state from the left-padded prompt. (A family whose ``decoding`` is
    ``Unsupported`` is refused by the sampler: tests/test_families.py.)"""
    bb = support.tiny_backbone(family)
    graphdef, *states = nnx.split(bb)
    ids, mask = _batch([p[:18] for p in PROMPTS], 18)
    sample = sampler.make_sampler(graphdef, N)
    out = sample(states, ids, mask, jax.random.key(0), sampler.Draw(0.0, 1.0, NO_STOP))
    with support.kerashub_as_written():
        np.testing.assert_array_equal(np.asarray(out["completion_ids"]),
                                      argmax_reference(bb, ids, mask, N))
        out = sample(states, ids, mask, jax.random.key(1), sampler.Draw(1.0, 1.0, NO_STOP))
        seq = jnp.concatenate([ids, out["completion_ids"]], 1)
        seq_mask = jnp.concatenate([mask, out["completion_mask"]], 1)
        want = support.jitted(model.token_logprobs, bb)(seq, seq_mask)[:, ids.shape[1]:]
    np.testing.assert_allclose(np.asarray(out["logprobs"]), np.asarray(want), atol=1e-5)


@pytest.mark.slow
def test_prompt_longer_than_one_chunk_takes_the_blocked_path_and_decodes_the_same():
    """The prompt pass attends as the training forward does: past ``chunk`` positions, blocked
    attention (model/flash.py); decoding from its cache gives the tokens of plain decoding."""
    bb = support.tiny_backbone("gemma2")  # soft cap and a sliding window of 8
    model.set_attention(bb, "xla", chunk=8)
    graphdef, *states = nnx.split(bb)
    ids, mask = _batch()  # width 32 > 8
    out = sampler.make_sampler(graphdef, N)(states, ids, mask, jax.random.key(0),
        sampler.Draw(0.0, 1.0, NO_STOP))
    model.set_attention(bb, "keras")
    np.testing.assert_array_equal(np.asarray(out["completion_ids"]),
                                  argmax_reference(bb, ids, mask, N))


@pytest.mark.slow
def test_attention_dropout_does_not_stop_decoding():
    """Dropout is a training-time layer: a model configured with it samples (KerasHub's inference
    path, dropout off), where the training forward keeps KerasHub's attention for it."""
    bb = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=2,
                                        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                                        head_dim=8, dropout=0.1)
    assert isinstance(attention.layer_spec(model.decoder_blocks(bb)[0]), str)
    graphdef, *states = nnx.split(bb)
    ids, mask = _batch()
    out = sampler.make_sampler(graphdef, 4)(states, ids, mask, jax.random.key(0),
        sampler.Draw(0.0, 1.0, NO_STOP))
    np.testing.assert_array_equal(np.asarray(out["completion_ids"]),
                                  argmax_reference(bb, ids, mask, 4))


def test_unsupported_family_is_named():
    bb = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                       intermediate_dim=32, max_sequence_length=32)
    graphdef, *states = nnx.split(bb)
    ids, mask = _batch()
    with pytest.raises(NotImplementedError, match="GPT2Backbone"):
        sampler.make_sampler(graphdef, 2)(states, ids, mask, jax.random.key(0),
                                          sampler.Draw(0.0, 1.0, NO_STOP))


@pytest.mark.slow
def test_logprobs_equal_one_full_forward_pass(micro_sampler):
    lm, _, states, sample = micro_sampler
    ids, mask = _batch()
    out = sample(states, ids, mask, jax.random.key(1), sampler.Draw(1.0, 1.0, NO_STOP))
    seq = jnp.concatenate([ids, out["completion_ids"]], 1)
    seq_mask = jnp.concatenate([mask, out["completion_mask"]], 1)
    ref = model.token_logprobs(lm.module, seq, seq_mask)[:, ids.shape[1]:]
    np.testing.assert_allclose(np.asarray(out["logprobs"]), np.asarray(ref), atol=1e-4)
    greedy = sample(states, ids, mask, jax.random.key(1), sampler.Draw(0.0, 1.0, NO_STOP))
    assert not np.array_equal(np.asarray(out["completion_ids"]), np.asarray(greedy["completion_ids"]))

    out = sample(states, ids, mask, jax.random.key(2), sampler.Draw(0.7, 1.0, NO_STOP))
    seq = jnp.concatenate([ids, out["completion_ids"]], 1)
    seq_mask = jnp.concatenate([mask, out["completion_mask"]], 1)
    logits = model.full_logits(lm.module, seq, seq_mask)[:, ids.shape[1] - 1:-1]
    want = jnp.take_along_axis(jax.nn.log_softmax(logits / 0.7, -1), out["completion_ids"][..., None], -1)
    np.testing.assert_allclose(np.asarray(out["logprobs"]), np.asarray(want[..., 0]), atol=1e-4)
    # compiled once: temperature, top_p, rng and their Python / NumPy types do not recompile
    sample(states, ids, mask, jax.random.key(3), sampler.Draw(np.float32(0.5), 0.9, NO_STOP))
    assert sample._cache_size() == 1


@pytest.mark.slow
def test_top_k_one_and_tiny_top_p_are_greedy(micro_sampler):
    lm, graphdef, states, sample = micro_sampler
    ids, mask = _batch()
    greedy_out = sample(states, ids, mask, jax.random.key(0), sampler.Draw(0.0, 1.0, NO_STOP))
    greedy = np.asarray(greedy_out["completion_ids"])
    top1 = sampler.make_sampler(graphdef, N, top_k=1)(states, ids, mask, jax.random.key(4),
        sampler.Draw(1.0, 1.0, NO_STOP))
    np.testing.assert_array_equal(np.asarray(top1["completion_ids"]), greedy)
    nucleus = sample(states, ids, mask, jax.random.key(5), sampler.Draw(1.0, 1e-6, NO_STOP))
    np.testing.assert_array_equal(np.asarray(nucleus["completion_ids"]), greedy)
    # log-probs stay those of the untruncated distribution (greedy reports temperature 1's)
    np.testing.assert_allclose(np.asarray(nucleus["logprobs"]), np.asarray(greedy_out["logprobs"]),
                               atol=1e-6)
    assert float(jnp.max(nucleus["logprobs"])) < 0


@pytest.mark.slow
def test_sampled_frequencies_follow_the_model_distribution(micro_sampler):
    lm, graphdef, states, _ = micro_sampler
    draws = 3000
    ids, mask = _batch([[2, 9, 10, 11]] * draws)
    probs = np.asarray(jax.nn.softmax(model.full_logits(lm.module, ids[:1], mask[:1])[0, -1]))
    sample = sampler.make_sampler(graphdef, 1)

    def chi_square(temperature):
        out = sample(states, ids, mask, jax.random.key(7), sampler.Draw(temperature, 1.0, NO_STOP))
        counts = np.bincount(np.asarray(out["completion_ids"])[:, 0], minlength=probs.size)
        expected = draws * probs
        return float(np.sum((counts - expected) ** 2 / expected)), probs.size - 1

    stat, dof = chi_square(1.0)
    assert stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)
    wrong, _ = chi_square(0.5)  # the test has the power to see a wrong temperature
    assert wrong > dof + 6 * np.sqrt(2 * dof), (wrong, dof)


@pytest.mark.slow
def test_inverse_cdf_draws_follow_the_distribution_and_never_pick_masked_ids():
    """``_categorical`` (one uniform per row): frequencies of a known distribution with masked ids
    first, between and last; masked ids are never drawn, even when u is at the top of the CDF."""
    logits = jnp.log(jnp.asarray([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]))  # log 0 = -inf
    draws = 20000
    tokens = jax.jit(sampler._categorical)(jax.random.key(0), jnp.broadcast_to(logits, (draws, 6)))
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0, counts
    np.testing.assert_allclose(counts[[1, 3, 4]] / draws, [0.5, 0.2, 0.3], atol=0.015)
    # u at the very top of the CDF (rounding): the last id of positive probability
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.random, "uniform", lambda rng, shape, dtype: jnp.ones(shape, dtype))
        assert int(sampler._categorical(jax.random.key(0), logits[None])[0]) == 4


@pytest.mark.slow
def test_inverse_cdf_draws_across_blocks_of_the_vocabulary():
    """Over more ids than one block (``CDF_BLOCK``, the last block padded): the mass of ids in
    three blocks, with a block of zeros between, drawn in proportion; nothing else is drawn, and u
    at the top falls to the last id of positive probability."""
    probs = np.zeros(2 * sampler.CDF_BLOCK + 500)
    probs[[5, 2 * sampler.CDF_BLOCK + 1, 2 * sampler.CDF_BLOCK + 400]] = [0.25, 0.5, 0.25]
    probs[7] = 1e-9  # tiny but drawable: not a masked id
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    draws = 10000
    tokens = np.asarray(jax.jit(sampler._categorical)(
        jax.random.key(1), jnp.broadcast_to(logits, (draws, probs.size))))
    ids, counts = np.unique(tokens, return_counts=True)
    assert set(ids) <= {5, 7, 2 * sampler.CDF_BLOCK + 1, 2 * sampler.CDF_BLOCK + 400}, ids
    np.testing.assert_allclose([np.mean(tokens == i) for i in (5, 2 * sampler.CDF_BLOCK + 1)],
                               [0.25, 0.5], atol=0.02)  # 4 standard errors
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.random, "uniform", lambda rng, shape, dtype: jnp.ones(shape, dtype))
        assert int(sampler._categorical(jax.random.key(0), logits[None])[0]) == (
            2 * sampler.CDF_BLOCK + 400)


def test_stop_tokens_rows_stop_independently(micro_sampler):
    lm, _, states, sample = micro_sampler
    ids, mask = _batch()
    free = np.asarray(sample(states, ids, mask, jax.random.key(0),
                             sampler.Draw(0.0, 1.0, NO_STOP))["completion_ids"])
    stop = int(free[0, 2])
    out = sample(states, ids, mask, jax.random.key(0),
                 sampler.Draw(0.0, 1.0, np.array([stop, -5], np.int32)))
    got_ids, got_mask = np.asarray(out["completion_ids"]), np.asarray(out["completion_mask"])
    got_lp = np.asarray(out["logprobs"])
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(free[row] == stop)
        end = hits[0] + 1 if hits.size else N
        assert bool(out["finished"][row]) == bool(hits.size)
        np.testing.assert_array_equal(got_mask[row], np.arange(N) < end)  # includes the stop token
        np.testing.assert_array_equal(got_ids[row, :end], free[row, :end])
        assert (got_ids[row, end:] == 0).all() and (got_lp[row, end:] == 0).all()
        assert (got_lp[row, :end] < 0).all()
    assert out["finished"][0]


@pytest.mark.slow
def test_greedy_complete_uses_the_sampler(micro_sampler, reference):
    lm, _, states, sample = micro_sampler
    texts = generate.greedy_complete(lm, sample, states, PROMPTS, N)
    stops = set(generate.stop_ids(lm))
    assert texts == [lm.tokenizer.decode([int(t) for t in _until_stop(r, stops)]) for r in reference]
    events = []

    def heard(event, duration, **_):
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:  # a second call neither traces nor compiles: the sampler's compilation is kept
        assert generate.greedy_complete(lm, sample, states, PROMPTS, N) == texts
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    assert not [e for e in events if e.startswith("/jax/core/compile/")], events


def _until_stop(row, stops):
    out = []
    for t in row:
        if int(t) in stops:
            break
        out.append(t)
    return out


@pytest.mark.slow
def test_the_sample_command_samples_with_options(micro_sampler, monkeypatch, capsys):
    from nnx_posttrain import cli
    from nnx_posttrain.cli import sample as sample_command

    lm = micro_sampler[0]
    monkeypatch.setattr(sample_command.runs, "check_policy", lambda run_dir: None)
    monkeypatch.setattr(sample_command.runs, "load", lambda run_dir, step: SimpleNamespace(
        lm=lm, module=lm.module, policy=lambda: lm.module))
    argv = ["sample", "RUN", "--prompt", "What is 1 + 2?", "--prompt", "Hi", "--max-new-tokens",
            "4", "--temperature", "0.9", "--top-k", "5", "--top-p", "0.9", "--seed", "3",
            "--num-samples", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    answers = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    assert len(answers) == 4 and out.count("> ") == 2 and out.count("[2] ") == 2
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == out  # same seed, same samples


def test_generation_past_the_context_or_the_memory_is_refused_with_the_limit(micro_sampler,
                                                                             monkeypatch, capsys):
    from nnx_posttrain import errors
    from nnx_posttrain.cli import sample as sample_command
    from nnx_posttrain.model import device_memory

    lm = micro_sampler[0]
    monkeypatch.setattr(sample_command.runs, "check_policy", lambda run_dir: None)
    monkeypatch.setattr(sample_command.runs, "load", lambda run_dir, step: SimpleNamespace(
        lm=lm, module=lm.module, policy=lambda: lm.module))
    prompt = len(sampler.chat_prompt(lm, "Hi"))
    support.cli_error(capsys, ["sample", "RUN", "--prompt", "Hi", "--max-new-tokens", "100000000"],
                      match=rf"max_new_tokens 100,000,000: a prompt of up to {prompt} "
                            rf"tokens .* past the 8,192 of GemmaBackbone's context "
                            rf".*at most {8192 - prompt:,} new tokens")
    free = sampler.generation_bytes(lm.module, 1, prompt, 1000)
    monkeypatch.setattr(device_memory, "available_bytes", lambda: free)
    with pytest.raises(errors.ConfigError, match=r"max_new_tokens 4,000: decoding 1 sequences") as info:
        sampler.sample_texts(lm, lm.module, ["Hi"], sampler.Sampling(4000))
    fits = int(str(info.value).rsplit("at most ~", 1)[1].split()[0].replace(",", ""))
    assert sampler.generation_bytes(lm.module, 1, prompt, fits) <= free
    assert sampler.generation_bytes(lm.module, 1, prompt, fits + 1) > free
    assert sampler.sample_texts(lm, lm.module, ["Hi"], sampler.Sampling(fits // 2))  # what fits runs


def test_eval_and_rollout_lengths_are_bounded_by_the_context(tmp_path):
    msg = support.refusal("sft", *support.MICRO, "--run-dir", tmp_path / "a", "--steps", "1",
                          "--eval.max-new-tokens", "9000", error=ConfigError)
    assert msg.startswith("--eval.max-new-tokens 9,000: a prompt of up to ")
    msg = support.refusal("grpo", *support.MICRO, "--run-dir", tmp_path / "b", "--init-from", "",
                          "--algo.max-completion-length", "9000", error=ConfigError)
    assert msg.startswith("--algo.max-completion-length 9,000: a prompt of up to 24 tokens")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_the_tpu_tiers_checks_run_on_this_cpu(tmp_path):
    """tests/tpu_checks.py (the TPU tier's chip-side script, run nowhere else) calls the
    library as it is today: its sampler and bfloat16 checks, in process, on the CPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tpu_checks", support.ROOT / "tests" / "tpu_checks.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    tokens = checks.sampler()["tokens"]
    assert np.asarray(tokens).shape == (4, 16)
    losses = checks.bf16_step()["losses"]
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.05 * losses["float32"]
