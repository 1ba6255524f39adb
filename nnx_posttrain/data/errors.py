"""The one error type of ``nnx_posttrain.data`` (``nnx_posttrain.errors.DataError``)."""

from nnx_posttrain.errors import DataError

__all__ = ["DataError"]
