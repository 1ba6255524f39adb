"""KerasHub presets whose weights ``save_to_preset`` sharded (``model.weights.json`` and
``model_0000N.weights.h5``: a backbone over its ``max_shard_size``, 10 GiB by default, such as
Gemma 4 E4B's 14.9 GB) load as a single-file preset does (issue 56)."""

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import numpy as np

from nnx_posttrain import model


def _sharded(micro, path):
    """``micro`` saved as KerasHub saves a model over its shard size: in 2 shards or more."""
    largest = max(np.prod(v.shape) * 4 for v in micro.module.weights)
    micro.task.save_to_preset(str(path), max_shard_size=1.5 * largest / 2**30)
    assert not (path / "model.weights.h5").exists() and (path / "model.weights.json").exists()
    assert len(list(path.glob("model_*.weights.h5"))) >= 2
    return path


def test_a_sharded_preset_is_read_over_zeros_and_quantized_as_it_loads(micro, tmp_path,
                                                                        monkeypatch):
    """Only ``model.weights.h5`` was taken for a KerasHub preset: a sharded one was loaded as a
    Hugging Face checkpoint is, every variable made with its initializer and the model whole
    in its stored dtype before ``--quantize int8`` (on a v5e, Gemma 4 E4B's 14.9 GB of random
    bfloat16, then its embeddings' reads out of the chip's memory)."""
    from keras.src.backend.jax import core

    preset = _sharded(micro, tmp_path / "sharded")
    shards = sorted(preset.glob("model_*.weights.h5"))
    assert model.weights_bytes(str(preset), "float32") == sum(p.stat().st_size for p in shards)
    initialised = []
    original = core.NnxVariable._initialize_with_initializer
    monkeypatch.setattr(core.NnxVariable, "_initialize_with_initializer",
                        lambda self, init: initialised.append(self.name) or original(self, init))
    lm = model.load(str(preset), quantize="int8")
    assert [name for name in initialised if "seed" not in name] == []  # read over zeros
    micro.task.save_to_preset(str(tmp_path / "single"), max_shard_size=None)
    single = model.load(str(tmp_path / "single"), quantize="int8")
    pairs = list(zip(lm.module.weights, single.module.weights, strict=True))
    assert {str(a.dtype) for a, _ in pairs} >= {"int8"}
    for a, b in pairs:
        assert a.path == b.path
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
