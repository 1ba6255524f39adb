"""KerasHub presets whose weights ``save_to_preset`` sharded (``model.weights.json`` and
``model_0000N.weights.h5``: a backbone over its ``max_shard_size``, 10 GiB by default, such as
Gemma 4 E4B's 14.9 GB) load as a single-file preset does, and a layer Keras could not load is
reported by its own error (issue 56)."""

import nnx_posttrain  # noqa: F401  (sets the Keras backend before keras is imported)
import keras
import keras_hub
import numpy as np
import pytest

from nnx_posttrain import model


def _sharded(micro, path):
    """``micro`` saved as KerasHub saves a model over its shard size: in 2 shards or more."""
    largest = max(np.prod(v.shape) * 4 for v in micro.module.weights)
    micro.task.save_to_preset(str(path), max_shard_size=1.5 * largest / 2**30)
    assert not (path / "model.weights.h5").exists() and (path / "model.weights.json").exists()
    assert len(list(path.glob("model_*.weights.h5"))) >= 2
    return path


@pytest.mark.slow
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


@pytest.mark.filterwarnings("ignore:Skipping nested container")
def test_a_layer_that_fails_to_load_is_reported_by_its_own_error(micro, tmp_path, monkeypatch):
    """Keras marks a layer loaded only when it loaded, and tries one that raised again at each
    later path its walk reaches it by (``layers`` again, the backbone's attribute,
    ``_operations_by_depth/container_N``), where nothing was saved: its message is the last
    retry's, "expected 1 variables, but received 0 variables". The load's message is the
    layer's first error, where its weights are (here an out-of-memory, as a chip's)."""
    preset = _sharded(micro, tmp_path / "sharded")
    original = keras.layers.Embedding.load_own_variables

    def out_of_memory(self, store):
        if len(store) and isinstance(self, keras.layers.ReversibleEmbedding):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return original(self, store)

    monkeypatch.setattr(keras.layers.Embedding, "load_own_variables", out_of_memory)
    with pytest.warns(UserWarning, match="Skipping nested container at '_operations_by_depth"), \
            pytest.raises(ValueError, match="expected 1 variables, but received 0 variables"):
        keras_hub.models.CausalLM.from_preset(str(preset))  # Keras' own report
    with pytest.raises(model.ModelLoadError) as info:
        model.load(str(preset))
    message = str(info.value)
    assert "token_embedding at 'layers/reversible_embedding': RuntimeError: RESOURCE_EXHAUSTED" \
        in message, message
    assert "received 0 variables" not in message
