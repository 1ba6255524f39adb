"""The attention paths (model/attention.py) equal KerasHub's attention, per family, packed and not."""

import functools

import keras_hub
import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp

import support
from nnx_posttrain import errors, model
from nnx_posttrain.model import attention

SEQ = 24  # long enough for the sliding windows below (8) to cut


FAMILIES = support.KERNEL_FAMILIES


@pytest.fixture(scope="module", params=list(FAMILIES))
def backbone(request):
    return support.tiny_backbone(request.param)


def _inputs(packed: bool, length: int = SEQ):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(2, length)).astype(np.int32)
    if packed:  # row 0: three examples and padding; row 1: two examples
        pos = np.arange(length) * 24 // length  # the same layout at any length
        seg = np.stack([np.select([pos < 7, pos < 16, pos < 21], [1, 2, 3], 0),
                        np.where(pos < 13, 1, 2)]).astype(np.int32)
        return ids, (seg != 0).astype(np.int32), seg
    mask = np.ones((2, length), np.int32)
    mask[1, :5] = 0  # a left-padded row
    mask[0, -4:] = 0  # a right-padded row
    return ids, mask, None


def _kerashub_hidden(bb, ids, mask, seg):
    """KerasHub's own attention as its layers are written (the reference): packed rows through
    each block's own mask (causal, padding, window) restricted to the examples
    (``blocks._attention_mask_override``)."""
    with support.kerashub_as_written():
        return model.hidden_states(bb, jnp.asarray(ids), jnp.asarray(mask),
                                   None if seg is None else jnp.asarray(seg))


def _packs(bb) -> bool:
    """Whether ``bb`` takes packed rows: not with recurrent blocks (Qwen 3.5's Gated DeltaNet),
    whose state would cross the examples (``model.hidden_states`` refuses them)."""
    return not any(attention.recurrent_layer(b) for b in model.decoder_blocks(bb))


def _refused_packed(bb, implementation, **kwargs) -> bool:
    """True (after checking the refusal) where ``bb`` takes no packed rows."""
    if _packs(bb):
        return False
    with pytest.raises(errors.ConfigError, match="packing.*Gated DeltaNet"):
        _hidden(bb, implementation, True, **kwargs)
    return True


def _hidden(bb, implementation, packed, interpret=False, length=SEQ):
    """The hidden states at the real positions; compiled for a backbone with recurrent blocks
    (eager, each operation of Qwen 3.5's forward compiles for its own shape: ~50 s on a cold
    compilation cache, 5 s compiled), eager for the others (compiling the interpreted splash
    kernel costs more than running it: 73 s eager, 164 s compiled for the fast tier's cases)."""
    ids, mask, seg = _inputs(packed, length)
    graphdef, state = nnx.split(bb)

    def forward(state):
        module = nnx.merge(graphdef, state)
        model.set_attention(module, implementation, platform="cpu", interpret=interpret)
        if implementation == "keras":
            return _kerashub_hidden(module, ids, mask, seg)
        return model.hidden_states(module, jnp.asarray(ids), jnp.asarray(mask),
                                   None if seg is None else jnp.asarray(seg))

    h = (forward if _packs(bb) else jax.jit(forward))(state)
    real = (seg if seg is not None else mask) != 0
    return np.asarray(h)[real]  # padding positions carry no loss and may differ


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_xla_path_equals_kerashub_attention(backbone, packed):
    """float32, 2e-5 of the states' scale: the hidden states at every real position (Gemma 4's
    unscaled attention of normed queries and keys rounds differently from its own einsums; in
    float64 the two agree exactly)."""
    if packed and _refused_packed(backbone, "xla"):
        return
    want = _hidden(backbone, "keras", packed)
    np.testing.assert_allclose(_hidden(backbone, "xla", packed), want, atol=_tolerance(want),
                               rtol=1e-5)


def _tolerance(want, relative=2e-5):
    return relative * max(1.0, float(np.abs(want).max()))


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_splash_kernel_equals_kerashub_attention(backbone, packed):
    """Pallas splash attention in interpret mode (its blocks need 128 positions)."""
    if packed and _refused_packed(backbone, "splash", interpret=True, length=128):
        return
    want = _hidden(backbone, "keras", packed, length=128)
    got = _hidden(backbone, "splash", packed, interpret=True, length=128)
    np.testing.assert_allclose(got, want, atol=_tolerance(want), rtol=1e-5)


@pytest.mark.slow
def test_gradients_equal_kerashub_attention(backbone):
    """The backward pass too (packed rows, the chunked path with chunks of 8 positions; padded
    rows where the family takes no packed rows)."""
    ids, mask, seg = _inputs(packed=_packs(backbone))
    rows = jnp.asarray(mask if seg is None else seg)
    graphdef, params, rest = model.split(backbone)

    def loss(params, implementation, chunk):
        module = nnx.merge(graphdef, params, rest)
        model.set_attention(module, implementation, platform="cpu")
        object.__setattr__(module, attention._ATTRIBUTE,
                           attention.Choice(attention.attention_of(module).implementation, chunk))
        if implementation == "keras":
            h = _kerashub_hidden(module, ids, mask, seg)
        else:
            h = model.hidden_states(module, jnp.asarray(ids), jnp.asarray(mask),
                                    None if seg is None else jnp.asarray(seg))
        return jnp.sum(jnp.where(rows[..., None] != 0, h, 0.0) ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))  # eager: minutes for a recurrent block
    want = grad(params, "keras", 512)
    for chunk in (512, 8):
        got = grad(params, "xla", chunk)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, atol=_tolerance(b, 2e-4), rtol=2e-4)


@pytest.mark.slow
def test_chunked_queries_equal_one_chunk():
    """Long sequences run a query chunk at a time, each against the keys it can see."""
    rng = np.random.default_rng(0)
    b, t, kv, g, h = 2, 40, 1, 3, 8
    q = jnp.asarray(rng.normal(size=(b, t, kv * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat([[1, 2, 3, 3]], b, 0).repeat(10, 1))
    for spec in (attention.LayerSpec(0.3), attention.LayerSpec(0.3, soft_cap=2.0, window=7)):
        one = attention.attend(q, k, v, seg, spec, attention.Choice("xla", chunk=64))
        for chunk in (8, 16, 13):
            many = attention.attend(q, k, v, seg, spec, attention.Choice("xla", chunk=chunk))
            np.testing.assert_allclose(many, one, atol=1e-6)


def _naive_sink_attention(q, k, v, seg, sinks, window):
    """softmax over [scores, the head's sink logit], the sink's probability dropped (KerasHub's
    ``GptOssAttention``), scores scaled by 1 / sqrt(H); keys repeated per group."""
    b, t, n, h = q.shape
    k, v = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqnh,bsnh->bnqs", q, k) / np.sqrt(h)
    pos = jnp.arange(t)
    ok = attention.allowed(seg, seg, pos, pos, window)[:, None]
    s = jnp.where(ok, s, -1e9)
    full = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:-1] + (1,))], -1)
    p = jax.nn.softmax(full, axis=-1)[..., :-1]
    return jnp.einsum("bnqs,bsnh->bqnh", p, v)


def test_attention_sinks_in_one_chunk_and_blocked_equal_a_softmax_with_one_more_key():
    """GPT-OSS's sinks: the ``xla`` formulation (one chunk) and the blocked path (tiles of 8)
    on packed rows with a window equal the naive softmax over the scores and the sink logit, values
    and gradients (w.r.t. q, k, v and the sinks)."""
    rng = np.random.default_rng(0)
    b, t, kv, g, h = 2, 24, 2, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, kv * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(kv * g,)) * 2, jnp.float32)
    seg = jnp.asarray(np.repeat([[1, 1, 2, 0], [1, 1, 1, 1]], 6, axis=1))
    real = np.asarray(seg) != 0

    def loss(fn, q, k, v, sinks):
        out = fn(q, k, v, sinks)
        return jnp.sum(jnp.where(seg[..., None, None] != 0, out, 0.0) ** 2), out

    def naive(q, k, v, sinks):
        return _naive_sink_attention(q, k, v, seg, sinks, window=5)

    def grads(fn):
        (_, out), grad = jax.jit(jax.value_and_grad(functools.partial(loss, fn), (0, 1, 2, 3),
                                                    has_aux=True))(q, k, v, sinks)
        return np.asarray(out)[real], grad

    want_out, want = grads(naive)
    for chunk in (64, 8):
        def ours(q, k, v, sinks, chunk=chunk):
            spec = attention.LayerSpec(1 / np.sqrt(h), window=5, scale_scores=True, sinks=sinks)
            return attention.attend(q, k, v, seg, spec, attention.Choice("xla", chunk=chunk))

        out, got = grads(ours)
        np.testing.assert_allclose(out, want_out, atol=2e-5)
        for a, w in zip(got, want):
            np.testing.assert_allclose(a, w, atol=2e-4, rtol=2e-4)
        assert float(jnp.abs(got[3]).max()) > 1e-3  # the sinks do get a gradient


def test_auto_resolves_per_platform_and_falls_back_by_rule():
    gemma2 = FAMILIES["gemma2"]()
    gemma = FAMILIES["gemma"]()
    assert attention.resolve(gemma, "auto", "cpu") == ("xla", "auto on cpu")
    assert attention.resolve(gemma, "keras", "cpu")[0] == "keras"
    # a kernel the platform does not have, or a feature the kernel cannot do: KerasHub's code
    impl, why = attention.resolve(gemma, "cudnn", "cpu")
    assert impl == "keras" and "needs a GPU" in why
    impl, why = attention.resolve(gemma2, "cudnn", "gpu")
    assert impl == "keras" and "soft cap" in why
    impl, why = attention.resolve(gemma, "cudnn", "gpu")  # float32
    assert impl == "keras" and "bfloat16" in why
    impl, why = attention.resolve(gemma, "splash", "tpu")  # head dim 8
    assert impl == "keras" and "multiple of 128" in why
    # auto takes the platform's kernel where it can, else the exact XLA formulation
    impl, why = attention.resolve(gemma2, "auto", "gpu")
    assert impl == "xla" and "soft cap" in why
    assert "attention: xla (auto on cpu)" == model.set_attention(gemma, "auto", platform="cpu")
    with pytest.raises(ValueError, match="--attention must be one of"):
        attention.resolve(gemma, "flash", "cpu")
    # GPT-OSS's attention sinks: the xla formulation, never splash or cuDNN
    gpt_oss = FAMILIES["gpt_oss"]()
    assert attention.resolve(gpt_oss, "auto", "cpu") == ("xla", "auto on cpu")
    assert attention.resolve(gpt_oss, "auto", "tpu", interpret=True) == (
        "xla", "auto on tpu; splash not used: splash attention has no attention sinks")
    assert attention.resolve(gpt_oss, "splash", "tpu", interpret=True) == (
        "keras", "splash not used: splash attention has no attention sinks")
    assert attention.resolve(gpt_oss, "cudnn", "gpu")[1].endswith("cuDNN has no attention sinks")


@pytest.mark.slow
def test_unknown_families_and_image_towers_keep_kerashub():
    """Only a backbone of a known family (``families``) takes a kernel here, never one whose
    attention merely looks familiar: PaliGemma's decoder is Gemma's, but its image prefix attends
    bidirectionally (its tower is ``vit_encoder``), which the kernels would silently drop."""
    bb = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                       intermediate_dim=32, max_sequence_length=32, dropout=0.0)
    impl, why = attention.resolve(bb, "auto", "cpu")
    assert impl == "keras" and why == "GPT2Backbone is not a known model family"
    assert model.set_attention(bb, "xla") == f"attention: keras ({why})"
    pali = keras_hub.models.PaliGemmaBackbone(
        vocabulary_size=64, image_size=16, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, vit_patch_size=8, vit_num_heads=2,
        vit_hidden_dim=16, vit_num_layers=1)
    assert attention.resolve(pali, "xla", "cpu")[0] == "keras"
    object.__setattr__(pali, "__class__", type("GemmaBackbone", (type(pali),), {}))
    assert attention.resolve(pali, "xla", "cpu") == (
        "keras", "image tokens attend bidirectionally or as a prefix (a vit_encoder)")


def test_no_t_by_t_mask_in_the_packed_forward():
    """Packed rows: no [T, T]-sized array (neither KerasHub's mask nor a bias) is built at a
    length past one chunk: the largest intermediate holds one chunk of scores."""
    bb = FAMILIES["gemma"]()
    t, chunk = 256, 32
    ids = jnp.ones((1, t), jnp.int32)
    seg = jnp.asarray(np.repeat(np.arange(1, 5), t // 4)[None], jnp.int32)
    model.set_attention(bb, "xla", platform="cpu", chunk=chunk)
    graphdef, state = nnx.split(bb)

    def fwd(state):
        return model.hidden_states(nnx.merge(graphdef, state), ids, seg != 0, seg)

    # every intermediate, inside loops, custom derivatives and remat too
    sizes = [int(np.prod(v.aval.shape)) for e in support.equations(jax.make_jaxpr(fwd)(state).jaxpr)
             for v in e.outvars if hasattr(v.aval, "shape")]
    assert max(sizes) < t * t, max(sizes)  # 4 heads x 32 x 32 tiles: 4096 < 65536
    model.set_attention(bb, "keras")


def test_long_sequence_memory_grows_linearly_not_with_t_squared():
    """The compiled forward + backward of the blocked path: its temporary memory at 4x the length
    is at most ~4x (O(T) plus one tile), far below one T x T float32 score matrix per head (what
    query chunks kept alive in the backward pass before: 1.9 GB at 8,192 tokens)."""
    spec = attention.LayerSpec(0.2)
    rng = np.random.default_rng(0)

    def temp_bytes(t):
        q = jnp.asarray(rng.normal(size=(1, t, 4, 16)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(1, t, 1, 16)), jnp.float32) for _ in range(2))
        seg = jnp.asarray(np.repeat(np.arange(1, 5), t // 4)[None], jnp.int32)
        choice = attention.Choice("xla", chunk=128)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
            attention.attend(q, k, v, seg, spec, choice) ** 2), (0, 1, 2)))
        return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(4096)
    assert large < 5 * small, (small, large)  # T^2 would be 16x
    assert large < 4096 * 4096 * 4, large  # less than one head's full score matrix


def test_packed_tiles_between_different_examples_are_skipped():
    """Blocked attention computes a tile only if some query and key in it can share a segment:
    four examples of two tiles each leave each example's own 2 x 2 tiles (the rest of the causal
    lower triangle is skipped); padding (segment 0) overlaps everything."""
    from nnx_posttrain.model import flash

    seg = jnp.asarray(np.repeat(np.arange(1, 5), 8)[None], jnp.int32)  # blocks of 4 positions
    needed = np.asarray(flash._needed(seg, 4))
    want = np.kron(np.eye(4, dtype=bool), np.ones((2, 2), bool))
    np.testing.assert_array_equal(needed, want)
    padded = np.asarray(flash._needed(seg.at[0, -2:].set(0), 4))
    assert padded[-1].all() and padded[:, -1].all()
