"""Supervised fine-tuning. With no arguments: the tiny built-in Gemma learns two-digit addition.

    python -m experiments.sft                         # built-in default, offline, a few minutes on CPU
    python -m experiments.sft --model gemma_2b --data chats.jsonl --lora.rank 8

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``sft``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/sft.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("sft"))
