"""LoRA on a vision model's encoder, opt-in (``--lora.targets projector``, ``vision-attention``,
alone or beside the language model's targets): only the named layers get factors and only those
factors train (the rest of the tower stays frozen), zero-initialised factors leave the logits as
they were, the gradient reaches the chosen factors through the images, a merged model exports to
transformers with its logits, and what cannot work is refused by name."""

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_posttrain import config as config_lib
from nnx_posttrain import errors, inspection, model, runs
from support import jitted, tokenized_batch, vision_model

MODELS = ("gemma3_vision_micro", "gemma4_vision_micro")
PROJECTOR = "vision_output_encoder/vision_input_projection"


def picture(seed):
    return np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)


def batch_of(lm):
    """A row with an image and a text-only row."""
    return tokenized_batch(lm, [
        {"messages": [{"role": "user", "content": [{"type": "image"},
                                                   {"type": "text", "text": "How many?"}]},
                      {"role": "assistant", "content": "3"}], "images": [picture(0)]},
        {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                      {"role": "assistant", "content": "5"}]}], 40)


def built(name, targets):
    """``runs.build_model`` of ``name`` with LoRA rank 2 on ``targets``: (the run's model, the
    paths of its trainable variables)."""
    lora = config_lib.LoraConfig(rank=2, targets=targets)
    _, module = runs.build_model(runs.ModelSpec(name, "float32", 0, lora), echo=lambda _: None)
    trained = [v.path for _, v in nnx.to_flat_state(nnx.state(module, model.trainable_filter))]
    return module, trained


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_lora_on_the_projector_alone_trains_its_factors_only(name):
    """``--lora.targets projector``: the projection into the language model is the one adapted
    layer and its two factors the only trainable variables; with ``attention,projector`` the
    language model's attention too; ``vision-attention``: the tower's q / k / v / o (one
    encoder block: 4 layers), nothing of the language model."""
    _, trained = built(name, "projector")
    assert sorted(trained) == [f"{PROJECTOR}/lora_kernel_a", f"{PROJECTOR}/lora_kernel_b"]
    _, trained = built(name, "attention,projector")
    layers = {p.rsplit("/", 1)[0] for p in trained} - {PROJECTOR}
    assert len(trained) > 2 and all(
        p.startswith("decoder_block_") and p.split("/")[-1] in model.ATTENTION_LAYERS
        for p in layers)
    _, trained = built(name, "vision-attention")
    layers = {p.rsplit("/", 1)[0] for p in trained}
    assert len(layers) == 4 and all(p.startswith("image_encoder/encoder_block_0/") for p in layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_zero_initialised_factors_keep_the_logits_and_the_gradient_reaches_them(name):
    """LoRA on the projector and the tower's attention, B factors zero: the logits with images
    equal the model's without LoRA; the loss's gradient is non-zero in the B factors through the
    image row in every adapted layer (zero for the text-only row, which reads no image) and
    exists for no other variable."""
    lm = vision_model(name)
    b = batch_of(lm)
    with model.images(b["pixel_values"]):
        before = np.asarray(model.full_logits(lm.module, b["input_ids"], b["attention_mask"]))
    adapted = model.enable_lora(lm.module, 2, targets="projector,vision-attention")
    model.freeze_tower(lm.module)
    assert PROJECTOR in adapted and len(adapted) == 5
    with model.images(b["pixel_values"]):
        after = np.asarray(model.full_logits(lm.module, b["input_ids"], b["attention_mask"]))
    np.testing.assert_array_equal(after, before)
    graphdef, params, frozen = model.split(lm.module)

    @jax.jit
    @jax.grad
    def grad(p, ids, mask, pixels):
        module = nnx.merge(graphdef, p, frozen)
        with model.images(pixels):
            return -model.token_logprobs(module, ids, mask).sum()

    trained = {v.path for _, v in nnx.to_flat_state(params)}
    assert trained == {f"{p}/lora_kernel_{k}" for p in adapted for k in "ab"}
    for row, reads_image in ((0, True), (1, False)):
        rows = slice(row, row + 1)
        grads = {v.path: np.asarray(v.value) for _, v in nnx.to_flat_state(grad(
            params, b["input_ids"][rows], b["attention_mask"][rows], b["pixel_values"][rows]))}
        b_norms = [np.abs(g).sum() for p, g in grads.items() if p.endswith("lora_kernel_b")]
        assert len(b_norms) == 5  # every adapted layer's, the tower's attention included
        assert all(b_norm > 0 for b_norm in b_norms) if reads_image else not any(b_norms)


@pytest.mark.slow
def test_a_merged_vision_lora_exports_with_its_logits(tmp_path):
    """Gemma 4 with LoRA on the projector and the tower's attention (non-zero factors), merged
    (``inspection.merge_lora``) and exported: transformers' logits with an image equal the LoRA
    model's; the adapters alone have no verified PEFT form: refused by name."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from nnx_posttrain.export import hf as hf_export

    lm = vision_model("gemma4_vision_micro")
    model.enable_lora(lm.module, 2, targets="projector,vision-attention")
    rng = np.random.default_rng(0)
    for v in lm.module.weights:
        if "lora_kernel" in v.path:
            v.assign(rng.normal(0, 0.5, v.shape).astype("float32"))
    b = batch_of(lm)
    with pytest.raises(hf_export.ExportError, match="vision encoder"):
        hf_export.export_adapters(lm.module, tmp_path / "adapters", "float32", "base")
    with model.images(b["pixel_values"]):
        ours = np.asarray(jitted(model.full_logits, lm.module)(b["input_ids"],
                                                             b["attention_mask"]))
    assert len(inspection.merge_lora(lm.module)) == 5
    hf_export.export_model(lm.task, tmp_path / "merged", "float32", echo=lambda _: None)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(b["input_ids"][:1], dtype=torch.long),
                    attention_mask=torch.tensor(b["attention_mask"][:1]),
                    pixel_values=torch.tensor(b["pixel_values"][0, :1, :, :-2]),
                    image_position_ids=torch.tensor(b["pixel_values"][0, :1, :, -2:]).long(),
                    mm_token_type_ids=torch.tensor(b["vision_mask"][:1]).long()).logits.numpy()
    real = b["attention_mask"][0].astype(bool)
    np.testing.assert_allclose(theirs[0][real], ours[0][real], atol=1e-5, rtol=0)


def test_vision_targets_are_refused_where_they_cannot_work(micro):
    """A text model has no vision encoder to adapt; ``--train-vision`` trains the whole tower,
    so LoRA on it beside that is refused."""
    with pytest.raises(errors.ConfigError, match="has no vision encoder"):
        model.enable_lora(micro.module, 2, targets="attention,projector")
    lm = vision_model("gemma3_vision_micro")
    model.enable_lora(lm.module, 2, targets="projector")
    with pytest.raises(errors.ConfigError, match="--train-vision"):
        model.freeze_tower(lm.module, train=True)


@pytest.mark.slow  # 10-30 s: the full suite runs it
def test_a_dpo_run_with_lora_on_the_projector_alone_trains_loads_and_exports(tmp_path):
    """``dpo --lora.targets projector`` on Gemma 4: the reference is the model with LoRA off (the
    first loss is log 2), two steps train the projector's factors only, the run loads back with
    them, and ``export --format hf`` merges them into transformers' layout."""
    import json

    from PIL import Image

    from nnx_posttrain import export
    from nnx_posttrain.tasks import shapes
    from support import records, train_run

    rows = []
    for i in range(4):
        Image.fromarray(picture(i)).save(tmp_path / f"{i}.png")
        rows.append(dict(shapes.preference_record(i), images=[f"{i}.png"]))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_run("dpo", "--model", "gemma4_vision_micro", "--data", tmp_path / "pairs.jsonl",
              "--batching.max-length", 40, "--steps", 2, "--log-every", 1, "--eval.every", 0,
              "--eval.exact-match", 0, "--batching.batch-size", 2, "--batching.grad-accum", 1,
              "--checkpoint.every", 2, "--optim.schedule", "constant", "--optim.warmup-steps", 0,
              "--optim.learning-rate", "1e-2", "--lora.rank", 2, "--lora.targets", "projector",
              "--run-dir", tmp_path / "run", echo=lambda _: None)
    logged = records(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2]
    assert logged[0]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    loaded = runs.load(tmp_path / "run", echo=lambda _: None)
    factors = {v.path: np.asarray(v.value) for v in loaded.module.weights if "lora" in v.path}
    assert sorted(factors) == [f"{PROJECTOR}/lora_kernel_a", f"{PROJECTOR}/lora_kernel_b"]
    assert np.abs(factors[f"{PROJECTOR}/lora_kernel_b"]).max() > 0  # trained from zero
    said = []
    files = export.export(tmp_path / "run", tmp_path / "hf", target=export.Target("hf"),
                          echo=said.append)
    assert "model.safetensors" in {p.name for p in files}
    assert any("1 LoRA layers merged" in line for line in said)
    assert any("no image processor files" in line for line in said)  # the micro's 4 soft tokens
