"""Hugging Face ``config.json`` of a KerasHub backbone, for the families and configurations whose
export was verified against ``transformers`` (each family's ``Export.config``, ``families``);
anything else is refused by name."""

from __future__ import annotations

from nnx_posttrain import families
from nnx_posttrain.families import ExportError, Unsupported  # noqa: F401  (re-exported)

VERIFIED = tuple(f.backbone for f in families.FAMILIES.values()
                 if not isinstance(f.export, Unsupported))


def family(backbone) -> str:
    """The backbone's class name, when its family has a verified export; else ``ExportError``."""
    name = type(backbone).__name__
    fam = families.of(backbone)
    if fam is None or isinstance(fam.export, Unsupported):
        why = f" ({fam.export.reason})" if fam is not None else ""
        raise ExportError(
            f"--format hf: {name} has no verified Hugging Face export{why} (verified: "
            f"{', '.join(VERIFIED)}); use --format keras")
    return name


def hf_config(backbone, tokenizer=None, dtype: str = "float32") -> dict:
    """The backbone's ``config.json``, with the tokenizer's special token ids (a vision-language
    config: in its ``text_config`` too, and its image tokens, ``image_tokens``)."""
    family(backbone)
    export = families.of(backbone).export
    cfg = export.config(backbone)
    if tokenizer is not None:
        for key, attr in (("bos_token_id", "start_token_id"), ("eos_token_id", "end_token_id"),
                          ("pad_token_id", "pad_token_id")):
            value = getattr(tokenizer, attr, None)
            if value is not None:
                cfg[key] = int(value)
                if "text_config" in cfg:
                    cfg["text_config"][key] = int(value)
    if "vision_config" in cfg:
        cfg.update(image_tokens(export.image_tokens, tokenizer))
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return cfg


def image_tokens(keys: tuple[str, str, str], tokenizer) -> dict:
    """{config key: id} of the tokenizer's image placeholder, start-of-image and end-of-image
    tokens (``keys``: the family's names for them); ``ExportError`` without them, since
    transformers places the image embeddings at the placeholder's id."""
    attrs = ("image_placeholder_id", "start_of_image_token_id", "end_of_image_token_id")
    if getattr(tokenizer, "image_token_id", None) is not None:  # Qwen 3.5's names
        attrs = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = [getattr(tokenizer, a, None) for a in attrs]
    if not keys or any(i is None or int(i) < 0 for i in ids):
        raise ExportError("--format hf: a vision-language model's export needs its tokenizer's "
                          "image tokens (<img>, <start_of_image>, <end_of_image>); this model "
                          "has none")
    return {key: int(i) for key, i in zip(keys, ids)}
