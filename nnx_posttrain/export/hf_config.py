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
    family(backbone)
    cfg = families.of(backbone).export.config(backbone)
    if tokenizer is not None:
        for key, attr in (("bos_token_id", "start_token_id"), ("eos_token_id", "end_token_id"),
                          ("pad_token_id", "pad_token_id")):
            value = getattr(tokenizer, attr, None)
            if value is not None:
                cfg[key] = int(value)
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return cfg
