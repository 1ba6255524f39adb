"""Data: records from files -> tokenized, fixed-length examples -> Grain batches.

One job per module:

- ``sources``: random-access sources (JSONL, Parquet, Hugging Face Arrow directories, in-memory
  lists, concatenations, weighted mixtures, subsets), the built-in task's registry
  (``register_builtin``);
- ``specs``: ``source()`` for a ``--data`` value, ``extra_columns``, ``signature`` (what a run
  records of its data);
- ``formats``: record formats (TRL's column conventions), their detection, the checks of a
  record's fields, the split of a record into prompt and completion segments;
- ``images``: TRL's vision formats (an ``images`` / ``image`` column, ``{"type": "image"}``
  content parts): images placed, counted, decoded (Pillow) and resized by a vision model's
  KerasHub image converter (``ImageSpec``), their tokens kept out of the loss;
- ``tokenize``: the transforms from a record to fixed-length numpy arrays (``make_transform``);
- ``validate``: every record read and tokenized before training (``validate``, ``only_good``);
- ``batches``: Grain pipelines (training batches, packed or not; eval batches; the prompts and
  answers of exact-match evaluation) and ``Indexed``;
- ``errors``: ``DataError``.

This package imports only ``nnx_posttrain.chat``, ``nnx_posttrain.config`` and other
model-independent code (numpy, grain, pyarrow, Pillow); never ``model``, ``losses``,
``algorithms`` or
``train``, and not keras (Grain worker processes import it). The built-in task registers its
records here (``register_builtin``) rather than being imported.
"""

from nnx_posttrain.data.batches import (
    Indexed,
    eval_batches,
    packed_train_batches,
    prompts_and_answers,
    records_dataset,
    train_batches,
)
from nnx_posttrain.data.errors import DataError
from nnx_posttrain.data.formats import (
    FORMATS,
    RECORD_FORMATS,
    coarse_format,
    data_format,
    detect_format,
    implicit_prompt,
    preference_parts,
    unpaired,
)
from nnx_posttrain.data.images import ImageSpec
from nnx_posttrain.data.sources import (
    SPLIT_NAMES,
    ArrowSource,
    Concat,
    JsonlSource,
    ListSource,
    Mixture,
    ParquetSource,
    Subset,
    builtin_fingerprint,
    builtin_registered,
    register_builtin,
)
from nnx_posttrain.data.specs import extra_columns, signature, source
from nnx_posttrain.data.tokenize import (
    Tokenize,
    TokenizePreference,
    TokenizePrompt,
    TokenizeUnpaired,
    make_transform,
    pad_example,
)

# Last, so that ``data.validate`` is the function (importing the submodule ``validate`` binds the
# same name to the module).
from nnx_posttrain.data.validate import ValidationReport, only_good, validate  # noqa: E402

__all__ = [
    # sources
    "SPLIT_NAMES",
    "ArrowSource",
    "Concat",
    "JsonlSource",
    "ListSource",
    "Mixture",
    "ParquetSource",
    "Subset",
    "extra_columns",
    "builtin_fingerprint",
    "builtin_registered",
    "register_builtin",
    "signature",
    "source",
    # errors
    "DataError",
    # formats
    "FORMATS",
    "RECORD_FORMATS",
    "coarse_format",
    "data_format",
    "detect_format",
    "implicit_prompt",
    "preference_parts",
    "unpaired",
    # images
    "ImageSpec",
    # tokenize
    "Tokenize",
    "TokenizePreference",
    "TokenizePrompt",
    "TokenizeUnpaired",
    "make_transform",
    "pad_example",
    # validate
    "ValidationReport",
    "only_good",
    "validate",
    # batches
    "Indexed",
    "eval_batches",
    "packed_train_batches",
    "prompts_and_answers",
    "records_dataset",
    "train_batches",
]
