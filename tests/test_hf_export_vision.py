"""Gemma 4 with its vision encoder exported to Hugging Face (``families.gemma4_vision``): the
export loads as transformers 5.24's ``Gemma4ForConditionalGeneration`` with every tensor read and
gives our logits on the same token ids and pixel values (one image, two images, text only); a
deliberately mis-mapped tensor of the tower fails that comparison. Its image processor files
(``families.image_processors``) load with ``AutoImageProcessor`` and read a picture as our
pipeline does.

The logits are compared from the same pixel values (our pipeline's patches and positions):
KerasHub's converter and transformers' image processor resize with different bicubic kernels.
The pictures are square, so each one's pooled grid fills the image's soft tokens (transformers
gives an image only its real cells; KerasHub pads every image to ``max_soft_tokens``)."""

import json

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import numpy as np
import pytest

from nnx_posttrain import model
from nnx_posttrain.export import hf as hf_export
from nnx_posttrain.families import gemma4_vision as rules_module

import support

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NAME = "gemma4_vision_micro"
LENGTH = 48
TOLERANCE = 1e-5  # measured: 1.0e-6 (float32, CPU)


def randomized(module, seed=0):
    """Weights of a visible scale; the clipped linears' bounds finite (+-1 on the inputs, +-1.5 on
    the outputs, each its own), so a mis-mapped bound changes the tower's output too."""
    rng = np.random.default_rng(seed)
    for v in module.weights:
        if v.path.endswith(("_min", "_max")):
            bound = (1.0 if "input" in v.path else 1.5) * rng.uniform(0.8, 1.2)
            v.assign(np.float32(-bound if v.path.endswith("_min") else bound))
        else:
            v.assign(rng.normal(0.0, 0.3 if len(v.shape) > 1 else 0.2, v.shape).astype("float32"))




@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the randomized micro, a batch of a one-image row, a two-image row and a text row, its
    export)."""
    lm = support.vision_model(NAME)
    randomized(lm.module)
    batch = support.tokenized_batch(lm, support.one_two_and_no_image_rows(), LENGTH)
    assert list(batch["image_count"]) == [1, 2, 0]
    directory = tmp_path_factory.mktemp("gemma4_vision")
    hf_export.export_model(lm.task, directory, "float32", lm.chat_format)
    return lm, batch, directory


def hf_logits(directory, batch, pixel_values=None):
    """transformers' logits of a batch of our pipeline: its real images' patches and positions
    (``image_count`` of each row), the placeholder tokens marked by ``mm_token_type_ids`` as
    ``Gemma4Processor`` marks them."""
    hf, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    pixels = batch["pixel_values"] if pixel_values is None else pixel_values
    images = [pixels[row, :count] for row, count in enumerate(batch["image_count"])]
    images = np.concatenate(images) if any(len(i) for i in images) else None
    inputs = dict(input_ids=torch.tensor(batch["input_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(batch["attention_mask"]),
                  mm_token_type_ids=torch.tensor(batch["vision_mask"], dtype=torch.long))
    if images is not None:
        inputs.update(pixel_values=torch.tensor(images[..., :-2]),
                      image_position_ids=torch.tensor(images[..., -2:].astype(np.int64)))
    with torch.no_grad():
        return hf(**inputs).logits.numpy()


@pytest.mark.slow
def test_gemma4_vision_export_gives_transformers_logits_with_images(exported):
    """``Gemma4ForConditionalGeneration`` (every tensor read, none left over) gives our logits
    (``model.full_logits`` with the images) on a row with one image, one with two and a text-only
    row, and on a text-only batch without pixel values; swapping the two-image row's pictures
    changes its logits (the images are read)."""
    lm, batch, directory = exported
    config = json.loads((directory / "config.json").read_text())
    tok = lm.task.preprocessor.tokenizer
    assert config["model_type"] == "gemma4" and config["text_config"]["num_kv_shared_layers"] == 2
    assert (config["image_token_id"], config["boi_token_id"], config["eoi_token_id"]) == (
        tok.image_placeholder_id, tok.start_of_image_token_id, tok.end_of_image_token_id)
    with model.images(batch["pixel_values"]):
        ours = np.asarray(support.jitted(model.full_logits, lm.module)(
            batch["input_ids"], batch["attention_mask"]))
    real = batch["attention_mask"].astype(bool)
    theirs = hf_logits(directory, batch)
    assert np.abs(ours).max() > 1.0
    np.testing.assert_allclose(theirs[real], ours[real], atol=TOLERANCE, rtol=0)
    swapped = batch["pixel_values"].copy()
    swapped[1] = swapped[1, ::-1]
    other = hf_logits(directory, batch, swapped)
    assert np.abs(other[1] - theirs[1])[real[1]].max() > 1e-2
    text = {k: v[2:] for k, v in batch.items()}
    np.testing.assert_allclose(hf_logits(directory, text)[0][real[2]], ours[2][real[2]],
                               atol=TOLERANCE, rtol=0)


@pytest.mark.slow
def test_a_standardizing_tower_exports_with_its_logits(tmp_path):
    """A tower that standardizes its pooled output (KerasHub's ``standardize``, transformers'
    ``std_bias`` / ``std_scale``, as the larger Gemma 4 checkpoints have) exports with our logits
    on a one-image row."""
    from nnx_posttrain import tasks
    from nnx_posttrain.tasks import tokenizer

    name = "gemma4_vision_standardize_micro"
    if name not in model.TINY:
        dims = dict(tasks.VISION_MODELS[NAME])
        model.register_builtin(name, dict(dims, vision=dict(dims["vision"], standardize=True)),
                               tokenizer.gemma4_vision_proto)
    lm = support.vision_model(name)
    randomized(lm.module, seed=1)
    assert any(v.path.endswith("std_scale") for v in lm.module.weights)
    batch = support.tokenized_batch(
        lm, [{"messages": support.ask("How many shapes?", "3"), "images": [support.picture(0)]}],
        LENGTH)
    hf_export.export_model(lm.task, tmp_path, "float32", echo=lambda _: None)
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]["standardize"]
    with model.images(batch["pixel_values"]):
        ours = np.asarray(support.jitted(model.full_logits, lm.module)(
            batch["input_ids"], batch["attention_mask"]))
    real = batch["attention_mask"].astype(bool)
    np.testing.assert_allclose(hf_logits(tmp_path, batch)[real], ours[real], atol=TOLERANCE,
                               rtol=0)


@pytest.mark.parametrize("first, second", [
    ("self_attn.q_proj.linear.weight", "self_attn.k_proj.linear.weight"),
    ("mlp.up_proj.input_max", "mlp.up_proj.output_max"),
])
@pytest.mark.slow
def test_a_mis_mapped_vision_tensor_changes_the_logits(exported, monkeypatch, tmp_path,
                                                       first, second):
    """The comparison above sees the tower's mapping: two of its tensors' names swapped (the
    attention's query and key kernels; a clipped linear's input and output bounds), the export
    still loads and its logits on the image rows differ from ours by far more than the
    tolerance."""
    lm, batch, _ = exported
    swap = {first: second, second: first}

    def renamed(name):
        head, _, tail = name.partition(".encoder.layers.{}.")  # the rules' name templates
        return f"{head}.encoder.layers.{{}}.{swap.get(tail, tail)}" if tail else name

    monkeypatch.setattr(rules_module, "VISION_RULES",
                        [(p, renamed(n), layout) for p, n, layout in rules_module.VISION_RULES])
    hf_export.export_model(lm.task, tmp_path / "wrong", "float32")
    with model.images(batch["pixel_values"]):
        ours = np.asarray(support.jitted(model.full_logits, lm.module)(
            batch["input_ids"], batch["attention_mask"]))
    theirs = hf_logits(tmp_path / "wrong", batch)
    real = batch["attention_mask"].astype(bool)
    assert np.abs(theirs[:2] - ours[:2])[real[:2]].max() > 100 * TOLERANCE


def test_gemma4_micro_export_says_why_it_has_no_image_processor(tmp_path):
    """The micro's 4 soft tokens an image are none of those transformers' Gemma4ImageProcessor
    takes: its export writes no image processor files and says so."""
    lm = support.vision_model(NAME)
    said = []
    files = hf_export.export_model(lm.task, tmp_path, "float32", echo=said.append)
    assert not {"preprocessor_config.json", "processor_config.json"} & {p.name for p in files}
    assert any("4 soft tokens an image" in line for line in said)


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    """(the image spec, the export's processor and tokenizer files) of the micro's tokenizer with
    a converter of 70 soft tokens an image (transformers' smallest), 4-pixel patches pooled 2 x 2:
    a picture of 56 x 80 pixels is its grid exactly."""
    import keras_hub

    from nnx_posttrain import data
    from nnx_posttrain.model import vision

    lm = support.vision_model(NAME)
    converter = keras_hub.layers.Gemma4ImageConverter(patch_size=4, max_soft_tokens=70,
                                                      pooling_kernel_size=2, scale=1 / 255)
    with vision.preprocessor_without_tensorflow():
        pre = keras_hub.models.Gemma4CausalLMPreprocessor(
            lm.task.preprocessor.tokenizer, converter, num_vision_tokens_per_image=70,
            max_images_per_prompt=1)
    directory = tmp_path_factory.mktemp("gemma4_processor")
    task = type("Task", (), {"backbone": lm.module, "preprocessor": pre})()
    hf_export.export_processor(task, directory)
    hf_export.export_tokenizer(pre.tokenizer, directory)
    return data.ImageSpec.from_preprocessor(pre), directory


@pytest.mark.slow
def test_gemma4_image_processor_reads_images_as_ours(processor_dir, monkeypatch):
    """transformers' ``AutoImageProcessor`` loads the export's ``preprocessor_config.json``
    offline as ``Gemma4ImageProcessor``: a picture of its grid's size gives our pipeline's
    patches (rescaled to [0, 1]) and positions; a picture it resizes gives our positions and soft
    tokens (KerasHub's bicubic differs from transformers': docs/vision.md); the tokenizer files
    name the image tokens as ``Gemma4Processor`` reads them."""
    spec, directory = processor_dir
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    image_processor = transformers.AutoImageProcessor.from_pretrained(str(directory))
    assert type(image_processor).__name__.startswith("Gemma4ImageProcessor")
    for shape, tokens in (((56, 80), 70), ((30, 41), 63)):
        image = np.random.default_rng(0).integers(0, 256, shape + (3,), dtype=np.uint8)
        theirs = image_processor(images=[image], return_tensors="np")
        ours = spec.pixels([image])[0]
        assert theirs["num_soft_tokens_per_image"] == [tokens]
        np.testing.assert_array_equal(theirs["image_position_ids"][0], ours[:, -2:])
        if shape == (56, 80):  # not resized
            np.testing.assert_allclose(theirs["pixel_values"][0], ours[:, :-2], atol=1e-6, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert (tok.image_token, tok.boi_token, tok.eoi_token) == (spec.placeholder, spec.start,
                                                               spec.end)

