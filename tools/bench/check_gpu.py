"""On a GPU: the cuDNN attention path (``--attention cudnn``, what ``auto`` takes there) and the
shared-prompt preference rows against a float32 reference, per model family, packed and not,
forward and backward. The test suite runs on CPU, where cuDNN does not exist; this is its GPU half.

    python -m tools.bench.check_gpu            # one line per check; exit 1 on a failed check

cuDNN flash attention runs in bfloat16 only, so no path can equal the float32 reference to 1e-5:
each check measures the bfloat16 ``cudnn`` path's error (max |x - ref| / max |ref| over the real
positions) against the float32 ``xla`` path on the same weights (the path the CPU tests prove
equal to KerasHub's attention), and passes when it is no larger than twice the error of our own
bfloat16 ``xla`` path (plus 1e-3): as exact as bfloat16 allows, whatever its rounding.
"""

from __future__ import annotations

import os

from tools import ToolError, exit_status

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

SEQ = 40  # past CHUNK: the cudnn path's query chunks (recomputed in the backward pass)
CHUNK = 16
WINDOW = 12


def families(dtype: str):
    """Tiny random backbones with each family's feature: one kv head (Gemma), grouped heads
    (Llama 3), q/k norms (Qwen 3), a sliding window (Mistral, Qwen 2, Gemma 3's local layers)."""
    import keras_hub

    common = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, hidden_dim=64,
                  intermediate_dim=96, dtype=dtype)
    return {
        "gemma": lambda: keras_hub.models.GemmaBackbone(num_key_value_heads=1, head_dim=16,
                                                        **common),
        "llama3": lambda: keras_hub.models.Llama3Backbone(num_key_value_heads=2, **common),
        "qwen3": lambda: keras_hub.models.Qwen3Backbone(num_key_value_heads=1, head_dim=16,
                                                        **common),
        "qwen2": lambda: keras_hub.models.QwenBackbone(
            num_key_value_heads=2, use_sliding_window_attention=True,
            sliding_window_size=WINDOW, **common),
        "mistral": lambda: keras_hub.models.MistralBackbone(num_key_value_heads=2,
                                                            sliding_window=WINDOW, **common),
        "gemma3": lambda: keras_hub.models.Gemma3Backbone(
            image_size=None, num_key_value_heads=1, head_dim=16,
            use_sliding_window_attention=True, sliding_window_size=WINDOW, **common),
    }


def pair(family: str):
    """(float32 backbone, bfloat16 backbone with the float32 weights rounded)."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    f32 = families("float32")[family]()
    for v in f32.weights:  # norms and biases start at 0 / 1: random, so every weight matters
        if "norm" in v.path or "bias" in v.path:
            v.assign(np.random.default_rng(1).normal(size=v.shape).astype("float32") * 0.5)
    bf16 = families("bfloat16")[family]()
    for a, b in zip(bf16.weights, f32.weights):
        a.assign(np.asarray(b.value).astype(a.dtype))
    return f32, bf16


def inputs(packed: bool):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(2, SEQ)).astype(np.int32)
    if packed:  # row 0: three examples and padding; row 1: two examples
        pos = np.arange(SEQ)
        seg = np.stack([np.select([pos < 11, pos < 27, pos < 35], [1, 2, 3], 0),
                        np.where(pos < 22, 1, 2)]).astype(np.int32)
        return ids, (seg != 0).astype(np.int32), seg
    mask = np.ones((2, SEQ), np.int32)
    mask[0, -6:] = 0  # a right-padded row
    mask[1, :7] = 0  # a left-padded row
    return ids, mask, None


def use(module, implementation: str) -> str:
    from nnx_posttrain import model
    from nnx_posttrain.model import attention

    line = model.set_attention(module, implementation, chunk=CHUNK)
    if attention.attention_of(module).implementation != implementation:
        raise ToolError(f"asked for {implementation}, the layer took: {line}")
    return line


def error(x, ref) -> float:
    import numpy as np

    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def hidden_and_grads(module, packed: bool, implementation: str):
    """(hidden states at real positions, gradient of their sum of squares) on ``module``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_posttrain import model

    ids, mask, seg = inputs(packed)
    use(module, implementation)
    real = jnp.asarray((seg if seg is not None else mask) != 0)
    graphdef, params, rest = model.split(module)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        h = model.hidden_states(m, jnp.asarray(ids), jnp.asarray(mask),
                                None if seg is None else jnp.asarray(seg))
        h = jnp.where(real[..., None], h.astype(jnp.float32), 0.0)
        return jnp.sum(h ** 2) / h.size, h

    with jax.default_matmul_precision("highest"):  # float32 reference: no TF32
        (_, h), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return h, grads


def check(name: str, got: float, bound: float, results: list) -> None:
    ok = got <= 2 * bound + 1e-3
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name:42s} tested {got:.2e}   bf16 xla {bound:.2e}",
          flush=True)


def check_attention(family: str, path: str, results: list) -> None:
    import jax

    f32, bf16 = pair(family)
    for packed in (False, True):
        ref_h, ref_g = hidden_and_grads(f32, packed, "xla")
        xla_h, xla_g = hidden_and_grads(bf16, packed, "xla")
        cud_h, cud_g = hidden_and_grads(bf16, packed, path)
        label = f"{family} {'packed' if packed else 'unpacked'}"
        check(f"{label} hidden states", error(cud_h, ref_h), error(xla_h, ref_h), results)
        grad_err = [max(error(a, r) for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)))
                    for g in (cud_g, xla_g)]
        check(f"{label} gradients", *grad_err, results)


def ragged_pairs(seq: int, prompts: list[int], ends: dict) -> dict:
    """Right-padded pairs of random ids (vocabulary 64) sharing their prompts: row r's prompt has
    ``prompts[r]`` tokens and its ``side`` row ends at ``ends[side][r]``; loss on the answers.
    (Also the pairs of ``tests/test_shared_prompt.py``.)"""
    import numpy as np

    rng = np.random.default_rng(0)
    batch = {}
    for side in ("chosen", "rejected"):
        ids = rng.integers(1, 64, size=(len(prompts), seq)).astype(np.int32)
        att = np.zeros((len(prompts), seq), np.int32)
        loss = np.zeros((len(prompts), seq), np.float32)
        for row, (p, end) in enumerate(zip(prompts, ends[side])):
            att[row, :end], loss[row, p:end] = 1, 1
        batch.update({f"{side}_input_ids": ids * att, f"{side}_attention_mask": att,
                      f"{side}_loss_mask": loss})
    for row, p in enumerate(prompts):
        batch["rejected_input_ids"][row, :p] = batch["chosen_input_ids"][row, :p]
    return batch


def check_shared_prompt(path: str, results: list) -> None:
    """The chosen / rejected log-probs (SimPO's; DPO's are the same) from shared-prompt rows
    (branch segment ids through cuDNN's mask) against the float32 concatenated forward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nnx_posttrain.algorithms import shared_prompt
    from nnx_posttrain.algorithms.preference import SimPO, SimPOConfig

    f32, bf16 = pair("gemma")
    algorithm = SimPO(SimPOConfig())
    algorithm.setup(bf16)
    shared = algorithm.prepare(ragged_pairs(SEQ, [16, 12], {"chosen": [SEQ - 6, SEQ],
                                                             "rejected": [SEQ, SEQ - 9]}))
    if "shared_input_ids" not in shared:
        raise ToolError("the check's pairs did not take the shared-prompt rows")
    concatenated = {k: v for k, v in shared.items() if k not in shared_prompt.KEYS}

    def logps(module, batch, implementation):
        use(module, implementation)
        with jax.default_matmul_precision("highest"):
            out = algorithm.pair_logps(module, jax.tree.map(jnp.asarray, batch))
        return np.stack([np.asarray(out[s], np.float32) for s in ("chosen", "rejected")])

    ref = logps(f32, concatenated, "xla")
    check("gemma pair log-probs, shared-prompt rows", error(logps(bf16, shared, path), ref),
          error(logps(bf16, concatenated, "xla"), ref), results)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default="cudnn", choices=("cudnn", "xla"),
                   help="the bfloat16 path under test (xla: the tool's own check, on any device)")
    args = p.parse_args(argv)
    import nnx_posttrain  # noqa: F401  (backend)
    import jax

    if args.path == "cudnn" and jax.devices()[0].platform not in ("gpu", "cuda"):
        print(f"no GPU: JAX sees {jax.devices()[0].platform}; nothing checked")
        return 0
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, path under test: {args.path}",
          flush=True)
    results: list[bool] = []
    for family in families("float32"):
        check_attention(family, args.path, results)
    check_shared_prompt(args.path, results)
    print(f"{sum(results)} of {len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
