"""The one error type of ``nnx_posttrain.data``."""


class DataError(ValueError):
    """Bad input data; the message names the file, the line (or row) and the field."""
