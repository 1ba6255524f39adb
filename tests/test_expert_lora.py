"""LoRA on a mixture of experts' stacked kernels (``model.expert_lora``, ``--lora.targets experts``):
per-expert factors A [E, in, r], B [E, r, out] in each family's experts einsum.

On each MoE family's tiny configuration: zero factors give KerasHub's own logits (the family's
experts computation, ``ExpertLayer.call``, is KerasHub's); random factors give the logits of the
kernels with ``(alpha / r) A B`` merged in (KerasHub's own layer again) and, LoRA off (the
reference model), the base model's; gradients reach the factors alone. On a micro preset: a short
SFT with expert LoRA lowers the loss, and ``nnx-posttrain export --format hf`` (LoRA merged)
gives the trained model's logits in transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_posttrain import errors, inspection, model, sharding
from nnx_posttrain.model import expert_lora

import support

IDS = (np.arange(1, 25, dtype=np.int32)[None, :] * 7) % 64
MASK = np.ones_like(IDS)
# every MoE family's tiny configuration; Qwen 3.5 MoE's DeltaNet blocks make its passes slow
VARIANTS = ["gpt_oss", "gemma4_moe", "qwen3_moe", "mixtral",
            pytest.param("qwen3_5_moe", marks=pytest.mark.slow)]


def _logits(module):
    return np.asarray(model.full_logits(module, IDS, MASK))


def _random_factors(module, seed=1, scale=0.3):
    rng = np.random.default_rng(seed)
    for v in module.weights:
        if "/lora_" in v.path:
            v.assign(rng.normal(0.0, scale, v.shape).astype("float32"))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_expert_factors_compute_kerashubs_experts_with_the_merged_kernels(variant):
    backbone = support.tiny_backbone(variant)
    base = _logits(backbone)
    adapted = model.enable_lora(backbone, 2, alpha=4.0, targets="experts")
    layers = expert_lora.expert_layers(backbone)
    spec = expert_lora.spec_of(layers[0])
    assert len(adapted) == len(layers) * len(spec.kernels)
    np.testing.assert_array_equal(_logits(backbone), base)  # B = 0: KerasHub's computation
    _random_factors(backbone)
    ours = _logits(backbone)
    assert np.abs(ours - base).max() > 1e-2  # the factors change the model
    with model.lora_disabled(backbone):  # the reference model of DPO / GRPO
        np.testing.assert_array_equal(_logits(backbone), base)
    norms = inspection.lora_delta_norms(backbone)
    assert sorted(norms) == sorted(adapted) and min(norms.values()) > 0
    merged = inspection.merge_lora(backbone)  # KerasHub's own layer, the kernels + A B
    assert len(merged) == len(layers)
    assert all(type(layer).__name__ == spec.cls for layer in expert_lora.expert_layers(backbone))
    assert not [v.path for v in backbone.weights if "/lora_" in v.path]
    np.testing.assert_allclose(_logits(backbone), ours, atol=2e-5, rtol=0)  # measured <= 7e-6


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gpt_oss", "gemma4_moe"])
def test_gradients_reach_the_expert_factors_alone(variant):
    backbone = support.tiny_backbone(variant)
    model.enable_lora(backbone, 2, targets="experts")
    _random_factors(backbone)  # B != 0, so A has a gradient too
    graphdef, params, frozen = model.split(backbone)
    names = model.named_variables(params)
    assert names and all("/lora_" in p and p.endswith(("_a", "_b")) for p in names)

    def loss(p):
        module = nnx.merge(graphdef, p, frozen)
        return jnp.mean(model.token_logprobs(module, IDS, MASK))

    grads = model.named_variables(jax.jit(jax.grad(loss))(params))  # eager: an op at a time
    assert sorted(grads) == sorted(names)
    for path, g in grads.items():
        assert bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0, path


@pytest.mark.slow
def test_expert_targets_by_name_and_mlp_and_their_refusals():
    """``mlp`` on a mixture of experts takes its experts (and its dense MLP layers); a kernel can be
    named alone; ``all-linear`` stays PEFT's (Dense layers, not the experts); a dense model has
    no experts to adapt; ``--adapters-only`` refuses expert factors on a vision-language model
    (no PEFT form verified; tests/test_hf_export_moe.py exports the text models')."""
    backbone = support.tiny_backbone("gpt_oss")
    adapted = model.enable_lora(backbone, 2, targets="down_proj,query")
    assert {p.rsplit("/", 1)[-1] for p in adapted} == {"down_proj", "query"}
    mlp = support.tiny_backbone("gemma4_moe")
    adapted = model.enable_lora(mlp, 2, targets="mlp")
    assert {p.rsplit("/", 1)[-1] for p in adapted} == {
        "ffw_gating", "ffw_gating_2", "ffw_linear", "gate_proj", "up_proj", "down_proj"}
    linear = support.tiny_backbone("mixtral")
    model.enable_lora(linear, 2, targets="all-linear")
    assert not [v.path for v in linear.weights if "/lora_expert" in v.path]
    with pytest.raises(errors.ConfigError, match="no stacked experts"):
        model.enable_lora(support.tiny_backbone("llama3"), 2, targets="experts")
    import keras

    from nnx_posttrain.export import hf as hf_export

    object.__setattr__(backbone, "vision_encoder", keras.layers.Dense(2))  # as a VLM's
    with pytest.raises(hf_export.ExportError, match="stacked experts of a vision-language"):
        hf_export.export_adapters(backbone, support.ROOT / "never-written", "float32", "base")


def test_expert_factors_shard_with_their_kernels_expert_axis():
    backbone = support.tiny_backbone("qwen3_moe")
    model.enable_lora(backbone, 2, targets="experts")
    paths = {v.path: len(v.shape) for v in backbone.weights if "/lora_" in v.path}
    for path, ndim in paths.items():
        axes = sharding.logical_axes(path, ndim)
        assert axes[0] == "expert", (path, axes)
        assert axes[2 if path.endswith("_a") else 1] is None  # the rank stays whole


@pytest.mark.slow
def test_an_int8_base_exports_its_expert_factors_merged():
    """Under ``--quantize int8`` (the experts stay float), the export's plain model holds each
    adapted expert kernel plus its delta (``model.dequantized_into``): the quantized LoRA model's
    logits."""
    backbone = support.tiny_backbone("mixtral")
    model.quantize(backbone, "int8")
    model.enable_lora(backbone, 2, targets="experts,query")
    _random_factors(backbone)
    ours = _logits(backbone)
    plain = support.tiny_backbone("mixtral")
    merged = model.dequantized_into(backbone, plain)
    assert len([p for p in merged if p.endswith("/experts")]) == 2
    np.testing.assert_allclose(_logits(plain), ours, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- a micro preset


@pytest.mark.slow
def test_sft_with_expert_lora_lowers_the_loss_and_exports_merged(tmp_path):
    """Qwen3-MoE's micro preset: 12 SFT steps training the experts' factors alone lower the loss;
    the exported model (LoRA merged) gives the trained model's logits in transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_newer_families import STEPS, _micro_preset, _quiet

    from nnx_posttrain import export, runs

    _, path = _micro_preset("qwen3_moe", _Factory(tmp_path))
    run = tmp_path / "run"
    support.train_run("sft", "--model", path, *STEPS, "--steps", "12", "--lora.rank", "4",
                      "--lora.targets", "experts", "--optim.learning-rate", "2e-2",
                      "--run-dir", run, echo=_quiet)
    losses = [support.losses(run)[s] for s in sorted(support.losses(run))]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses
    loaded = runs.load(run, echo=_quiet)
    assert all("/lora_" in p for p in model.named_variables(loaded.state["params"]))
    ids = (np.arange(1, 33, dtype=np.int32)[None, :] * 5) % 1000 + 3
    ours = np.asarray(model.full_logits(loaded.lm.module, ids, np.ones_like(ids)))
    export.export(run, tmp_path / "hf", target=export.Target("hf", "float32"), echo=_quiet)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                           dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


class _Factory:
    """``tmp_path_factory.mktemp`` over one test's ``tmp_path``."""

    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        path = self.root / name
        path.mkdir()
        return path


@pytest.mark.slow
def test_dpo_and_grpo_with_expert_lora(tmp_path):
    """Mixtral's micro preset with the experts' factors alone: DPO's reference is the model with
    them off (its first loss is log 2: policy = reference), GRPO's rollouts run the sampler
    through the adapted experts."""
    import json

    from test_newer_families import STEPS, _micro_preset, _quiet

    from nnx_posttrain import data

    _, path = _micro_preset("mixtral", _Factory(tmp_path))
    lora = ["--lora.rank", "2", "--lora.targets", "experts", "--optim.learning-rate", "1e-2",
            "--init-from", ""]
    support.train_run("dpo", "--model", path, *STEPS, *lora, "--run-dir", tmp_path / "dpo",
                      echo=_quiet)
    assert support.records(tmp_path / "dpo")[0]["loss"] == pytest.approx(np.log(2), abs=1e-3)
    src = data.source("builtin", "train", builtin="prompt_only")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({k: v for k, v in src[i].items()
                                           if not k.startswith("_")}) + "\n" for i in range(8)))
    support.train_run("grpo", "--model", path, *STEPS, *lora, "--data", prompts,
                      "--batching.batch-size", "4", "--algo.num-generations", "2",
                      "--algo.max-completion-length", "4", "--algo.rewards", "exact_match",
                      "--run-dir", tmp_path / "grpo", echo=_quiet)
    rows = support.records(tmp_path / "grpo")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
