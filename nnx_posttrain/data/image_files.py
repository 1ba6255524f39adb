"""Reading one image of a record: a file path (relative to the data file's folder, else the
current directory), a ``data:image/...;base64,`` string, raw bytes, a Hugging Face ``datasets``
``Image`` feature (``{"bytes": ..., "path": ...}``), a PIL image or a ``uint8`` array, decoded
with Pillow to ``uint8`` RGB; a ``DataError`` naming the record and the field otherwise."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

import numpy as np

from nnx_posttrain.data.errors import DataError


def _open_path(path: str, base: Path | None, where: str, field: str) -> bytes:
    """The bytes of an image file: an absolute path, or one relative to the data file's folder
    (``base``), else to the current directory."""
    candidates = [Path(path)]
    if base is not None and not Path(path).is_absolute():
        candidates.insert(0, base / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.read_bytes()
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(f"{where}: field '{field}': no such image file {path!r} (looked for {looked})")


def _raw_bytes(value, base, where, field) -> bytes | None:
    """The encoded bytes of an image given as a path, a data URI, bytes or a ``datasets`` Image
    feature dict; None for an image already decoded (PIL, array)."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path"):
            return _open_path(value["path"], base, where, field)
        raise DataError(f"{where}: field '{field}': an image with neither bytes nor a path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith("data:"):
            try:
                return base64.b64decode(value.split(",", 1)[1], validate=True)
            except (IndexError, binascii.Error):
                raise DataError(f"{where}: field '{field}': a data URI that is not base64 "
                                "(data:image/png;base64,...)") from None
        return _open_path(value, base, where, field)
    return None


def decode(value, where: str = "?", field: str = "images[0]", base: Path | None = None):
    """One image -> ``uint8`` (height, width, 3) RGB; a ``DataError`` naming the record and the
    field for a missing file or bytes that are no image."""
    from PIL import Image, UnidentifiedImageError

    raw = _raw_bytes(value, base, where, field)
    if raw is not None:
        try:
            with Image.open(io.BytesIO(raw)) as im:
                return np.asarray(im.convert("RGB"), np.uint8)
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as exc:
            raise DataError(f"{where}: field '{field}': not a readable image ({len(raw)} bytes: "
                            f"{exc})") from None
    if isinstance(value, Image.Image):
        return np.asarray(value.convert("RGB"), np.uint8)
    if isinstance(value, np.ndarray) and value.size and value.dtype == np.uint8 and (
            value.ndim == 2 or value.ndim == 3 and value.shape[-1] in (1, 3, 4)):
        array = value[..., 0] if value.ndim == 3 and value.shape[-1] == 1 else value
        return np.asarray(Image.fromarray(array).convert("RGB"))  # grey, RGB or RGBA
    raise DataError(f"{where}: field '{field}': not an image (a path, bytes, a datasets Image "
                    f"feature, a PIL image or a uint8 array), got {type(value).__name__}")
