"""The built-in vision models (``model.load``'s ``TINY`` entries with a ``vision`` part): a
Gemma 3, Gemma 4 or Qwen 3.5 KerasHub causal LM with its vision encoder, image converter and
preprocessor, built from the built-in dimensions and tokenizer data (``BUILDERS``, by the
entry's ``family``; ``tokenizer_of`` its tokenizer alone)."""

from __future__ import annotations

from nnx_posttrain.model.vision import preprocessor_without_tensorflow


def tokenizer_of(family: str | None, data):
    """The KerasHub tokenizer of a built-in vision model of ``family`` from its tokenizer data
    (a SentencePiece model's bytes; Qwen 3.5: (vocabulary, merges) of a byte-level BPE)."""
    import keras_hub

    from nnx_posttrain.model.tokenizer import build

    if family == "qwen3_5":
        vocab, merges = data
        return build(lambda: keras_hub.tokenizers.Qwen3_5Tokenizer(
            vocabulary=vocab, merges=merges, unsplittable_tokens=special_tokens(vocab)))
    if family == "gemma4":
        return build(lambda: keras_hub.tokenizers.Gemma4Tokenizer(proto=data,
                                                                   has_video_tokens=False))
    return build(lambda: keras_hub.tokenizers.Gemma3Tokenizer(proto=data))


def build_gemma3(dims: dict, proto: bytes, policy: str):
    """A ``Gemma3CausalLM`` with a vision encoder from built-in ``dims``: ``Gemma3Backbone``
    arguments (the vocabulary is the tokenizer's), ``vision`` (``Gemma3VisionEncoder``
    arguments; its output width is the backbone's) and ``max_images`` per sequence; the
    tokenizer is SentencePiece model ``proto`` with Gemma 3's image tokens."""
    import keras_hub

    dims = dict(dims)
    vision, max_images = dict(dims.pop("vision")), int(dims.pop("max_images", 1))
    tokenizer = tokenizer_of(None, proto)
    encoder = keras_hub.models.Gemma3VisionEncoder(output_dim=dims["hidden_dim"], dtype=policy,
                                                   **vision)
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=vision["image_size"],
        vision_encoder=encoder, dtype=policy, **dims)
    size = vision["image_size"]
    converter = keras_hub.layers.Gemma3ImageConverter(image_size=(size, size), scale=1 / 127.5,
                                                      offset=-1.0)
    with preprocessor_without_tensorflow():
        preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
            tokenizer, converter, num_vision_tokens_per_image=encoder.num_vision_tokens_per_image,
            max_images_per_prompt=max_images)
    return keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)


def build_gemma4(dims: dict, proto: bytes, policy: str):
    """A ``Gemma4CausalLM`` with a vision encoder from built-in ``dims``: ``Gemma4Backbone``
    arguments (the vocabulary is the tokenizer's), ``vision`` (``Gemma4VisionEncoder``
    arguments; its output width is the backbone's) and ``max_images`` per sequence; the
    tokenizer is SentencePiece model ``proto`` with Gemma 4's image tokens. The image converter
    resizes an image to at most the encoder's patch grid (square images: exactly), rescaled to
    [0, 1] as Gemma 4's checkpoints' converters are."""
    import keras_hub

    dims = dict(dims)
    vision, max_images = dict(dims.pop("vision")), int(dims.pop("max_images", 1))
    tokenizer = tokenizer_of("gemma4", proto)
    encoder = keras_hub.models.Gemma4VisionEncoder(output_dim=dims["hidden_dim"], dtype=policy,
                                                   **vision)
    backbone = keras_hub.models.Gemma4Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=vision["image_size"],
        vision_encoder=encoder, dtype=policy, **dims)
    tokens = encoder.num_vision_tokens_per_image
    converter = keras_hub.layers.Gemma4ImageConverter(
        patch_size=vision["patch_size"], max_soft_tokens=tokens,
        pooling_kernel_size=vision["pool_size"], scale=1 / 255)
    with preprocessor_without_tensorflow():
        preprocessor = keras_hub.models.Gemma4CausalLMPreprocessor(
            tokenizer, converter, num_vision_tokens_per_image=tokens,
            max_images_per_prompt=max_images)
    return keras_hub.models.Gemma4CausalLM(backbone=backbone, preprocessor=preprocessor)


def special_tokens(vocab: dict) -> list[str]:
    """The special tokens (``<|...|>``, the think and tool tags) of a Qwen vocabulary, which its
    tokenizer must keep whole (KerasHub's ``Qwen3_5Tokenizer`` registers its vision tokens after
    its byte-pair model is built, so only ``unsplittable_tokens`` keeps them whole)."""
    return [t for t in vocab if t.startswith("<") and t.endswith(">") and len(t) > 2]


def build_qwen3_5(dims: dict, vocabulary: tuple, policy: str):
    """A ``Qwen3_5CausalLM`` with a vision encoder from built-in ``dims``: ``Qwen3_5Backbone``
    arguments (the vocabulary is the tokenizer's), ``vision`` (``Qwen3_5VisionEncoder``
    arguments and the image side ``image_size``; its output width is the backbone's) and
    ``max_images`` per sequence; the tokenizer is the byte-level BPE ``vocabulary`` (vocabulary,
    merges) with Qwen 3.5's vision tokens. The converter's pixel budget is one square image of
    ``image_size`` (``image_side``), rescaled as Qwen 3.5's checkpoints' (mean and std 0.5)."""
    import keras_hub
    from keras_hub.src.models.qwen3_5.qwen3_5_vision_encoder import Qwen3_5VisionEncoder

    dims = dict(dims)
    vision, max_images = dict(dims.pop("vision")), int(dims.pop("max_images", 1))
    side = int(vision.pop("image_size"))
    tokenizer = tokenizer_of("qwen3_5", vocabulary)
    encoder = Qwen3_5VisionEncoder(out_hidden_size=dims["hidden_dim"], dtype=policy, **vision)
    backbone = keras_hub.models.Qwen3_5Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), vision_encoder=encoder, dtype=policy,
        **dims)
    converter = keras_hub.layers.Qwen3_5ImageConverter(
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        spatial_merge_size=vision["spatial_merge_size"], min_pixels=side * side,
        max_pixels=side * side, scale=1 / 127.5, offset=-1.0)
    preprocessor = keras_hub.models.Qwen3_5CausalLMPreprocessor(tokenizer, converter)
    preprocessor.max_images_per_prompt = max_images
    return keras_hub.models.Qwen3_5CausalLM(backbone=backbone, preprocessor=preprocessor)


BUILDERS = {None: build_gemma3, "gemma4": build_gemma4, "qwen3_5": build_qwen3_5}
