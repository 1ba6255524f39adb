"""The image processor files of a vision-language Hugging Face export (``Export.processor``):
``preprocessor_config.json`` (the family's transformers image processor, with the size, rescale,
mean / std and patch settings of the model's KerasHub image converter) and
``processor_config.json`` (its processor: the image tokens per image), so that
``AutoProcessor.from_pretrained(DIR)`` reads an image as the training data's pipeline read it
(``tests/test_hf_export.py``, ``tests/test_hf_export_vision.py``).

KerasHub's converter computes ``x * scale + offset`` on 0-255 pixels; transformers rescales then
normalizes, ``(x * rescale_factor - mean) / std``: the same with ``rescale_factor`` 1/255,
``std = rescale_factor / scale`` and ``mean = -offset * std``. Where the two resize differently
(their interpolation kernels; KerasHub's Gemma 3 converter crops a picture to the model's aspect
ratio, transformers' stretches it) the pixel values of a picture that needs resizing differ:
docs/vision.md gives the measured gap.
"""

from __future__ import annotations

from nnx_posttrain.families.base import ExportError

RESCALE = 1 / 255
# transformers' PILImageResampling values of KerasHub's interpolation names
RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}
# the soft tokens per image transformers' Gemma4ImageProcessor accepts (its _SUPPORTED_SOFT_TOKENS)
GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)


def _per_channel(value, default: float) -> list[float]:
    if value is None:
        return [default] * 3
    values = [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return values * 3 if len(values) == 1 else values


def rescale(converter) -> dict:
    """transformers' rescale / normalize settings of a KerasHub converter's ``scale`` and
    ``offset`` (``do_normalize`` off where they are a plain 1/255 rescale)."""
    scale = _per_channel(converter.scale, 1.0)
    offset = _per_channel(converter.offset, 0.0)
    if any(s <= 0 for s in scale):
        raise ExportError(f"--format hf: an image converter scale of {scale} has no "
                          "transformers form (rescale then normalize)")
    std = [RESCALE / s for s in scale]
    mean = [-o * d for o, d in zip(offset, std)]
    identity = all(abs(d - 1) < 1e-9 for d in std) and not any(mean)
    return {"do_rescale": True, "rescale_factor": RESCALE, "do_normalize": not identity,
            "image_mean": [0.0] * 3 if identity else mean,
            "image_std": [1.0] * 3 if identity else std, "do_convert_rgb": True}


def gemma3(preprocessor) -> dict[str, dict]:
    """``Gemma3ImageProcessor`` (resized to the converter's size, no pan and scan) and
    ``Gemma3Processor`` with the preprocessor's image tokens per image."""
    converter = preprocessor.image_converter
    height, width = converter.image_size
    image = dict(image_processor_type="Gemma3ImageProcessor", processor_class="Gemma3Processor",
                 do_resize=True, size={"height": int(height), "width": int(width)},
                 resample=RESAMPLE.get(converter.interpolation, 2), do_pan_and_scan=False,
                 **rescale(converter))
    processor = {"processor_class": "Gemma3Processor",
                 "image_seq_length": int(preprocessor.num_vision_tokens_per_image)}
    return {"preprocessor_config.json": image, "processor_config.json": processor}


def gemma4(preprocessor) -> dict[str, dict]:
    """``Gemma4ImageProcessor`` (the converter's patch size, soft tokens per image and pooling;
    bicubic, as KerasHub's Gemma 4 resizing) and ``Gemma4Processor``; ``ExportError`` for soft
    tokens per image transformers does not accept."""
    converter = preprocessor.image_converter
    tokens = int(converter.max_soft_tokens)
    if tokens not in GEMMA4_SOFT_TOKENS:
        raise ExportError(f"{tokens} soft tokens an image: transformers' Gemma4ImageProcessor "
                          f"takes {', '.join(map(str, GEMMA4_SOFT_TOKENS))} only")
    image = dict(image_processor_type="Gemma4ImageProcessor", processor_class="Gemma4Processor",
                 do_resize=True, resample=RESAMPLE["bicubic"], patch_size=int(converter.patch_size),
                 max_soft_tokens=tokens, pooling_kernel_size=int(converter.pooling_kernel_size),
                 **rescale(converter))
    # the image processor's settings in processor_config.json too, where KerasHub's Gemma 4
    # converter reads them
    processor = {"processor_class": "Gemma4Processor", "image_seq_length": tokens,
                 "image_processor": image}
    return {"preprocessor_config.json": image, "processor_config.json": processor}
