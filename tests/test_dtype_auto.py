"""--dtype auto (the default): a checkpoint trains in the dtype it was written in, as TRL's
dtype="auto" loads it; LoRA factors keep float32 master weights over a bfloat16 base."""

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import json

import jax
import numpy as np
import pytest

from nnx_posttrain import config as config_lib, model, runs
from support import records, train_run
from tools import make_preset


@pytest.fixture(scope="module")
def bf16_preset(tmp_path_factory):
    """A gemma_2b-shaped preset written in bfloat16, at 2% scale (256,000 tokens)."""
    out = tmp_path_factory.mktemp("preset") / "g"
    make_preset.build("gemma_2b", out, scale=0.02, echo=lambda _: None)
    return str(out)


def test_the_checkpoints_dtype_is_read_before_it_loads(tmp_path):
    bf16_preset = tmp_path / "keras"  # what save_to_preset writes of a bfloat16 backbone
    bf16_preset.mkdir()
    (bf16_preset / "config.json").write_text(json.dumps(
        {"class_name": "GemmaBackbone", "config": {"dtype": {
            "module": "keras", "class_name": "DTypePolicy", "config": {"name": "bfloat16"}}}}))
    bf16_preset = str(bf16_preset)
    assert model.checkpoint_dtype(bf16_preset) == "bfloat16"
    assert model.checkpoint_dtype("gemma_micro") is None  # built-in: float32, as recorded
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    assert model.checkpoint_dtype(str(hf)) == "float16"
    assert model.resolve_dtype(bf16_preset, "auto", lora=True) == "bfloat16-params"
    assert model.resolve_dtype(bf16_preset, "auto", lora=False) == "bfloat16"  # f32 master weights
    assert model.resolve_dtype(str(hf), "auto", lora=True) == "bfloat16-params"
    assert model.resolve_dtype("gemma_micro", "auto", lora=True) == "float32"
    assert model.resolve_dtype(bf16_preset, "float32", lora=True) == "float32"  # chosen: kept
    assert config_lib.Config().dtype == "auto"


@pytest.mark.slow
def test_lora_on_a_bfloat16_checkpoint_trains_float32_factors_over_a_bfloat16_base(
        tmp_path, bf16_preset, capsys):
    lm, _ = runs.build_model(runs.ModelSpec(bf16_preset, "auto", 0, config_lib.LoraConfig(rank=4)))
    assert "(bfloat16-params, LoRA factors in float32: the checkpoint's bfloat16, --dtype auto)" \
        in capsys.readouterr().out
    _, params, frozen = model.split(lm.module)
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
    assert {str(x.dtype) for x in jax.tree.leaves(frozen)} == {"bfloat16"}
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}?", "completion": " An answer."})
                            + "\n" for i in range(8)))
    train_run("sft", "--model", bf16_preset, "--data", data, "--lora.rank", "4", "--steps", "2",
              "--log-every", "1", "--batching.batch-size", "2", "--batching.grad-accum", "1",
              "--batching.max-length", "16", "--eval.every", "0", "--run-dir", tmp_path / "run")
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert len(losses) == 2 and all(np.isfinite(losses))
    loaded = runs.load(tmp_path / "run")  # the saved "auto" resolves the same way again
    _, params, _ = model.split(loaded.policy())
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
