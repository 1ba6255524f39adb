"""LoRA on a mixture of experts' stacked kernels (``--lora.targets experts``, or ``mlp`` on a
mixture of experts, or the kernels' names).

KerasHub keeps each MoE block's experts as raw stacked weights [experts, in, out] of one layer
(GPT-OSS's ``gate_up_proj``, Gemma 4's ``gate_proj``, Qwen3-MoE's
``expert_feedforward_gate_dense``, ...), not as Dense layers, so Keras' ``enable_lora`` cannot
adapt them. Here each adapted kernel W gets per-expert low-rank factors A [E, in, r] (He-uniform
per expert, as Keras draws a Dense's A) and B [E, r, out] (zeros), variables of the experts
layer (``.../lora_<kernel>_a``, ``_b``), and the layer computes ``x W + (alpha / r) (x A) B``
for every expert in its einsum: the adapters' term from the factors, never a kernel-size delta.

The layer's class becomes a subclass whose ``call`` is the family's (``families.ExpertLayer``:
its experts' computation with each kernel product through ``project``), so every path that runs
the layer (training forward, sampler, evaluation, split / merge) computes with the adapters; a
``lora_enabled`` False layer (``lora.lora_disabled``: the reference model) computes without them.
``merge(layer)`` folds ``(alpha / r) A B`` into each kernel and restores the layer's own class.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from nnx_posttrain import families

_PREFIX = "lora_"


def _specs() -> dict:
    """{experts layer class name: its family's ``ExpertLayer``}."""
    return {f.moe.expert_layer.cls: f.moe.expert_layer for f in families.FAMILIES.values()
            if f.moe is not None and f.moe.expert_layer is not None}


def base_class(layer) -> type:
    """The KerasHub class of an experts layer (its own, or the one its LoRA subclass extends)."""
    cls = type(layer)
    return cls.__bases__[0] if getattr(cls, "_expert_lora", False) else cls


def spec_of(layer):
    """The ``ExpertLayer`` of an experts layer, or None for any other layer."""
    return _specs().get(base_class(layer).__name__)


def expert_layers(module) -> list:
    """The experts layers of ``module``'s blocks that its family can adapt."""
    return [layer for layer in module._flatten_layers(include_self=False)
            if spec_of(layer) is not None]


def kernel_names(module) -> tuple[str, ...]:
    """The names of the stacked expert kernels ``--lora.targets experts`` adapts (the family's
    ``ExpertLayer.kernels``), () for a model without an adaptable experts layer."""
    layers = expert_layers(module)
    return tuple(spec_of(layers[0]).kernels) if layers else ()


def _equations(equation: str) -> tuple[str, str]:
    """(x, A -> mid), (mid, B -> out) of a kernel product ``x, W -> out`` whose kernel's axes are
    (expert, in, out): A has W's axes with a rank in place of the output, B the expert, the rank
    and the output."""
    inputs, out = equation.replace(" ", "").split("->")
    x, w = inputs.split(",")
    r = next(c for c in "rzyxqp" if c not in equation)
    mid = out.replace(w[-1], r)
    return f"{x},{w[:-1]}{r}->{mid}", f"{mid},{w[0]}{r}{w[-1]}->{out}"


def project(layer, name: str, equation: str, x):
    """``einsum(equation, x, W)`` of the layer's kernel ``name`` (in ``x``'s dtype), plus its
    adapters' term ``(alpha / r) (x A) B`` when LoRA is on for it."""
    from keras import ops

    kernel = getattr(layer, spec_of(layer).kernels[name])
    out = ops.einsum(equation, x, ops.cast(kernel, x.dtype))
    if not getattr(layer, "lora_enabled", False) or name not in layer.lora_kernels:
        return out
    a = ops.cast(getattr(layer, f"{_PREFIX}{name}_a"), x.dtype)
    b = ops.cast(getattr(layer, f"{_PREFIX}{name}_b"), x.dtype)
    first, second = _equations(equation)
    term = ops.einsum(second, ops.einsum(first, x, a), b)
    return ops.add(out, ops.multiply(term, ops.cast(layer.lora_alpha / layer.lora_rank, x.dtype)))


def _call(self, *args, **kwargs):
    spec = spec_of(self)
    return spec.call(self, functools.partial(project, self), *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _lora_class(base: type) -> type:
    """The subclass of an experts layer class whose ``call`` is its family's, with LoRA."""
    return type(f"LoRA{base.__name__}", (base,),
                {"call": _call, "_expert_lora": True, "__module__": __name__})


def _factor_a(shape: tuple, seed: int) -> np.ndarray:
    """A [E, in, r]: each expert's [in, r] He-uniform (limit sqrt(6 / in)), as Keras' Dense LoRA."""
    limit = math.sqrt(6.0 / shape[1])
    return np.random.default_rng(seed).uniform(-limit, limit, shape).astype(np.float32)


def enable(layer, names: tuple[str, ...], rank: int, alpha: float | None, seed: int,
           factor_dtype: str | None = None) -> list[str]:
    """Add LoRA factors (scale ``alpha`` / ``rank``; alpha None: rank) to the layer's kernels
    ``names`` (its family's ``ExpertLayer.kernels``); returns the adapted kernels' paths."""
    spec = spec_of(layer)
    chosen = [n for n in spec.kernels if n in names]
    if not chosen:
        return []
    dtype = "float32" if factor_dtype == "float32" else layer.variable_dtype
    base = list(layer.weights)
    layer.trainable = True  # Keras makes a frozen layer's new weights frozen: only A, B train
    for variable in base:
        variable.trainable = False
    layer._tracker.unlock()
    paths = []
    for i, name in enumerate(chosen):
        kernel = getattr(layer, spec.kernels[name])
        e, n_in, n_out = kernel.shape
        a = _factor_a((e, n_in, rank), int(np.random.SeedSequence([seed, i]).generate_state(1)[0]))
        for part, value in (("a", a), ("b", np.zeros((e, rank, n_out), np.float32))):
            variable = layer.add_weight(name=f"{_PREFIX}{name}_{part}", shape=value.shape,
                                        initializer="zeros", dtype=dtype, trainable=True)
            variable.assign(value.astype(dtype))
            # beside its kernel (whose path a family's ``prepare`` may have fixed)
            variable._path = kernel.path.rsplit("/", 1)[0] + f"/{_PREFIX}{name}_{part}"
            setattr(layer, f"{_PREFIX}{name}_{part}", variable)
        paths.append(kernel.path)
    layer._tracker.lock()
    for key, value in (("lora_rank", rank), ("lora_alpha", float(alpha or rank)),
                       ("lora_kernels", tuple(chosen)), ("lora_enabled", True)):
        object.__setattr__(layer, key, value)
    layer.__class__ = _lora_class(base_class(layer))
    return paths


def factors(layer, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Kernel ``name``'s factors A [E, in, r], B [E, r, out], float32 on the host."""
    return tuple(np.asarray(getattr(layer, f"{_PREFIX}{name}_{part}").value, np.float32)
                 for part in ("a", "b"))


def delta(layer, name: str):
    """(alpha / r) A B of kernel ``name``, float32, shaped like the kernel [E, in, out]."""
    import jax.numpy as jnp

    a = jnp.asarray(getattr(layer, f"{_PREFIX}{name}_a").value, jnp.float32)
    b = jnp.asarray(getattr(layer, f"{_PREFIX}{name}_b").value, jnp.float32)
    return (layer.lora_alpha / layer.lora_rank) * jnp.einsum("eir,ero->eio", a, b)


def merge(layer) -> None:
    """Fold each adapted kernel's delta into it (its dtype kept), remove the factors and give
    the layer its own class back: a plain KerasHub experts layer again."""
    import jax.numpy as jnp

    spec, factors = spec_of(layer), []
    for name in layer.lora_kernels:
        kernel = getattr(layer, spec.kernels[name])
        kernel.assign((jnp.asarray(kernel.value, jnp.float32) + delta(layer, name))
                      .astype(kernel.dtype))
        factors += [f"{_PREFIX}{name}_{part}" for part in ("a", "b")]
    drop = {id(getattr(layer, f)) for f in factors}
    layer._tracker.unlock()
    for attr in ("_trainable_variables", "_non_trainable_variables"):
        setattr(layer, attr, [v for v in getattr(layer, attr) if id(v) not in drop])
    for f in factors:
        object.__delattr__(layer, f)
    layer._tracker.lock()
    for key in ("lora_rank", "lora_alpha", "lora_kernels", "lora_enabled"):
        object.__delattr__(layer, key)
    layer.__class__ = base_class(layer)
