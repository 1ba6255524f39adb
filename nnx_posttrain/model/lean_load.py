"""Reading a KerasHub preset's weights with little memory: variables made without their
initializers (zeros from pages the process has not touched, so nothing is resident before a
weight is read over it), on the host's CPU when they are quantized as they load; and the first
error each layer raised while Keras read its weights (``first_failures``: Keras reports a later
one, which names no cause)."""

from __future__ import annotations

import contextlib
import inspect
import mmap

import jax
import numpy as np


UNTOUCHED_BYTES = 1 << 20


def untouched_zeros(shape, dtype) -> np.ndarray:
    """Zeros in fresh anonymous pages (``mmap``): resident only once written. ``np.zeros``
    cannot promise it: glibc serves a large block from memory freed before, which it clears."""
    dtype = np.dtype(dtype)
    pages = mmap.mmap(-1, max(int(np.prod(shape)) * dtype.itemsize, 1))
    return np.frombuffer(pages, dtype, count=int(np.prod(shape))).reshape(shape)


@contextlib.contextmanager
def no_initializers():
    """Variables created within the block skip their initializer and hold zeros in their own
    dtype; on CPU, from pages the process has not touched (``untouched_zeros``, which
    ``jax.device_put`` takes without a copy). A preset's weights are read over them at once, so
    random initialisation would only cost time (a compilation per shape) and memory (a float32
    sample of each tensor), and zeros written out would make the whole model resident before
    its first weight is read (with ``quantize.while_loading``, the model is never whole).
    Seed-generator states keep theirs (they are not weights)."""
    from keras.src.backend.jax import core

    cls = getattr(core, "NnxVariable", None)
    original = getattr(cls, "_initialize_with_initializer", None)
    if original is None:
        yield
        return

    def keep_zeros(self, initializer):
        if "seed" in (self.name or ""):
            return original(self, initializer)
        value = self.raw_value
        on_host = isinstance(value, jax.Array) and all(d.platform == "cpu" for d in value.devices())
        if on_host and value.nbytes >= UNTOUCHED_BYTES:
            value = jax.device_put(untouched_zeros(value.shape, value.dtype))
        self._initialize(value)

    cls._initialize_with_initializer = keep_zeros
    try:
        yield
    finally:
        cls._initialize_with_initializer = original


def loading_device(quantize: str):
    """Where a KerasHub preset's variables are made while it loads: the host's CPU when they
    are quantized as they are read and the default device is an accelerator (its chip would
    otherwise hold the whole model in its stored dtype before the first layer is quantized: a
    Gemma 4 E4B-shaped preset's 14.9 GB of bfloat16 on a 15.7 GiB v5e, its embeddings' int8
    conversion then out of memory); None (JAX's default device) otherwise. The run places the
    quantized weights on its mesh afterwards."""
    if quantize == "none" or jax.default_backend() == "cpu":
        return None
    return jax.local_devices(backend="cpu")[0]


@contextlib.contextmanager
def made_on(device):
    """Arrays created within the block on ``device`` (None: where JAX puts them). JAX's default
    device alone does not do it in a run: under the run's mesh (``jax.set_mesh``) new arrays go
    to the mesh's devices whatever the default (a Gemma 4 E4B-shaped preset loaded "on the
    host" filled the v5e's memory with its bfloat16 zeros), so a one-device mesh of ``device``
    is put in context too."""
    if device is None:
        yield
        return
    from jax.sharding import Mesh

    with jax.default_device(device), jax.set_mesh(Mesh(np.array([device]), ("host",))):
        yield


@contextlib.contextmanager
def first_failures():
    """Within the block, ``{"first": {id: (path, error)}, "failed": {id: (object, error)}}``:
    the first error each object raised while Keras loaded weights, with the path in the weight
    file it was read at, and Keras' own record of the objects the load finally failed on (with
    the last error of each). Keras' loader
    (``keras.src.saving.saving_lib._load_state``) marks an object loaded only once it loaded
    without error; one that raised (its chip out of memory, say) is tried again at every later
    path its walk reaches it by (a Functional backbone's ``layers`` a second time, the attribute
    that holds it, ``_operations_by_depth/container_N``, ...), where nothing was saved, and each
    retry's error replaces the one before: it reports "Layer 'token_embedding' expected 1
    variables, but received 0 variables", a lookup that could not succeed, not the cause."""
    from keras.src.saving import saving_lib

    record = {"first": {}, "failed": ()}
    original = getattr(saving_lib, "_load_state", None)
    if original is None:
        yield record
        return
    signature = inspect.signature(original)

    def load_state(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            given = signature.bind(*args, **kwargs).arguments  # (its first: the saveable)
            errors, key = given.get("error_msgs") or {}, id(next(iter(given.values())))
            if key in errors and key not in record["first"]:
                record["first"][key] = (given.get("inner_path") or "/", errors[key][1])
            if not given.get("inner_path") and given.get("error_msgs") is not None:
                record["failed"] = given["error_msgs"]  # the whole load's (its root's call)

    saving_lib._load_state = load_state
    try:
        yield record
    finally:
        saving_lib._load_state = original
