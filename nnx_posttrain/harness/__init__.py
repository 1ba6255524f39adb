"""Evaluation as the field does it: a run's model inside lm-evaluation-harness (``lm.NNXLM``,
``evaluate``: ``nnx-posttrain eval``), and head-to-head win rates of two runs' answers under a
judge (``judge``: ``nnx-posttrain judge``). lm-eval is the ``eval`` extra, imported only when
used."""
