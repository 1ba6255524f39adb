"""The newer families on micro presets (a KerasHub preset directory of each family's tiny
configuration with a synthetic tokenizer of the family's kind, as ``tools.make_preset`` writes
them): loaded through ``model.load`` (the family's chat format, the backbone's extra inputs), a
few SFT and DPO steps with LoRA, ``--quantize int8``. Attention and projections against
KerasHub's own layers are tests/test_attention.py and tests/test_dense.py (every family's tiny
configuration), export against transformers tests/test_hf_export.py, chat templates
tests/test_chat.py."""

import re

import numpy as np
import pytest

import jax.numpy as jnp
import keras

from nnx_posttrain import families, model
from support import builtin_file, jitted, losses, records, train_run
from tools import make_preset

TOKENS = 1024
# two steps on 8 records of the built-in task (``data_files``): no eval data, so no evaluation
# (the built-in data's 8,100 records validated through each family's Python BPE tokenizer, and
# its 500 held-out records evaluated at the start and the end, were most of a run's time and
# asserted nowhere)
STEPS = ["--steps", "2", "--log-every", "1", "--eval.every", "0", "--checkpoint.every", "0",
         "--batching.batch-size", "2", "--batching.max-length", "48", "--eval.exact-match", "0"]
# SFT and DPO as the built-in recipes run them (a data file gets a user's defaults)
RECIPE = ["--remat", "none", "--batching.grad-accum", "1"]
# the micro preset of each family: a tiny variant (``Family.tiny``), shallower (fewer layers to
# compile), with the synthetic tokenizer's size
MICRO = {"gemma4": ("gemma4", dict(num_layers=3, num_kv_shared_layers=1)), "phi3": ("phi3", {}),
         "qwen3_moe": ("qwen3_moe", {}), "mixtral": ("mixtral", {}), "smollm3": ("smollm3", {}),
         "qwen3_5": ("qwen3_5", {}), "qwen3_5_moe": ("qwen3_5_moe", {}), "gpt_oss": ("gpt_oss", {}),
         "gemma4_moe": ("gemma4_moe", {})}  # keys: variants (Gemma 4's dense and 26B-A4B-like)


# harmony's system turn (model identity, dates, reasoning level, channels) takes ~200 tokens of
# the synthetic byte-level tokenizer before a built-in conversation's first word
LENGTH = {"gpt_oss": ["--batching.max-length", "256"]}


def _micro_preset(name: str, tmp_path_factory):
    variant, shallower = MICRO[name]
    family = next(f for f in families.FAMILIES.values() if variant in f.tiny)
    dims = dict(family.tiny[variant], **shallower, vocabulary_size=TOKENS)
    out = tmp_path_factory.mktemp(name)
    keras.utils.set_random_seed(0)
    make_preset._task(family.name, dims, TOKENS, "float32").save_to_preset(str(out))
    return family, out


@pytest.fixture(scope="module", params=sorted(MICRO))
def preset(request, tmp_path_factory):
    return _micro_preset(request.param, tmp_path_factory)


# DPO on each kind of block: Qwen 3.5 MoE's are Qwen 3.5's (its own case) and an MoE block
# (Qwen3-MoE's, Mixtral's)
@pytest.fixture(scope="module", params=sorted(set(MICRO) - {"qwen3_5_moe"}))
def dpo_preset(request, tmp_path_factory):
    return _micro_preset(request.param, tmp_path_factory)


@pytest.mark.slow
def test_a_micro_preset_loads_with_its_familys_chat_format(preset):
    family, path = preset
    lm = model.load(str(path))
    assert families.of(lm.module) is family and lm.chat_format == family.format_of(lm.module)
    assert lm.tokenizer.vocab_size == TOKENS
    ids = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) + 5)
    logits = jitted(model.full_logits, lm.module)(ids, jnp.ones_like(ids))
    assert logits.shape == (2, 6, TOKENS) and bool(jnp.isfinite(logits).all())


LORA = ["--lora.rank", "2", "--lora.targets", "all-linear", "--optim.learning-rate", "1e-2"]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """{algorithm: a file of the built-in task's first 8 training records in its format}."""
    out = tmp_path_factory.mktemp("data")
    return {algorithm: builtin_file(out / f"{algorithm}.jsonl", builtin)
            for algorithm, builtin in (("sft", "sft"), ("dpo", "preference"),
                                       ("grpo", "prompt_only"))}


@pytest.mark.slow
def test_sft_steps(preset, data_files, tmp_path):
    family, path = preset
    train_run("sft", "--model", path, "--data", data_files["sft"], *STEPS, *RECIPE,
              *LENGTH.get(family.name, []), "--run-dir", tmp_path, echo=_quiet)
    sft = losses(tmp_path)
    assert sorted(sft) == [1, 2] and all(np.isfinite(list(sft.values())))
    if family.moe is not None and family.name != "gemma4":  # the router's load-balancing loss
        assert all(r["aux_loss"] > 1.0 for r in records(tmp_path))  # top_k 2 when balanced


@pytest.mark.slow
def test_dpo_steps_with_lora(dpo_preset, data_files, tmp_path):
    family, path = dpo_preset
    train_run("dpo", "--model", path, "--data", data_files["dpo"], *STEPS, *RECIPE,
              *LENGTH.get(family.name, []), *LORA, "--run-dir", tmp_path, echo=_quiet)
    first = records(tmp_path)[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-3)  # policy = reference at step 1


@pytest.mark.slow
def test_grpo_steps_with_lora(preset, data_files, tmp_path):
    """Rollouts through the KV-cache sampler, then the GRPO step; a family the sampler does not
    drive is refused with the reason."""
    family, path = preset
    args = ["grpo", "--model", path, *STEPS, *LORA, "--init-from", "", "--data", data_files["grpo"],
            "--batching.batch-size", "4", "--algo.num-generations", "2",
            "--algo.max-completion-length", "4", "--algo.rewards", "exact_match",
            "--run-dir", tmp_path / "run"]
    if not family.decoding:
        with pytest.raises(NotImplementedError, match=re.escape(family.decoding.reason)):
            train_run(*args, echo=_quiet)
        return
    train_run(*args, echo=_quiet)
    rows = records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    # TRL's GRPOTrainer adds the router load-balancing loss too (Gemma 4's micro preset is the
    # dense E2B-like variant: per-layer inputs and KV-shared blocks through the sampler)
    if family.moe is not None and family.name != "gemma4":
        assert all(r["aux_loss"] > 1.0 for r in rows)


@pytest.mark.slow
def test_int8_keeps_the_layers_the_family_reads_as_arrays(preset, monkeypatch):
    """int8 (Phi-3 and the MoE families: their untied output embedding too) computes as the model
    up to int8 rounding (random hidden-32 weights: ~10% of the logits' range). Gemma 4's blocks
    multiply the MLP kernels as arrays: int8 leaves them in float (``Family.quantize_skip``);
    quantized, they would be read without their scale. A mixture of experts keeps its routers in
    float (rounding them flips experts; on tiny random models a flip moves the logits by tens of
    percent either way, so only the routers are checked there: research 7.1)."""
    import sys

    quantize = sys.modules["nnx_posttrain.model.quantize"]
    family, path = preset
    ids = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) + 5)

    def change(skip):  # each forward one jitted program, not an operation at a time
        lm = model.load(str(path))
        before = np.asarray(jitted(model.full_logits, lm.module)(ids, jnp.ones_like(ids)))
        monkeypatch.setattr(quantize, "skipped", lambda _: skip)
        assert model.quantize(lm.module, "int8") > 0
        names = {layer.name for layer in model.quantized_layers(lm.module)}
        assert not names & set(skip)
        after = np.asarray(jitted(model.full_logits, lm.module)(ids, jnp.ones_like(ids)))
        return np.abs(after - before).max() / np.abs(before).max()

    if family.moe is not None and family.moe.experts(model.load(str(path)).module):
        change(family.quantize_skip)  # the routers stay float (checked inside)
        return
    assert change(family.quantize_skip) < 0.2
    if family.quantize_skip:
        assert change(()) > 2 * 0.2


@pytest.mark.slow
def test_the_plans_int8_estimate_counts_what_int8_converts(preset):
    """``plan``'s estimate of ``--quantize int8`` halves the share of the frozen base that int8
    turns to 8 bits (``quantize.quantized_share``), not the whole base: Gemma 4 keeps its MLP."""
    import sys

    quantize = sys.modules["nnx_posttrain.model.quantize"]
    family, path = preset
    module = model.load(str(path)).module
    share = quantize.quantized_share(module)
    every = sum(int(np.prod(v.shape)) for v in module.weights)
    model.quantize(module, "int8")
    converted = sum(int(np.prod(v.shape)) for v in module.weights if str(v.dtype) == "int8")
    assert share == pytest.approx(converted / every) and 0 < share <= 1
    if family.name == "gemma4":  # its MLP (and 26B-A4B's experts) stay 16-bit
        assert share < 0.9


def _quiet(*_):
    pass


NEW_LIKES = [like for like, (family, _) in families.presets().items()
             if family.name in ("gemma4", "qwen3_moe", "mixtral", "phi3", "smollm3", "qwen3_5",
                                "qwen3_5_moe", "gpt_oss")]


@pytest.mark.slow
@pytest.mark.parametrize("like", NEW_LIKES)
def test_make_preset_like_a_newer_family(like, tmp_path):
    """``tools.make_preset --like`` writes the family's preset (config only, scaled to 2%: the
    real vocabulary and heads) with a tokenizer of its kind and size."""
    import json

    family, preset = families.presets()[like]
    built = make_preset.build(like, tmp_path, scale=0.02, config_only=True, echo=_quiet)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["class_name"] == family.backbone
    assert config["config"]["vocabulary_size"] == preset.dims["vocabulary_size"]
    assert built.dims["num_layers"] < preset.dims["num_layers"]
    # and it loads as `nnx-posttrain plan` loads it: abstractly, no weight file (a Gemma 4
    # preset without task.json asked for an audio converter's file)
    from flax import nnx
    from nnx_posttrain import model

    lm = nnx.eval_shape(lambda: model.load(str(tmp_path), "bfloat16", weights=False).module)
    assert type(lm).__name__ == family.backbone
