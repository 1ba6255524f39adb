"""Image converters whose KerasHub config loses settings, made whole again.

KerasHub 0.32's ``Gemma4ImageConverter.get_config`` leaves out two of its constructor's arguments,
``max_soft_tokens`` and ``pooling_kernel_size``: a converter made from its config (a plan's
abstract build makes the data's converter again so; ``save_to_preset`` writes that config and
``from_preset`` reads it) has the defaults 280 and 3, and pads every picture to 280 x 3^2 = 2520
patches of the picture resized up to fill them, whatever the model's own numbers (the built-in
``gemma4_vision_micro``: 4 soft tokens pooled 2 x 2, 16 patches). The encoder then attends over
2520 patches a picture and the backbone places the first of its pooled tokens: a different
picture, and (issue 57) a planned step of 12.5 GiB of XLA temporaries instead of 0.02.

``full_config`` is a layer's config with those arguments put back; ``complete_preset`` writes it
into a preset ``save_to_preset`` wrote; ``restore`` mends a converter loaded from a preset that
lacks them (KerasHub's own ``save_to_preset``): its soft tokens are the preprocessor's image
tokens, its pooling the vision encoder's.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

_LOST = ("max_soft_tokens", "pooling_kernel_size")  # what Gemma4ImageConverter's config lacks


def full_config(layer) -> dict:
    """``layer.get_config()`` with the constructor's arguments it leaves out but ``layer`` holds
    by the same name."""
    config, params = layer.get_config(), inspect.signature(type(layer).__init__).parameters
    return {**{name: getattr(layer, name) for name, p in params.items() if name != "self"
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and hasattr(layer, name)},
            **config}


def complete_preset(task, directory) -> None:
    """The image converter's config in a preset ``task.save_to_preset(directory)`` wrote (its
    own file and the preprocessor's copy) made whole (``full_config``): KerasHub's
    ``from_preset`` then makes the converter the task has."""
    converter = getattr(getattr(task, "preprocessor", None), "image_converter", None)
    if converter is None:
        return
    config = {k: v for k, v in full_config(converter).items() if _plain(v)}
    for name, inner in (("image_converter.json", ()), ("preprocessor.json", ("image_converter",))):
        path = Path(directory) / name
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        node = saved
        for key in inner:
            node = node.get("config", {}).get(key) or {}
        if node.get("class_name") == type(converter).__name__:
            node["config"] = {**config, **node["config"]}
            path.write_text(json.dumps(saved, indent=4))


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, type(None), list, tuple))


def restore(task, handle: str) -> None:
    """A Gemma 4 image converter loaded from the local preset ``handle`` whose config lacks
    ``max_soft_tokens`` / ``pooling_kernel_size`` (KerasHub's ``save_to_preset`` drops them)
    made again with the preprocessor's image tokens and the vision encoder's pooling (the
    numbers KerasHub's preprocessor and backbone place and pool an image with)."""
    pre = getattr(task, "preprocessor", None)
    converter = getattr(pre, "image_converter", None)
    path = Path(handle) / "image_converter.json"
    if type(converter).__name__ != "Gemma4ImageConverter" or not path.is_file():
        return
    if all(k in json.loads(path.read_text()).get("config", {}) for k in _LOST):
        return
    found = {"max_soft_tokens": int(pre.num_vision_tokens_per_image),
             "pooling_kernel_size": int(task.backbone.vision_encoder.pool_size)}
    pre.image_converter = type(converter).from_config({**full_config(converter), **found})
