"""Qwen 3.5 with its vision encoder exported to Hugging Face (``families.qwen3_5_vision``): the
export loads as transformers 5.24's ``Qwen3_5ForConditionalGeneration`` with every tensor read
and gives our logits on the same token ids and patches (one image, two images, text only), its
multimodal rotary positions computed by transformers itself from ``mm_token_type_ids``; a
deliberately mis-mapped tensor of the tower fails that comparison.

The logits are compared from the same patches, and from transformers' own image processor's:
KerasHub's converter lists an image's patches row by row, transformers' ``Qwen2VLImageProcessor``
by 2 x 2 merge window (the order both encoders read); our pipeline reorders the converter's list
by window, so its patches are the processor's
(``test_our_patches_are_transformers_image_processors``)."""

import json

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import numpy as np
import pytest

from nnx_posttrain.export import hf as hf_export
from nnx_posttrain.families import qwen3_5_vision as rules_module

import support

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NAME = "qwen3_5_vision_micro"
LENGTH = 64
TOLERANCE = 1e-4  # measured: 2.1e-5 (float32, CPU; logits up to ~5), as the text export's 1e-4


def randomized(module, seed=0):
    rng = np.random.default_rng(seed)
    for v in module.weights:
        v.assign(rng.normal(0.0, 0.3 if len(v.shape) > 1 else 0.2, v.shape).astype("float32"))




@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the randomized micro, a batch of a one-image row, a two-image row and a text row, its
    export, our logits of the batch)."""
    lm = support.vision_model(NAME)
    randomized(lm.module)
    batch = support.tokenized_batch(lm, support.one_two_and_no_image_rows(), LENGTH)
    assert list(batch["image_count"]) == [1, 2, 0]
    directory = tmp_path_factory.mktemp("qwen3_5_vision")
    hf_export.export_model(lm.task, directory, "float32", lm.chat_format, echo=lambda _: None)
    return lm, batch, directory, our_logits(lm, batch)


def our_logits(lm, batch):
    """``model.full_logits`` of the batch with its images, as one jitted program."""
    return np.asarray(support.jitted(support.image_logits, lm.module)(
        batch["input_ids"], batch["attention_mask"], batch["pixel_values"]))


def processed(pictures):
    """transformers' ``Qwen2VLImageProcessor`` at the micro's patches (4 pixels, merged 2 x 2,
    2 frames) and rescaling (mean and std 0.5), pictures of the model's size (no resize):
    (pixel values [patches, 3 x T x p x p], grids)."""
    processor = transformers.Qwen2VLImageProcessor(
        do_resize=False, patch_size=4, merge_size=2, temporal_patch_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out = processor(images=list(pictures), return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def hf_logits(directory, batch, pixel_values=None, hf_pixels=None):
    """transformers' logits of a batch of our pipeline: its real images' patches as
    ``Qwen3_5VisionPatchEmbed`` reads them ([patches, 3 x T x p x p]; or ``hf_pixels``, the
    image processor's (pixel values, grids) of the batch's pictures), their grids, the
    placeholder tokens marked by ``mm_token_type_ids`` (1: image) as the processor marks them."""
    hf, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    pixels = batch["pixel_values"] if pixel_values is None else pixel_values
    images = [pixels[row, :count] for row, count in enumerate(batch["image_count"])]
    inputs = dict(input_ids=torch.tensor(batch["input_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(batch["attention_mask"]),
                  mm_token_type_ids=torch.tensor(batch["vision_mask"], dtype=torch.long))
    if hf_pixels is not None:
        inputs.update(pixel_values=torch.tensor(hf_pixels[0]),
                      image_grid_thw=torch.tensor(hf_pixels[1]))
    elif any(len(i) for i in images):
        patches = np.concatenate([i for i in images if len(i)])  # [images, N, T, p, p, 3]
        n = patches.shape[1]
        flat = np.transpose(patches, (0, 1, 5, 2, 3, 4)).reshape(len(patches) * n, -1)
        side = int(np.sqrt(n))
        inputs.update(pixel_values=torch.tensor(flat),
                      image_grid_thw=torch.tensor([[1, side, side]] * len(patches)))
    with torch.no_grad():
        return hf(**inputs).logits.numpy()


@pytest.mark.slow
def test_qwen3_5_vision_export_gives_transformers_logits_with_images(exported):
    """``Qwen3_5ForConditionalGeneration`` (every tensor read, none left over) gives our logits
    (``model.full_logits`` with the images, M-RoPE positions ours, transformers' its own) on a
    row with one image, one with two and a text-only row, and on a text-only batch without
    pixel values; transformers' image processor on the same pictures gives transformers those
    logits too (its patches are ours); swapping the two-image row's pictures changes its
    logits."""
    lm, batch, directory, ours = exported
    config = json.loads((directory / "config.json").read_text())
    tok = lm.task.preprocessor.tokenizer
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]
    assert (config["image_token_id"], config["vision_start_token_id"],
            config["vision_end_token_id"]) == (tok.image_token_id, tok.vision_start_token_id,
                                               tok.vision_end_token_id)
    real = batch["attention_mask"].astype(bool)
    theirs = hf_logits(directory, batch)
    assert np.abs(ours).max() > 1.0
    print("max |ours - transformers'|:", np.abs(theirs[real] - ours[real]).max())
    np.testing.assert_allclose(theirs[real], ours[real], atol=TOLERANCE, rtol=0)
    end_to_end = hf_logits(directory, batch,
                           hf_pixels=processed(support.picture(i) for i in range(3)))
    print("max |ours - transformers' from its processor|:",
          np.abs(end_to_end[real] - ours[real]).max())
    np.testing.assert_allclose(end_to_end[real], ours[real], atol=TOLERANCE, rtol=0)
    swapped = batch["pixel_values"].copy()
    swapped[1, :2] = swapped[1, 1::-1]
    other = hf_logits(directory, batch, swapped)
    assert np.abs(other[1] - theirs[1])[real[1]].max() > 1e-2
    text = {k: v[2:] for k, v in batch.items()}
    np.testing.assert_allclose(hf_logits(directory, text)[0][real[2]], ours[2][real[2]],
                               atol=TOLERANCE, rtol=0)


def _swapped_norms(rules):
    swap = {"norm1.weight": "norm2.weight", "norm2.weight": "norm1.weight"}

    def renamed(name):
        head, _, tail = name.partition(".blocks.{}.")
        return f"{head}.blocks.{{}}.{swap.get(tail, tail)}" if tail else name
    return [(p, renamed(n), layout) for p, n, layout in rules]


def _patch_axes_swapped(rules):  # the Conv3D kernel's two pixel axes exchanged
    return [(p, n, ("transpose", (4, 3, 0, 2, 1)) if n.endswith("patch_embed.proj.weight")
             else layout) for p, n, layout in rules]


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [_swapped_norms, _patch_axes_swapped])
def test_a_mis_mapped_vision_tensor_changes_the_logits(exported, monkeypatch, tmp_path, wrong):
    """The comparison above sees the tower's mapping: a block's two norms' scales swapped, or the
    patch embedding's pixel axes transposed (same shapes, so the export still loads): its logits
    on the image rows differ from ours by far more than the tolerance."""
    lm, batch, _, ours = exported
    monkeypatch.setattr(rules_module, "VISION_RULES", wrong(rules_module.VISION_RULES))
    hf_export.export_model(lm.task, tmp_path / "wrong", "float32", echo=lambda _: None)
    theirs = hf_logits(tmp_path / "wrong", batch)
    real = batch["attention_mask"].astype(bool)
    assert np.abs(theirs[:2] - ours[:2])[real[:2]].max() > 100 * TOLERANCE


def test_our_patches_are_transformers_image_processors():
    """The truth for a released checkpoint: transformers' ``Qwen2VLImageProcessor`` (Qwen 3.5's)
    lists a picture's patches by 2 x 2 merge window, each patch channels first; our pipeline's
    patches (KerasHub's converter's, reordered by window) are the same list. KerasHub's converter
    alone (row by row) is not: without the reorder the two differ."""
    from nnx_posttrain.data import images

    spec = support.vision_model(NAME).images
    image = support.picture(3)
    theirs, grid = processed([image])
    ours = spec.pixels([image])[0]  # [16 patches, T, p, p, 3]
    assert theirs.shape == (16, 3 * 2 * 4 * 4) and grid.tolist() == [[1, 4, 4]]
    channels_first = np.transpose(ours, (0, 4, 1, 2, 3)).reshape(16, -1)
    np.testing.assert_allclose(channels_first, theirs, atol=1e-6, rtol=0)
    rows = np.asarray(spec.converter(image)["patches"], np.float32)
    np.testing.assert_array_equal(images.qwen_window_order(rows, 4, 4, 2), ours)
    unordered = np.transpose(rows, (0, 4, 1, 2, 3)).reshape(16, -1)
    assert np.abs(theirs - unordered).max() > 0.1
