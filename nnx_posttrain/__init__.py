"""nnx_posttrain: post-training of KerasHub language models on the Keras NNX backend.

Importing the package selects the backend: Keras reads these variables once, at its own import,
so they must be set before anything imports keras.
"""

import contextlib
import importlib.machinery
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_NNX_ENABLED", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# keras-hub imports TensorFlow when it is installed (its tf.data preprocessing), which costs
# ~450 MB of resident memory and seconds of start-up; nothing here uses it (tokenization goes
# through sentencepiece), so it is kept out unless NNX_POSTTRAIN_TENSORFLOW=1.
if os.environ.get("NNX_POSTTRAIN_TENSORFLOW") != "1":
    sys.modules.setdefault("tensorflow", None)  # `import tensorflow` then raises ImportError

if os.environ["KERAS_BACKEND"] != "jax" or os.environ["KERAS_NNX_ENABLED"].lower() != "true":
    raise RuntimeError(
        "nnx_posttrain needs KERAS_BACKEND=jax and KERAS_NNX_ENABLED=true; "
        f"found KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}, "
        f"KERAS_NNX_ENABLED={os.environ['KERAS_NNX_ENABLED']!r}"
    )

# Keras imports pandas (its DataFrame adapters for `Model.fit`) and matplotlib.pyplot (its image
# gallery plots) whenever they are installed, used or not: ~86 MB of resident memory and ~0.6 s
# in every process. Training here never goes through `Model.fit` or Keras' plots, so Keras' own
# import runs with those two hidden (`_KerasWithoutExtras`); they stay importable afterwards, for
# the user and for tools.compare's plots. A package imported before Keras is left alone (Keras then
# uses it), and NNX_POSTTRAIN_KERAS_EXTRAS=1 turns the hiding off.
_KERAS_EXTRAS = ("pandas", "matplotlib")


@contextlib.contextmanager
def hidden_modules(names):
    """Inside the block, ``import NAME`` raises ImportError for each of ``names`` not imported
    yet (as where it is not installed); afterwards it imports normally. For the optional imports
    of other packages: Keras' (below), tensorboardX's torch (``metrics_log``)."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


class _KerasWithoutExtras:
    """A meta-path finder for the one name ``keras``, used once: Keras' own spec, its loader
    wrapped so that ``_KERAS_EXTRAS`` are hidden while Keras' package runs."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HidingLoader(spec.loader)
        return spec


class _HidingLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            with hidden_modules(_KERAS_EXTRAS):
                self.loader.exec_module(module)
        finally:
            module.__spec__.loader = module.__loader__ = self.loader  # nothing of ours stays


if os.environ.get("NNX_POSTTRAIN_KERAS_EXTRAS") != "1" and "keras" not in sys.modules:
    sys.meta_path.insert(0, _KerasWithoutExtras())

# Python only prints a KeyboardInterrupt raised inside a garbage-collector callback or a finaliser
# (JAX registers a gc callback at import): a Ctrl-C while a command starts could land there and be
# lost. It is noted here (the previous hook still prints it), and a training command started
# from the command line stops at once (``train.hooks.Interruptible``).
interrupt_swallowed = False


def _note_swallowed_interrupt(unraisable, _previous=sys.unraisablehook):
    global interrupt_swallowed
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        interrupt_swallowed = True
    _previous(unraisable)


sys.unraisablehook = _note_swallowed_interrupt

__version__ = "0.1.0"
