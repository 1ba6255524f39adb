"""Qwen 3.5's Gated DeltaNet in the package's forward passes (families/gated_delta_net.py) equals
KerasHub's: the chunked delta rule (values, final state, gradients) and the layer's call in
``model.hidden_states`` against KerasHub's own forward; a full fine-tune's gradient of the layer
compiles for a TPU chip (libtpu, on this CPU host). Both sides run compiled: KerasHub's rule
run eagerly compiles each of its hundreds of operations for its own shape."""

import re

import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp

import support
from nnx_posttrain import model
from nnx_posttrain.families import gated_delta_net
from nnx_posttrain.model.blocks import backbone_inputs


def _rule_inputs(t=20, heads=3, dk=4, dv=5, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return dict(query=normal(2, t, heads, dk), key=normal(2, t, heads, dk),
                value=normal(2, t, heads, dv),
                g=-jnp.asarray(rng.uniform(0.01, 1.0, (2, t, heads)), jnp.float32),
                beta=jax.nn.sigmoid(normal(2, t, heads)),
                initial_state=normal(2, heads, dk, dv))


def _kerashub_rule(chunk_size, query, key, value, g, beta, initial_state):
    from keras_hub.src.models.qwen3_5 import qwen3_5_gated_delta_net as kerashub

    return kerashub._chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=chunk_size,
                                            initial_state=initial_state, output_final_state=True)


def _own_rule(chunk_size, query, key, value, g, beta, initial_state):
    return gated_delta_net.chunked_delta_rule((query, key, value), g, beta, chunk_size,
                                              initial_state)


@pytest.mark.parametrize("chunk_size", [8, pytest.param(64, marks=pytest.mark.slow)])
def test_the_chunked_rule_equals_kerashubs_in_values_state_and_gradients(chunk_size):
    """20 positions: three chunks of 8 (the last padded) and one of 64; a nonzero initial state
    (the sampler's prompt pass starts from one); the gradients of every input."""
    inputs = _rule_inputs()

    def loss(rule, inputs):
        out, state = rule(chunk_size, **inputs)
        return jnp.sum(jnp.sin(out) * out) + jnp.sum(state ** 2), (out, state)

    results = [jax.jit(jax.value_and_grad(lambda x, r=rule: loss(r, x), has_aux=True))(inputs)
               for rule in (_kerashub_rule, _own_rule)]
    (_, (want_out, want_state)), want_grad = results[0]
    (_, (out, state)), grad = results[1]
    assert out.shape == want_out.shape and out.dtype == want_out.dtype
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)
    for name in inputs:
        np.testing.assert_allclose(grad[name], want_grad[name], rtol=1e-4, atol=1e-4,
                                   err_msg=name)


@pytest.mark.slow
def test_on_the_cpu_each_triangular_solve_is_one_matrix():
    """jaxlib 0.10's CPU solve of a batch of matrices splits it over XLA's thread pool and blocks
    its own pool thread until the parts are done: with as many such solves in flight as the pool
    has threads (two on a 2-core host: the DeltaNet solves of a gradient-accumulation step) the
    step never finished. The rule's forward and backward solve one matrix per LAPACK call (run in
    the calling thread), with the values of the batched solve."""
    inputs = _rule_inputs(t=130)  # 3 chunks of 64, 2 rows, 3 heads: 18 matrices a solve
    grad = jax.jit(jax.grad(lambda x: jnp.sum(_own_rule(64, **x)[0] ** 2)))
    hlo = grad.lower(inputs).compile().as_text()
    solves = re.findall(r"(\w+\[[\d,]*\])\{[^}]*\} custom-call\([^\n]*lapack_\w*trsm", hlo)
    assert len(solves) >= 2 and set(solves) == {"f32[64,64]"}, solves
    strict = jnp.asarray(np.tril(np.random.default_rng(1).normal(size=(3, 2, 64, 64)), -1),
                         jnp.float32) * 0.1
    batched = jax.jit(gated_delta_net._solved)(strict)
    np.testing.assert_array_equal(jax.jit(gated_delta_net.unit_lower_inverse)(strict), batched)


def test_a_bfloat16_rule_returns_bfloat16_and_a_float32_state():
    inputs = {k: v.astype(jnp.bfloat16) for k, v in _rule_inputs().items()}
    out, state = jax.jit(lambda x: _own_rule(8, **x))(inputs)
    want, want_state = jax.jit(lambda x: _kerashub_rule(8, **x))(inputs)
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-4)


def _forward(bb, own: bool, ids, mask):
    """The sum of a function of ``bb``'s hidden states and its gradient: through
    ``model.hidden_states`` (the package's call of the DeltaNet layer) or KerasHub's own call."""
    graphdef, params, rest = model.split(bb)

    def loss(params):
        module = nnx.merge(graphdef, params, rest)
        if own:
            h = model.hidden_states(module, ids, mask)
        else:
            h = module(backbone_inputs(module, ids, mask))
        h = jnp.where(mask[..., None] != 0, h, 0.0)
        return jnp.sum(jnp.sin(h) * h), h

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.slow
def test_hidden_states_of_qwen3_5_equal_kerashubs_forward_and_gradients():
    """The tiny Qwen 3.5 (a DeltaNet block, then an attention block), 70 positions (two chunks)
    with a left-padded row: the package's forward (its delta rule, its attention and projections)
    against KerasHub's, at every real position, and the gradients of every weight."""
    bb = support.tiny_backbone("qwen3_5")
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 64, size=(2, 70)), jnp.int32)
    mask = jnp.asarray(np.arange(70)[None, :] >= np.array([[0], [9]]), jnp.int32)
    (_, want_h), want = _forward(bb, False, ids, mask)
    (_, got_h), got = _forward(bb, True, ids, mask)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-4)
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    for path, a, b in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(b).max())),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_the_package_calls_its_own_rule_only_in_its_forward(monkeypatch):
    """``model.hidden_states`` goes through ``chunked_delta_rule`` (KerasHub's rule is not
    called); outside it, the backbone's call is KerasHub's own again."""
    from keras_hub.src.models.qwen3_5 import qwen3_5_gated_delta_net as kerashub

    calls = []
    own = gated_delta_net.chunked_delta_rule
    monkeypatch.setattr(gated_delta_net, "chunked_delta_rule",
                        lambda *a, **kw: calls.append("own") or own(*a, **kw))
    monkeypatch.setattr(kerashub, "_chunk_gated_delta_rule", lambda *a, **kw: calls.append(
        "kerashub") or (_ for _ in ()).throw(AssertionError("KerasHub's rule")))
    bb = support.tiny_backbone("qwen3_5")
    ids = jnp.ones((1, 5), jnp.int32)
    jax.eval_shape(lambda i: model.hidden_states(bb, i, jnp.ones_like(i)), ids)
    assert calls == ["own"]
    with pytest.raises(AssertionError, match="KerasHub's rule"):
        jax.eval_shape(lambda i: bb(backbone_inputs(bb, i, jnp.ones_like(i))), ids)


@pytest.mark.slow  # a TPU compile (~7-9 s): in the full suite, not the fast tier
def test_the_gradient_of_every_weight_compiles_for_a_tpu_chip():
    """A full fine-tune's gradient of a one-block Qwen 3.5 (a DeltaNet of 1,024 channels, 128
    positions, bfloat16) compiles for a TPU v5e chip (on this CPU host: nothing runs). KerasHub's
    convolution, between transposes to channels-first and back, had the TPU compiler of JAX
    0.10.2 reject the gradient by its kernel ("Binary op with incompatible shapes:
    bf16[1,128,1024] and bf16[1,1024,128]"), as 35B-A3B's at 8,192 channels and 1,024 positions:
    ``causal_conv1d`` computes it without a convolution."""
    import keras_hub

    from nnx_posttrain import families, plan

    chip = jax.sharding.SingleDeviceSharding(plan.resolve("v5e-1").devices[0])
    dims = dict(families.FAMILIES["qwen3_5"].tiny["qwen3_5"], num_layers=1,
                layer_types=["linear_attention"], linear_key_head_dim=128,
                linear_value_head_dim=128)  # 2 x 2 x 128 + 4 x 128 channels
    bb = families.prepare(keras_hub.models.Qwen3_5Backbone(dtype="bfloat16", **dims))
    graphdef, params, rest = model.split(bb)

    def loss(params, ids):
        h = model.hidden_states(nnx.merge(graphdef, params, rest), ids, jnp.ones_like(ids))
        return jnp.sum(h.astype(jnp.float32) ** 2)

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=chip),
                            (params, jnp.ones((1, 128), jnp.int32)))
    jax.jit(jax.grad(loss)).lower(*abstract).compile()
    grads = jax.eval_shape(jax.grad(loss), *abstract)
    assert (1024, 4) in [g.shape for g in jax.tree.leaves(grads)]  # the kernel's, among them
