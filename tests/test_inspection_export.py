"""Notebook inspection helpers (nnx_posttrain.inspection), export (nnx_posttrain.export and
``nnx-posttrain export``) and ``nnx-posttrain inspect``, on tiny real runs."""

import json
from pathlib import Path

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import jax.numpy as jnp
import keras_hub
import numpy as np
import pytest
from flax import nnx

from nnx_posttrain import cli, errors, export, inspection, model, runs
from nnx_posttrain.cli import sample
from support import MICRO, cli_error, train_run

ROOT = Path(__file__).resolve().parents[1]
IDS = jnp.array([[2, 17, 30, 41, 52, 63, 74, 85, 96, 11, 12, 13, 14], [2, 9, 8, 7, 6, 5, 4, 0, 0, 0, 0, 0, 0]])
MASK = (IDS != 0).astype(jnp.int32).at[:, 0].set(1)


@pytest.fixture(scope="module")
def full_run(shared_run):
    return shared_run("sft")


@pytest.fixture(scope="module")
def lora_run(shared_run):
    return shared_run("sft_lora")


@pytest.mark.slow
def test_param_counts_group_by_top_level_layer_and_sum_to_the_total(full_run):
    module = runs.load(full_run).module
    counts = inspection.param_counts(module)
    assert {"token_embedding", "decoder_block_0", "decoder_block_1", "total"} <= counts.keys()
    assert sum(v for k, v in counts.items() if k != "total") == counts["total"]
    assert counts["total"] == model.count_params(nnx.state(module)) > 0


@pytest.mark.slow
def test_lora_delta_norms_then_merge_keeps_outputs_and_leaves_a_plain_model(lora_run):
    module = runs.load(lora_run).module
    norms = inspection.lora_delta_norms(module)
    assert len(norms) == 4 * 2  # q, k, v, o in each of the 2 blocks
    assert all(k.startswith("decoder_block_") and v > 0 for k, v in norms.items())
    dtypes = {v.path: v.dtype for v in module.weights if v.path.endswith("kernel")}
    before = model.full_logits(module, IDS, MASK)
    merged = inspection.merge_lora(module)
    assert sorted(merged) == sorted(norms)
    after = model.full_logits(module, IDS, MASK)
    assert float(jnp.max(jnp.abs(before - after))) < 1e-5
    assert not model.has_lora(module)
    assert inspection.lora_delta_norms(module) == {}
    assert not [v.path for v in module.weights if "lora" in v.path]
    assert {v.path: v.dtype for v in module.weights if v.path.endswith("kernel")} == dtypes
    _, trainable, frozen = model.split(module)  # a plain model: every weight trains again
    assert model.count_params(frozen) == 0


@pytest.mark.slow
def test_policy_reference_diff_is_zero_to_itself_and_positive_to_the_base(full_run):
    module = runs.load(full_run).module
    same = inspection.policy_reference_diff(module, module)
    assert same and all(v == 0.0 for v in same.values())
    base = model.load("gemma_micro", seed=json.loads((full_run / "config.json").read_text())["seed"])
    diff = inspection.policy_reference_diff(module, base.module)
    assert diff.keys() == same.keys()
    assert all(v > 0 for k, v in diff.items() if k.endswith("kernel")), diff


def test_show_state_renders_html(full_run):
    html = inspection.show_state(model.load("gemma_micro").module)
    assert isinstance(html, str) and len(html) > 1000 and "<" in html


@pytest.mark.slow
@pytest.mark.parametrize("which", ["lora_run", "full_run"])
def test_export_keras_preset_round_trips_with_the_same_logits(which, request, tmp_path):
    run_dir = request.getfixturevalue(which)
    expected_module = runs.load(run_dir).module
    expected = model.full_logits(expected_module, IDS, MASK)  # LoRA (unmerged) or full weights
    out = tmp_path / "preset"
    files = export.export(run_dir, out)
    assert out / "config.json" in files
    assert "lora" not in (out / "config.json").read_text()
    exported = model.load(str(out))
    got = model.full_logits(exported.module, IDS, MASK)
    assert float(jnp.max(jnp.abs(got - expected))) < 1e-5
    task = keras_hub.models.CausalLM.from_preset(str(out))
    np.testing.assert_allclose(model.full_logits(task.backbone, IDS, MASK), expected, atol=1e-5)


@pytest.mark.slow
def test_a_ppo_run_samples_and_exports_its_policy_and_a_reward_model_is_refused(
        tmp_path, capsys):
    """PPO trains the backbone with a value head: sample and export take the policy (TRL's PPO
    saves it alone); a reward model does not generate and is refused, before it loads, with how
    it is used instead (the command line says it as an error)."""
    ppo = tmp_path / "ppo"  # (in this process; the evaluations read one batch, answer none)
    train_run("ppo", *MICRO, "--run-dir", ppo, "--init-from", "", "--steps", "2",
              "--batching.batch-size", "8", "--eval.every", "0", "--eval.batches", "1",
              "--eval.exact-match", "0", "--optim.learning-rate", "1e-2", "--algo.rewards",
              "length", "--lora.rank", "2", "--lora.targets", "attention", echo=lambda _: None)
    loaded = runs.load(ppo)
    assert type(loaded.module).__name__ == "PolicyWithValue"
    assert inspection.lora_delta_norms(loaded.module)  # through the wrapper, to its backbone
    expected = model.full_logits(loaded.policy(), IDS, MASK)
    assert len(sample.answers(ppo, ["What is 2 + 3?"], max_new_tokens=4)) == 1
    assert cli.main(["export", str(ppo), "--to", str(tmp_path / "preset")]) == 0
    got = model.full_logits(model.load(str(tmp_path / "preset")).module, IDS, MASK)
    assert float(jnp.max(jnp.abs(got - expected))) < 1e-5
    assert float(jnp.max(jnp.abs(expected - model.full_logits(
        model.load("gemma_micro").module, IDS, MASK)))) > 1e-4  # trained: not the start's

    rm = tmp_path / "rm"
    (rm / "checkpoints").mkdir(parents=True)  # refused by its config alone, before any loading
    (rm / "config.json").write_text(json.dumps(
        dict(json.loads((ppo / "config.json").read_text()), algo_name="RewardConfig")))
    refusal = (f"{rm} is a reward model .* does not generate, and only language models are "
               f"exported. Use it as an online run's reward .--algo.rewards {rm}.")
    with pytest.raises(errors.RunDirError, match=refusal):
        sample.answers(rm, ["hi"])
    with pytest.raises(errors.UserError, match=refusal):
        export.export(rm, tmp_path / "rm_out")
    cli_error(capsys, ["sample", str(rm), "--prompt", "hi"], match="error: " + refusal)
    assert not (tmp_path / "rm_out").exists()


def test_export_hf_writes_safetensors_and_config(lora_run, tmp_path):
    out = tmp_path / "hf"
    export.export(lora_run, out, target=export.Target("hf"))
    assert (out / "model.safetensors").stat().st_size > 0
    config = json.loads((out / "config.json").read_text())
    assert config.get("model_type") == "gemma"
    # the run's chat template, as transformers applies it: conversations render as in training
    from nnx_posttrain import chat

    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3 + 3?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.bos_token + chat.to_text(messages, "gemma", add_generation_prompt=True))


def test_export_of_a_run_without_checkpoints_fails_clearly(full_run, tmp_path, capsys):
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "config.json").write_text((full_run / "config.json").read_text())
    with pytest.raises(errors.UserError, match="no complete checkpoint"):
        export.export(empty, tmp_path / "out")
    cli_error(capsys, ["export", str(tmp_path / "nothing"), "--to", str(tmp_path / "out")],
              match="error: .*not a run directory")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_dtype_defaults_to_the_source_and_can_be_chosen(lora_run, tmp_path):
    from safetensors import safe_open

    export.export(lora_run, tmp_path / "f32", target=export.Target("hf"))
    export.export(lora_run, tmp_path / "bf16", target=export.Target("hf", "bfloat16"))
    for name, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
        assert json.loads((tmp_path / name / "config.json").read_text())["torch_dtype"] == dtype
        with safe_open(tmp_path / name / "model.safetensors", "np") as f:
            embedding = f.get_tensor("model.embed_tokens.weight")
        assert str(embedding.dtype) == dtype
    ratio = ((tmp_path / "bf16" / "model.safetensors").stat().st_size
             / (tmp_path / "f32" / "model.safetensors").stat().st_size)
    assert abs(ratio - 0.5) < 0.03  # the header aside
    # a preset saved in bfloat16 exports as bfloat16 by default
    preset = tmp_path / "preset"
    preset.mkdir()
    (preset / "config.json").write_text(json.dumps(
        {"class_name": "GemmaBackbone", "config": {"dtype": {"config": {"name": "bfloat16"}}}}))
    assert export.source_dtype(str(preset), "float32") == "bfloat16"
    assert export.source_dtype("gemma_micro", "bfloat16") == "float32"  # f32 weights, bf16 compute
    assert export.source_dtype("gemma_micro", "bfloat16-params") == "bfloat16"


def test_export_adapters_only_writes_peft_files(lora_run, full_run, tmp_path):
    from safetensors.numpy import load_file

    files = export.export(lora_run, tmp_path / "a", target=export.Target("hf", adapters_only=True))
    assert sorted(p.name for p in files) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    # gemma_micro: 2 query heads of 16, 1 KV head, hidden 32; queries' adapters are per head
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 32)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (32, 4)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].shape == (2, 32)
    assert tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"].shape == (32, 2)
    assert config["rank_pattern"] == {"q_proj": 4}
    with pytest.raises(errors.UserError, match="trained every weight"):
        export.export(full_run, tmp_path / "b", target=export.Target("hf", adapters_only=True))
    with pytest.raises(errors.UserError, match="use it with --format hf"):
        export.export(lora_run, tmp_path / "c", target=export.Target(adapters_only=True))


@pytest.mark.slow
def test_inspect_reports_the_checkpoint_its_parameters_and_last_metrics(lora_run, tmp_path,
                                                                        capsys):
    from nnx_posttrain.cli import inspect_command

    lines = inspect_command.report(lora_run)
    assert lines[0].startswith(f"{lora_run}: SFT on gemma_micro (float32), checkpoint ")
    total = inspection.param_counts(runs.load(lora_run).module)["total"]
    assert any(line.split() == ["total", f"{total:,}"] for line in lines)
    assert any(line.startswith("LoRA update norms (") for line in lines)
    assert any(line.startswith("last train record (step ") for line in lines)
    capsys.readouterr()
    assert cli.main(["inspect", str(lora_run), "--html", str(tmp_path / "state.html")]) == 0
    assert "treescope" in (tmp_path / "state.html").read_text()[:100000].lower()
    assert capsys.readouterr().out.startswith(lines[0])
