"""The Hugging Face export of GPT-OSS (``GptOssForCausalLM``) and of Gemma 4 26B-A4B's mixture
of experts (``Gemma4ForCausalLM`` with ``enable_moe_block``): the round trip through transformers
is ``test_hf_export.test_export_round_trips_through_transformers`` (logits to 1e-4); here, that
the comparison catches a mis-mapped tensor (a plausible wrong mapping of the same shape, written
into the export, moves transformers' logits far past that tolerance) and that GPT-OSS's config
states KerasHub's windows (its odd layers, W + 1 keys: transformers' own reading of W differs).

LoRA on the stacked experts of every MoE family (``model.expert_lora``) exported as PEFT
adapters (``--adapters-only``: LoRA on transformers' 3-D expert parameters, PEFT's
``target_parameters``), loaded with ``peft.PeftModel`` on the exported base model, gives the LoRA
model's logits; a factor written in a plausible wrong layout does not."""

import json

import numpy as np
import pytest

from nnx_posttrain import families, model
from nnx_posttrain.export import hf as hf_export

import support
from test_hf_export import BACKBONES, IDS, MASK, hf_logits, randomized, task_of

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.numpy")
TOLERANCE = 1e-4  # the round trip's


def _deinterleaved(t):  # GPT-OSS's gate / up read as halves rather than interleaved columns
    return np.concatenate([t[..., ::2], t[..., 1::2]], axis=-1)


def _halves_swapped(t):  # Gemma 4's gate | up written up | gate
    half = t.shape[1] // 2
    return np.concatenate([t[:, half:], t[:, :half]], axis=1)


def _untransposed(t):  # Gemma 4's down [E, I, hidden] written without its transpose
    e, h, i = t.shape
    return np.ascontiguousarray(np.swapaxes(t, 1, 2)).reshape(e, h, i)


MISMAPPED = [
    ("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj", _deinterleaved),
    ("gpt_oss", "model.layers.0.mlp.experts.down_proj_bias", lambda t: t[::-1]),  # experts' order
    ("gpt_oss", "model.layers.1.self_attn.sinks", lambda t: t[::-1]),  # heads' order
    ("gemma4_moe", "model.layers.0.experts.gate_up_proj", _halves_swapped),
    ("gemma4_moe", "model.layers.2.experts.down_proj", _untransposed),
    ("gemma4_moe", "model.layers.1.router.per_expert_scale", lambda t: t[::-1]),
]


def _exported(name, tmp_path_factory):
    """(name, our logits, the export's directory, transformers' logits of it)."""
    backbone = randomized(BACKBONES[name]())
    ours = np.asarray(model.full_logits(backbone, IDS, MASK))
    directory = tmp_path_factory.mktemp(name)
    hf_export.export_model(task_of(backbone), directory, "float32")
    theirs, _ = hf_logits(directory)
    return name, ours, directory, theirs


@pytest.fixture(scope="module", params=["gpt_oss", "gemma4_moe"])
def exported(request, tmp_path_factory):
    return _exported(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def gpt_oss_exported(tmp_path_factory):
    return _exported("gpt_oss", tmp_path_factory)


def _rewritten(directory, target, name, change):
    """A copy of the export at ``target`` with tensor ``name`` changed."""
    tensors = safetensors.load_file(directory / "model.safetensors")
    assert change(tensors[name]).shape == tensors[name].shape
    tensors[name] = np.ascontiguousarray(change(tensors[name]))
    target.mkdir()
    safetensors.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text((directory / "config.json").read_text())
    return target


@pytest.mark.slow
def test_a_mis_mapped_tensor_fails_the_round_trip(exported, tmp_path):
    family, ours, directory, theirs = exported
    np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=0)
    for i, (_, name, change) in enumerate(m for m in MISMAPPED if m[0] == family):
        wrong, _ = hf_logits(_rewritten(directory, tmp_path / str(i), name, change))
        assert np.abs(wrong - ours).max() > 100 * TOLERANCE, name


@pytest.mark.slow
def test_gpt_oss_config_states_kerashubs_windows(gpt_oss_exported, tmp_path):
    """KerasHub slides GPT-OSS's window on its odd layers over W + 1 keys; the export says so
    (``layer_types``, ``sliding_window`` W + 1). transformers' own reading of the same window
    (its default layer types, W keys) gives other logits past the window: the difference the
    config removes (research P2)."""
    _, ours, directory, _ = gpt_oss_exported
    config = json.loads((directory / "config.json").read_text())
    window = BACKBONES["gpt_oss"]().sliding_window
    assert config["sliding_window"] == window + 1
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    assert config["num_local_experts"] == 4 and config["model_type"] == "gpt_oss"
    for changed in (dict(sliding_window=window), dict(layer_types=None)):
        target = tmp_path / str(len(list(tmp_path.iterdir())))
        target.mkdir()
        (target / "model.safetensors").symlink_to(directory / "model.safetensors")
        edited = {k: v for k, v in dict(config, **changed).items() if v is not None}
        (target / "config.json").write_text(json.dumps(edited))
        other, _ = hf_logits(target)
        assert np.abs(other - ours).max() > 100 * TOLERANCE, changed


# ----------------------------------------------------------------------------- expert LoRA (PEFT)

# each family's expert LoRA beside other targets: GPT-OSS's with the query's block-diagonal
# adapter; Gemma 4's dense MLP and its experts, gate and up fused (rank 2 x 2); Qwen3-MoE's one
# gate | up kernel; Mixtral's gate without up (up's rows of gate_up_proj zero) and down alone
EXPERT_ADAPTERS = [
    ("gpt_oss", "experts,query"),
    ("gemma4_moe", "mlp"),
    ("qwen3_moe", "experts"),
    ("mixtral", "expert_feedforward_gate_dense,expert_feedforward_output_dense,attention"),
    pytest.param(("qwen3_5_moe", "mlp"), marks=pytest.mark.slow),  # DeltaNet: slow passes
]


@pytest.fixture(scope="module", params=EXPERT_ADAPTERS, ids=lambda p: p[0])
def adapted(request, tmp_path_factory):
    """(our logits with random adapters, the base model's export, the adapters' export)."""
    name, targets = request.param
    backbone = randomized(BACKBONES[name]())
    directory = tmp_path_factory.mktemp(name)
    hf_export.export_model(task_of(backbone), directory / "base", "float32")
    model.enable_lora(backbone, 2, alpha=4.0, targets=targets)
    rng = np.random.default_rng(1)
    for v in backbone.weights:
        if v.path.rsplit("/", 1)[-1].startswith("lora_"):
            v.assign(rng.normal(0.0, 0.3, v.shape).astype("float32"))
    ours = np.asarray(support.jitted(model.full_logits, backbone)(IDS, MASK))
    hf_export.export_adapters(backbone, directory / "adapter", "float32", base_model="base")
    return ours, directory / "base", directory / "adapter"


def _peft_logits(base, adapter):
    peft = pytest.importorskip("peft")
    _, hf = hf_logits(base)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(hf, str(adapter))(
            torch.tensor(IDS, dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_expert_lora_as_peft_adapters_gives_the_lora_models_logits(adapted):
    ours, base, adapter = adapted
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == [
        p for p in config["target_parameters"] if p.endswith(("gate_up_proj", "down_proj"))]
    base_logits, _ = hf_logits(base)
    assert np.abs(base_logits - ours).max() > 0.1  # the adapters change the model
    np.testing.assert_allclose(_peft_logits(base, adapter), ours, atol=TOLERANCE, rtol=0)


def _experts_swapped(t):  # lora_A [E x R, in], expert-major: experts 0 and 1 exchanged
    e = 4
    return t.reshape(e, -1, t.shape[1])[[1, 0, 2, 3]].reshape(t.shape)


def _expert_major(t):  # lora_B [out, R x E] (rank-major columns) read as expert-major
    return t.reshape(t.shape[0], -1, 4).transpose(0, 2, 1).reshape(t.shape)


@pytest.mark.parametrize("change", [_experts_swapped, _expert_major])
def test_a_mis_mapped_expert_factor_fails(adapted, change, tmp_path):
    ours, base, adapter = adapted
    tensors = safetensors.load_file(adapter / "adapter_model.safetensors")
    part = "lora_A" if change is _experts_swapped else "lora_B"
    name = next(k for k in sorted(tensors) if ".experts." in k and part in k)
    tensors[name] = np.ascontiguousarray(change(tensors[name]))
    tmp_path.joinpath("adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    safetensors.save_file(tensors, tmp_path / "adapter_model.safetensors", metadata={"format": "pt"})
    assert np.abs(_peft_logits(base, tmp_path) - ours).max() > 100 * TOLERANCE, name


def test_every_adaptable_expert_kernel_has_its_peft_parameter():
    for family in families.FAMILIES.values():
        layer = family.moe.expert_layer if family.moe else None
        if layer is not None:
            peft = family.export.experts
            assert set(peft.kernels) == set(layer.kernels), family.name
            assert {p for p, _ in peft.kernels.values()} == set(peft.params), family.name
