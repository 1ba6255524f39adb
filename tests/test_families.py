"""One family, one place (``nnx_posttrain.families``): every family has every part, and each part
fits the family's own tiny backbone (the attention reader reads every block, the sharding rules
and the export names cover every variable, the LoRA targets name real layers, the decoding
keywords are the blocks' own). A part a family does not have is ``Unsupported`` with a reason."""

import contextlib
import inspect
import re

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import jax
import jax.numpy as jnp
import keras_hub
import pytest

import support
from nnx_posttrain import chat, families, model, sharding
from nnx_posttrain.families import Unsupported
from nnx_posttrain.model import attention
from tools import make_preset

FAMILIES = families.FAMILIES
PARTS = ("backbone", "classes", "chat_format", "attention", "sharding", "lora", "export",
         "decoding", "context_length", "hf_model_types", "short_names", "tokenizer", "presets",
         "tiny")


def test_the_families():
    """The list itself: the families this package supports (a new one is a new entry)."""
    assert list(FAMILIES) == ["gemma", "gemma3", "gemma4", "llama2", "llama3", "mistral", "qwen2", "qwen3",
                              "qwen3_moe", "mixtral", "gpt_oss", "phi3", "smollm3", "qwen3_5",
                              "qwen3_5_moe"]
    assert len({f.backbone for f in FAMILIES.values()}) == len(FAMILIES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_has_every_part(name):
    family = FAMILIES[name]
    for part in PARTS:
        value = getattr(family, part)
        assert value is not None, f"{name}: no {part}"
        if isinstance(value, Unsupported):
            assert len(value.reason) > 20, f"{name}: {part} unsupported without a reason"
    assert family.attention and family.sharding and family.tiny, name
    assert set(family.lora) == {"attention", "mlp"} and family.lora["attention"], name
    assert family.lora["mlp"] or family.moe is not None, name  # no MLP layers: experts only
    if family.moe is not None:
        assert family.moe.router and family.moe.top_k and family.moe.aux_coef, name
    for cls in (family.backbone, *family.classes):
        assert hasattr(keras_hub.models, cls), f"{name}: keras_hub.models.{cls}"
    if isinstance(family.chat_format, str):
        assert family.chat_format in chat.FORMATS, name
    assert family.tokenizer in make_preset.TOKENIZERS, name
    backbone = getattr(keras_hub.models, family.backbone)
    accepted = set(inspect.signature(backbone.__init__).parameters)
    presets = {} if isinstance(family.presets, Unsupported) else family.presets
    for like, preset in presets.items():
        assert set(preset.dims) <= accepted, (like, set(preset.dims) - accepted)
    for short, handle in family.short_names.items():
        assert handle in keras_hub.models.CausalLM.presets, (name, short, handle)
    assert family.context_length >= 4096


def test_shared_attention_classes_are_read_alike_and_names_are_unique():
    readers = {}
    for family in FAMILIES.values():
        for cls, reader in family.attention.items():
            assert readers.setdefault(cls, reader) is reader, cls
    for table in (families.short_names(), families.presets()):
        lists = [k for f in FAMILIES.values() for k in getattr(
            f, "short_names" if table is families.short_names() else "presets")]
        assert len(lists) == len(set(lists))


def _own_variant(variant):
    return next(f for f in FAMILIES.values() if variant in f.tiny)


@pytest.fixture(scope="module", params=list(support.TINY_FAMILIES))
def tiny(request):
    return _own_variant(request.param), support.TINY_FAMILIES[request.param]()


@pytest.mark.slow
def test_the_attention_reader_reads_every_block(tiny):
    family, backbone = tiny
    assert families.of(backbone) is family
    for block in model.decoder_blocks(backbone):
        layer = attention.attention_layer(block)
        if layer is None:  # a recurrent block (Qwen 3.5's Gated DeltaNet): its own code
            assert type(attention.recurrent_layer(block)).__name__ in family.recurrent
            assert attention.layer_spec(block) is None
            continue
        assert type(layer).__name__ in family.attention
        spec = attention.layer_spec(block)
        if isinstance(spec, str):  # a feature no kernel computes: KerasHub's attention, saying so
            assert attention.resolve(backbone, "xla") == ("keras", spec)
        else:
            assert isinstance(spec, families.LayerSpec)


def _matching(rules, path):
    return [axes for pattern, axes in rules if re.search(pattern, path)]


def test_every_variable_is_sharded_by_its_own_familys_rules(tiny):
    """No other family's rule matches a variable (the rules are anchored on each family's
    paths), and every matrix of the decoder blocks has a rule."""
    family, backbone = tiny
    own = sharding.COMMON_RULES + list(family.sharding) + sharding.HEAD_RULES
    for v in backbone.weights:
        path = v.path
        assert _matching(sharding.RULES, path)[:1] == _matching(own, path)[:1], path
        if len(v.shape) >= 2 and "embedding" not in path:
            assert _matching(own, path), f"{family.name}: no sharding rule for {path}"


def test_lora_targets_name_layers_of_the_family(tiny):
    """Layers of the family, or a mixture of experts' stacked kernels (``MoE.expert_layer``,
    each a variable of the tiny model's experts layers); a mixture of experts' ``mlp`` may name
    dense MLP layers that only some of its configurations have (Qwen3-MoE's mlp_only_layers,
    Gemma 4's experts beside its dense MLP)."""
    from nnx_posttrain.model import expert_lora

    family, backbone = tiny
    names = {layer.name for layer in backbone._flatten_layers(include_self=False)}
    if expert_lora.expert_layers(backbone):
        kernels = set(expert_lora.kernel_names(backbone))
        assert kernels <= {v.path.rsplit("/", 1)[-1] for v in backbone.weights}, family.name
        names |= kernels
    for targets in ("attention", "mlp"):
        if isinstance(family.lora[targets], Unsupported):
            continue
        if targets == "mlp" and family.moe is not None:
            assert set(family.lora[targets]) & names, family.name
        else:
            assert set(family.lora[targets]) <= names, (family.name, targets)


def test_export_names_cover_every_variable(tiny):
    from nnx_posttrain.export import hf

    family, backbone = tiny
    if isinstance(family.export, Unsupported):
        with pytest.raises(hf.ExportError, match=re.escape(family.export.reason)):
            hf.weight_map(backbone)
        return
    mapping = hf.weight_map(backbone)
    # every variable has its tensors (stacked experts: one per expert and part; Gemma 4's fused
    # gate | up: one tensor of two variables), or transformers derives it from the config
    # (SmolLM3's rotary frequencies)
    mapped = {id(x) for v, _ in mapping.values() for x in (v if isinstance(v, tuple) else (v,))}
    derived = {id(v) for v in hf.derived_variables(backbone)}
    assert not mapped & derived and mapped | derived == {id(v) for v in backbone.weights}
    assert all(v.path.endswith("rotary_emb/inv_freq") for v in hf.derived_variables(backbone))


def test_decoding_keywords_are_the_blocks_own(tiny):
    family, backbone = tiny
    if isinstance(family.decoding, Unsupported):  # the sampler refuses it, saying why
        from nnx_posttrain.sampling import sampler

        with pytest.raises(NotImplementedError, match=re.escape(family.decoding.reason)):
            sampler._family(backbone)
        return
    decoding = family.decoding
    call = type(backbone.transformer_layers[0]).call
    params = inspect.signature(call).parameters
    if not {decoding.cache_kw, decoding.index_kw} <= set(params):  # SmolLM3: read from **kwargs
        assert any(p.kind is p.VAR_KEYWORD for p in params.values()), family.name
        source = inspect.getsource(call)
        for kw in (decoding.cache_kw, decoding.index_kw):
            assert re.search(rf'kwargs\.get\(\s*"{kw}"', source), (family.name, kw)
    # Gemma 4: each block's per-layer input, and a KV-shared block reads an earlier block that
    # has its own cache, by the block's own keyword
    from nnx_posttrain.sampling import capacity, passes

    blocks = model.decoder_blocks(backbone)
    layouts = capacity.block_layouts(backbone)
    for i, (block, layout) in enumerate(zip(blocks, layouts)):
        source = decoding.kv_source(block) if decoding.kv_source else None
        recurrent = attention.recurrent_layer(block) is not None  # Qwen 3.5: a state, no keys
        assert (layout is None) == (source is not None or recurrent), (i, layout, source)
        if recurrent:
            assert decoding.state and decoding.state_step, family.name
        if source is not None:
            assert source < i and layouts[source] is not None and decoding.shared_kw in params
    if decoding.layer_inputs:
        ids = jnp.ones((1, 3), jnp.int32)
        extra = decoding.layer_inputs(backbone, ids, backbone.token_embedding(ids))
        assert len(extra) == len(blocks) and all(set(kw) <= set(params) for kw in extra)
    # the memory estimate is the cache the sampler allocates (and one position's logits)
    cache = sum(a.nbytes for a in jax.tree.leaves(passes.empty_cache(backbone, 2, 5)))
    assert capacity.generation_bytes(backbone, 2, 3, 2) == cache + 4 * 2 * backbone.vocabulary_size


def test_variable_paths_are_unique_per_layer(tiny):
    """Paths key the sharding rules, ``--init-from`` and the exports: no two variables share one
    (SmolLM3's attention layers create their output projections outside their block's scope:
    ``families.prepare`` puts them under it)."""
    family, backbone = tiny
    paths = [v.path for v in backbone.weights]
    assert len(paths) == len(set(paths)), (family.name, sorted(p for p in paths
                                                               if paths.count(p) > 1)[:4])
    from flax import nnx

    assert len(model.named_variables(nnx.state(backbone))) == len(nnx.to_flat_state(
        nnx.state(backbone)))


def test_smollm3_no_rope_layers_and_repair():
    """SmolLM3's tiny configuration has a NoPE layer, and the repair is idempotent."""
    backbone = support.TINY_FAMILIES["smollm3"]()
    assert [b.self_attn.use_rope for b in backbone.transformer_layers] == [True, False]
    before = [v.path for v in backbone.weights]
    assert "transformer_layer_1/self_attn/o_proj/kernel" in before
    assert [v.path for v in families.prepare(backbone).weights] == before


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_smollm3_repaired_paths_survive_a_jitted_step(lora):
    """The paths ``prepare`` gives are the variables' NNX metadata, not an attribute a pass
    through JAX drops: after a jitted gradient step (the training loop's split / merge form)
    the state's paths, which key checkpoints and ``--init-from``, are still one per variable,
    and so are the merged module's; LoRA factors of the output projections (added after the
    repair) are under their block too."""
    from flax import nnx

    backbone = support.TINY_FAMILIES["smollm3"]()
    if lora:
        model.enable_lora(backbone, 2, targets="all-linear")
    before = [v.path for v in backbone.weights]
    assert len(set(before)) == len(before)
    graphdef, params, frozen = model.split(backbone)
    ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64

    @jax.jit
    def step(params, frozen):
        def loss(p):
            return model.full_logits(nnx.merge(graphdef, p, frozen), ids, jnp.ones_like(ids)).sum()

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), frozen

    params, frozen = step(params, frozen)
    paths = [*model.named_variables(params), *model.named_variables(frozen)]
    assert len(paths) == len(nnx.to_flat_state(params)) + len(nnx.to_flat_state(frozen))
    assert sorted(paths) == sorted(before)
    merged = nnx.merge(graphdef, params, frozen)
    assert sorted(v.path for v in merged.weights) == sorted(before)
    o_proj = "transformer_layer_1/self_attn/o_proj/" + ("lora_kernel_a" if lora else "kernel")
    assert o_proj in paths


@pytest.mark.slow
def test_smollm3_is_built_in_the_dtype_it_is_given(tmp_path):
    """SmolLM3's backbone builds its layers in Keras' global policy, not its ``dtype``: the
    package builds it with the global one set (``families.building``), when it loads a preset
    and when ``tools.make_preset`` writes one; the global policy is put back."""
    import keras

    before = keras.config.dtype_policy().name
    task = make_preset._task("smollm3", FAMILIES["smollm3"].tiny["smollm3"], 1024, "bfloat16")
    trained = {v.dtype for v in task.backbone.trainable_weights}
    assert trained == {"bfloat16"} and keras.config.dtype_policy().name == before
    task.save_to_preset(str(tmp_path))
    lm = model.load(str(tmp_path), dtype="bfloat16-params")
    assert {v.dtype for v in lm.module.trainable_weights} == {"bfloat16"}
    assert keras.config.dtype_policy().name == before


@pytest.mark.slow
def test_smollm3_attention_call_is_kerashubs_without_mutating_the_layer():
    """``Family.attention_call``: KerasHub's output (its own call, eagerly), and it runs inside a
    nested trace (here ``jax.checkpoint``, as ``--remat blocks`` and the sampler's loop), where
    KerasHub's own call, assigning ``self.training``, is refused by NNX."""
    import flax

    from flax import nnx

    bb = support.tiny_backbone("smollm3")
    ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
    inputs = {"token_ids": ids, "padding_mask": jnp.ones_like(ids)}
    reference = bb(inputs)
    graphdef, state = nnx.split(bb)

    def forward(state, own):
        m = nnx.merge(graphdef, state)
        with attention.own_calls(m) if own else contextlib.nullcontext():
            return jax.checkpoint(lambda x: m(dict(inputs, token_ids=x)))(ids)

    out = jax.jit(forward, static_argnums=1)(state, True)
    assert jnp.allclose(out, reference, atol=1e-5)
    with pytest.raises(flax.errors.TraceContextError, match="Cannot mutate 'SmolLM3Attention'"):
        jax.jit(forward, static_argnums=1)(state, False)


def test_qwen3_5_recurrent_blocks_take_no_shared_prompt_rows():
    """Qwen 3.5's Gated DeltaNet state would carry the chosen completion into the rejected one:
    no shared-prompt row is built (packed rows are refused: tests/test_attention.py)."""
    from nnx_posttrain.algorithms import shared_prompt

    backbone = support.TINY_FAMILIES["qwen3_5"]()
    assert [attention.layer_spec(b) is None for b in model.decoder_blocks(backbone)] == [True, False]
    assert shared_prompt.longest_row(backbone) == 0
    assert shared_prompt.longest_row(support.TINY_FAMILIES["qwen3"]()) != 0


def test_qwen3_5_chat_formats_are_its_published_templates_by_size():
    """Qwen3.5-0.8B and 2B (hidden 1,024 and 2,048) ship the template whose generation prompt
    closes an empty think block, 4B and larger and the 35B-A3B MoE the one that opens it."""
    dense, moe = FAMILIES["qwen3_5"], FAMILIES["qwen3_5_moe"]
    small = type("B", (), {"hidden_dim": 2048})()
    assert dense.format_of(small) == "qwen3.5-nothink"
    assert dense.format_of(type("B", (), {"hidden_dim": 2560})()) == "qwen3.5"
    assert dense.format_of("Qwen3_5Backbone") == "qwen3.5"  # by class name: the larger sizes'
    assert moe.format_of(small) == "qwen3.5"
    assert chat.hf_template("qwen3.5-nothink").splitlines()[0].endswith("-#}")
