"""Every algorithm, registered once by name: ``@register`` on its class.

``python -m experiments ALGORITHM``, ``nnx_posttrain.runs`` and the method table read this
registry; ``nnx_posttrain.algorithms`` imports every algorithm module, so importing it fills it.
"""

from __future__ import annotations

ALGORITHMS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: ``ALGORITHMS[cls.name] = cls`` (a name registered twice is an error)."""
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} is registered twice")
    ALGORITHMS[cls.name] = cls
    return cls


def get(name: str) -> type:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def names() -> list[str]:
    return list(ALGORITHMS)


def summary(cls: type) -> str:
    """The first line of an algorithm's settings docstring: its one-line description."""
    return ((cls.Config.__doc__ or cls.__doc__ or "").strip().splitlines() or [""])[0]
