"""nnx_posttrain: post-training of KerasHub language models on the Keras NNX backend.

The Python API (``nnx_posttrain.api``, its names also here)::

    import nnx_posttrain as npt

    cfg = npt.configure("sft", steps=300, optim={"learning_rate": 1e-3})
    sft = npt.run(cfg)                                   # -> RunResult
    dpo = npt.run(npt.configure("dpo", init_from=sft.run_dir, run_dir="runs/dpo"))
    print(dpo.final_eval, dpo.best_eval)

Importing the package changes nothing in the process but the defaults of Keras' backend
(``KERAS_BACKEND=jax``, ``KERAS_NNX_ENABLED=true``, set only where unset): Keras reads them once,
at its own import, so they must be set before anything imports keras. Everything else is
imported when it is first used.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_NNX_ENABLED", "true")

if os.environ["KERAS_BACKEND"] != "jax" or os.environ["KERAS_NNX_ENABLED"].lower() != "true":
    raise ImportError(
        "nnx_posttrain needs KERAS_BACKEND=jax and KERAS_NNX_ENABLED=true; "
        f"found KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}, "
        f"KERAS_NNX_ENABLED={os.environ['KERAS_NNX_ENABLED']!r}"
    )

__version__ = "0.1.0"

_API = {"configure", "run", "evaluate", "load_run", "RunResult"}
_ERRORS = {"UserError", "ConfigError", "DataError", "ModelError", "CheckpointError",
           "RunDirError", "StorageError", "RewardError", "TrainingError", "Stopped"}
__all__ = sorted(_API | _ERRORS)


def __getattr__(name):  # PEP 562: the API is imported when first used, not with the package
    if name in _API:
        from nnx_posttrain import api

        return getattr(api, name)
    if name in _ERRORS:
        from nnx_posttrain import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'nnx_posttrain' has no attribute {name!r}")
