"""The compiled step's own memory figures are checked before it first runs; a step that would
not fit is refused with the cheapest fixes, without running."""

import jax
import jax.numpy as jnp
import pytest

from nnx_posttrain import config as config_lib, errors
from nnx_posttrain.model import device_memory
from nnx_posttrain.train import memory


def _step(x):
    return (jnp.sin(x @ x.T) @ x).sum(), x + 1  # an [n, n] temporary


def test_a_compiled_step_that_would_not_fit_is_refused_before_it_runs(monkeypatch):
    cfg = config_lib.Config(lora=config_lib.LoraConfig(rank=4))
    said, ran = [], []
    step = memory.CheckedStep(jax.jit(lambda x: ran.append(1) or _step(x)), cfg, said.append)
    x = jnp.ones((512, 8))
    monkeypatch.setattr(device_memory, "available_bytes", lambda: 2**20)  # 1 MiB free
    with pytest.raises(errors.ConfigError) as info:
        step(x)
    assert "the compiled training step needs 0." in str(info.value)
    assert "The cheapest fixes first: --quantize int8" in str(info.value)
    assert "XLA's temporaries" in said[0]
    assert ran == [1]  # traced once, never run
    monkeypatch.setattr(device_memory, "available_bytes", lambda: 2**40)
    step = memory.CheckedStep(jax.jit(_step), cfg, said.append)
    total, y = step(x)
    assert float(total) == pytest.approx(float(_step(x)[0]), rel=1e-6)
    assert step.compiled is not None
    assert step(jnp.ones((4, 8)))[1].shape == (4, 8)  # another shape: the jitted function
    assert not config_lib.Config(memory_check=False).memory_check
