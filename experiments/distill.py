"""Distillation: a frozen teacher's token distributions into the student. With no arguments: the
default GRPO run (runs/grpo) teaches the default SFT run (runs/sft) on its own samples.

    python -m experiments.distill                     # built-in default, after experiments.sft and experiments.grpo
    python -m experiments.distill --algo.teacher TEACHER --model STUDENT --data prompts.jsonl

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``distill``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/distill.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("distill"))
