"""nnx_posttrain: post-training of KerasHub language models on the Keras NNX backend.

Importing the package selects the backend: Keras reads these variables once, at its own import,
so they must be set before anything imports keras.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("KERAS_NNX_ENABLED", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# keras-hub imports TensorFlow when it is installed (its tf.data preprocessing), which costs
# ~450 MB of resident memory and seconds of start-up; nothing here uses it (tokenization goes
# through sentencepiece), so it is kept out unless NNX_POSTTRAIN_TENSORFLOW=1.
if os.environ.get("NNX_POSTTRAIN_TENSORFLOW") != "1":
    import sys

    sys.modules.setdefault("tensorflow", None)  # `import tensorflow` then raises ImportError

if os.environ["KERAS_BACKEND"] != "jax" or os.environ["KERAS_NNX_ENABLED"].lower() != "true":
    raise RuntimeError(
        "nnx_posttrain needs KERAS_BACKEND=jax and KERAS_NNX_ENABLED=true; "
        f"found KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}, "
        f"KERAS_NNX_ENABLED={os.environ['KERAS_NNX_ENABLED']!r}"
    )

__version__ = "0.1.0"
