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


def test_a_step_the_tpu_compiler_refuses_for_its_size_says_so_with_the_fixes(monkeypatch):
    """The TPU compiler refuses a program that does not fit (RESOURCE_EXHAUSTED, as TensorStore
    says of a full disk): the run says the step does not fit, with the compiler's figures and
    the fixes (a full fine-tune's: adapters, 16-bit weights), not that the disk is full."""
    from nnx_posttrain.train import storage

    refusal = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory on HBM, the total "
        "memory required for HLO temporaries (17.79G) exceeds available HBM (15.75G).")

    class Refused:
        def lower(self, *args):
            return self

        def compile(self):
            raise refusal

    step = memory.CheckedStep(Refused(), config_lib.Config(dtype="auto"), lambda _: None)
    with pytest.raises(errors.ConfigError) as info:
        step(jnp.ones(2))
    message = str(info.value)
    assert "needs 17.79 GiB per device, its inputs included, and 15.75 GiB are available" in message
    assert "--lora.rank 8" in message and "--dtype bfloat16-params" in message
    assert storage.fault_of(refusal) is None  # a device's memory, not the storage
    assert storage.fault_of(ValueError("RESOURCE_EXHAUSTED: writing: No space left on device"))
