"""Shared fixtures. Importing ``nnx_posttrain.tasks`` registers the built-in models and data
(``gemma_micro``, ``--data builtin``), as the training loop does; plain helpers (command lines of
the micro model, metric readers) live in ``support.py``."""

import nnx_posttrain  # noqa: F401  (the Keras backend, before keras is imported)
import nnx_posttrain.tasks  # noqa: F401  (registers the built-in models and data)
import pytest

from nnx_posttrain import model


@pytest.fixture(scope="module")
def micro():
    """The micro built-in Gemma (2 layers, hidden 32), seed 0: a fresh one per test module."""
    return model.load("gemma_micro", seed=0)
