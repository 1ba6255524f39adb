"""The Hugging Face export of GPT-OSS (``GptOssForCausalLM``) and of Gemma 4 26B-A4B's mixture
of experts (``Gemma4ForCausalLM`` with ``enable_moe_block``): the round trip through transformers
is ``test_hf_export.test_export_round_trips_through_transformers`` (logits to 1e-4); here, that
the comparison catches a mis-mapped tensor (a plausible wrong mapping of the same shape, written
into the export, moves transformers' logits far past that tolerance) and that GPT-OSS's config
states KerasHub's windows (its odd layers, W + 1 keys: transformers' own reading of W differs)."""

import json

import numpy as np
import pytest

from nnx_posttrain import model
from nnx_posttrain.export import hf as hf_export

from test_hf_export import BACKBONES, IDS, MASK, hf_logits, randomized, task_of

pytest.importorskip("torch")
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
