"""The vision tower as weights (``model.vision``'s backbones): frozen by default
(``freeze_tower``), trained whole with ``--train-vision`` (``tower_trains``), LoRA on its
projection or attention (``VISION_LORA``, ``lora_layers``), and made fit for a training step
after loading (``prepare_tower``): NNX must merge every layer the encoder calls, and its weights
must keep their names from one process to the next."""

from __future__ import annotations

import re

from nnx_posttrain import errors
from nnx_posttrain.model.vision import reads_images


def prepare_tower(backbone) -> None:
    """A vision backbone's encoder made fit for ``nnx.split`` / ``nnx.merge`` and checkpoints
    (text backbones: nothing):

    - a list of sublayers that Keras tracks (a ``TrackedList``: Gemma 3's ``resblocks``, Gemma
      4's ``encoder_blocks``, Qwen 3.5's ``blocks``, which the encoders' ``call`` loops over) is
      kept by NNX as a static attribute, by reference: after ``nnx.merge`` the encoder called
      the blocks of the module that was split, their weights constants of the traced step, so
      no gradient reached them (``--train-vision`` and ``--lora.targets vision-attention``
      trained nothing inside the blocks). A plain list is a graph node: the merged encoder calls
      its own blocks (the state's paths are unchanged: the blocks are its layers already);
    - an encoder named by Keras' counter (Qwen 3.5's ``qwen3_5_vision_encoder_3``: its variables'
      paths start with its name) gets its class's name back in those paths, so that a trained
      tower's checkpoint names its weights alike in every process (a second model built in a
      process counts on)."""
    import keras
    from keras.src.utils.naming import to_snake_case
    from keras.src.utils.tracking import TrackedList

    tower = getattr(backbone, "vision_encoder", None)
    if tower is None:
        return
    for layer in tower._flatten_layers(include_self=True):
        for name, value in list(vars(layer).items()):
            if isinstance(value, TrackedList) and value and \
                    all(isinstance(x, keras.layers.Layer) for x in value):
                object.__setattr__(layer, name, list(value))
    base = to_snake_case(type(tower).__name__)
    if re.fullmatch(rf"{base}_\d+", tower.name):
        for variable in tower.weights:
            if variable.path.startswith(tower.name + "/"):
                variable._path = base + variable.path[len(tower.name):]


# The vision layers ``--lora.targets`` may name beside (or instead of) the language model's
# (``model.enable_lora``), by Keras path: the projection into the language model, and the
# tower's attention projections (Gemma 3's SigLIP, Gemma 4's clipped linears)
VISION_LORA = {
    "projector": r"vision_output_encoder/vision_input_projection$",
    "vision-attention": r"image_encoder/encoder_block_\d+/(multi_head_attention/"
                        r"(query|key|value|out)_proj|attention/(query|key|value|"
                        r"attention_output)/dense)$",
}


def lora_layers(module, groups) -> list:
    """The Dense / EinsumDense layers of a vision backbone that ``groups`` (``VISION_LORA``'s
    names) select; a ``ConfigError`` for a text model or a group that selects none."""
    import keras

    if not reads_images(module):
        raise errors.ConfigError(f"--lora.targets {','.join(groups)}: {type(module).__name__} "
                                 "has no vision encoder")
    linear = [layer for layer in module.vision_encoder._flatten_layers(include_self=False)
              if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))]
    out = []
    for group in groups:
        hits = [layer for layer in linear if re.search(VISION_LORA[group], layer.path)]
        if not hits:  # Qwen 3.5's tower (its fused qkv, its merger): not wired
            raise errors.ConfigError(
                f"--lora.targets {group}: no such layer in the vision encoder of "
                f"{type(module).__name__} (LoRA on the tower is wired for Gemma 3's and Gemma "
                "4's); --train-vision trains the whole tower, or adapt the language model only")
        out += [layer for layer in hits if layer not in out]
    return out


def freeze_tower(module, train: bool = False) -> None:
    """The vision encoder (and its projection into the language model) frozen, unless
    ``train`` (every weight of it trains); a text backbone has none to train. LoRA factors on
    it (``--lora.targets projector`` / ``vision-attention``) stay trainable; with ``train``
    they would add nothing to the trained tower: refused."""
    if not reads_images(module):
        if train:
            raise errors.ConfigError(f"--train-vision: {type(module).__name__} has no vision "
                                     "encoder to train")
        return
    adapted = [layer for layer in module.vision_encoder._flatten_layers(include_self=False)
               if getattr(layer, "lora_enabled", False)]
    if train and adapted:
        raise errors.ConfigError("--train-vision trains every weight of the vision encoder: "
                                 "LoRA on it (--lora.targets projector / vision-attention) adds "
                                 "nothing; give one or the other")
    module.vision_encoder.trainable = bool(train)
    for layer in adapted:  # Keras' setter froze the factors with the rest of the tower
        layer.lora_kernel_a.trainable = layer.lora_kernel_b.trainable = True


def tower_trains(module) -> bool:
    """Whether ``module``'s vision encoder trains (``freeze_tower(train=True)``)."""
    return reads_images(module) and bool(module.vision_encoder.trainable)
