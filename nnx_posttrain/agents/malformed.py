"""``Malformed``: what every format's call reader raises (``calls``, ``gemma4_calls``,
``qwen35_calls``, ``harmony_calls``)."""


class Malformed(ValueError):
    """A turn that tries to call a tool but whose call cannot be read (the message says why)."""
