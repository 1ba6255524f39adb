"""The projections' kernel gradient as one matmul (model/dense.py) equals autodiff's, per family."""

import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp

import support
from nnx_posttrain import families, model
from nnx_posttrain.model import dense
from nnx_posttrain.model.blocks import backbone_inputs, recurrent_calls


@pytest.fixture(scope="module", params=list(support.KERNEL_FAMILIES))
def backbone(request):
    return support.tiny_backbone(request.param)


def _inputs(bb):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(2, 12)).astype(np.int32)
    mask = np.ones((2, 12), np.int32)
    mask[1, :3] = 0
    return backbone_inputs(bb, jnp.asarray(ids), jnp.asarray(mask))


def _grads(bb, own: bool, split=model.split):
    graphdef, params, rest = split(bb)
    inputs = _inputs(bb)

    def loss(params):
        module = nnx.merge(graphdef, params, rest)
        with recurrent_calls(module):  # Qwen 3.5's DeltaNet as the package's forward runs it
            if own:
                with dense.overridden(module) as patched:
                    assert patched, "no projection was overridden"
                    h = module(inputs)
            else:
                h = module(inputs)
        return jnp.sum(jnp.sin(h) * h), h

    # compiled, both sides (the forward stays bitwise comparable): eager, each operation
    # compiles for its own shape, seconds per family on a cold compilation cache
    (_, h), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return h, g


def test_every_family_has_its_projections_overridden(backbone):
    """Every projection a block calls as a layer (q, k, v, o and the MLP's three in most
    families; not those Gemma 4's blocks read as arrays), each one matmul of its kernel."""
    family = families.of(backbone)
    for block in model.decoder_blocks(backbone):
        names = [layer.name for layer in dense.projections(block)]
        if family.name in ("gemma", "gemma3", "llama2", "llama3", "mistral", "qwen2", "qwen3"):
            assert len(names) == 7, names
        present = {l.name for l in block._flatten_layers(include_self=False)}
        assert set(family.lora["attention"]) & present <= set(names), names
        assert all(dense._plan(dense._equation(layer, 3)) for layer in dense.projections(block))


@pytest.mark.slow
def test_forward_is_the_layers_own_and_gradients_equal_autodiff(backbone):
    want_h, want = _grads(backbone, own=False)
    got_h, got = _grads(backbone, own=True)
    np.testing.assert_array_equal(np.asarray(got_h), np.asarray(want_h))  # the same operations
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    for path, a, b in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        # a weight's gradient is a float32 sum over the batch's tokens; the two programs may
        # associate it differently (the suite's unoptimised XLA:CPU did: 1.7e-5 on an embedding
        # entry of 0.65 in a leaf reaching ~20), so the absolute tolerance follows the leaf's scale
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=max(1e-5, 2e-6 * float(np.abs(b).max())),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_lora_gradients_equal_autodiff():
    """LoRA factors get the gradient of Keras' own layer (whose kernel is base + a @ b) through
    the factored term, (x a) b, that the override computes instead."""
    bb = support.tiny_backbone("llama3")
    model.enable_lora(bb, 4, None, "all-linear")
    for v in bb.weights:  # lora_kernel_b starts at zero: give it a value so a's gradient is not 0
        if "lora_kernel_b" in v.path:
            v.assign(np.random.default_rng(2).normal(size=v.shape).astype("float32") * 0.1)
    # the trainable: a and b of every projection
    assert len(jax.tree.leaves(model.split(bb)[1])) == 2 * 7 * 2
    (_, want), (_, got) = _grads(bb, False, model.split), _grads(bb, True, model.split)
    # a factor's gradient is a float32 sum whose terms reach the leaf's largest entries; where they
    # cancel, a small entry keeps their rounding, and the two formulas associate the sums
    # differently ((x a) b against x (a b): 0.094845 vs 0.094827 in a leaf reaching 4.0, 5e-6 of
    # its scale), so the absolute tolerance follows the leaf's scale
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("equation,plan", [
    ("btd,df->btf", (["b", "t"], ["d"], ["f"])),
    ("btd,ndh->btnh", (["b", "t"], ["d"], ["n", "h"])),
    ("btnh,nhd->btd", (["b", "t"], ["n", "h"], ["d"])),
    ("bsd,kdh->bskh", (["b", "s"], ["d"], ["k", "h"])),
    ("abd,dz->abz", (["a", "b"], ["d"], ["z"])),
])
def test_projection_equations_are_one_matmul(equation, plan):
    assert dense._plan(equation)[2:] == plan


@pytest.mark.parametrize("equation", [
    "bqnh,bknh->bnqk",  # attention scores: b is in both operands
    "...d,df->...f",  # ellipsis
    "btd,df->bft",  # the output's axes not rows first
    "btd,dfg->btf",  # an axis of the kernel summed alone
    "btd,df->bf",  # an axis of the input summed alone
])
def test_other_equations_keep_autodiff(equation):
    assert dense._plan(equation) is None


@pytest.mark.slow
def test_kernel_gradient_of_a_reordered_kernel_equals_autodiff():
    """Kernel axes in another order than (contracted, out), and an input whose contracted axis
    is not last."""
    rng = np.random.default_rng(0)
    for equation, x_shape, w_shape in (("btd,ndh->btnh", (2, 5, 6), (3, 6, 4)),
                                       ("btd,nhd->btnh", (2, 5, 6), (3, 4, 6)),
                                       ("bdt,df->btf", (2, 6, 5), (6, 4))):
        assert dense._plan(equation) is not None, equation
        x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
        w_ = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
        want = jax.grad(lambda w: jnp.sum(jnp.einsum(equation, x, w) ** 2))(w_)
        got = jax.grad(lambda w: jnp.sum(dense.contract(equation, x, w) ** 2))(w_)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_gradients_keep_their_dtype():
    x = jnp.ones((2, 3, 4), jnp.bfloat16)
    w = jnp.ones((4, 5), jnp.bfloat16)
    dx, dw = jax.grad(lambda x, w: jnp.sum(dense.contract("btd,df->btf", x, w).astype(jnp.float32)),
                      argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dw, np.float32), 6.0)
