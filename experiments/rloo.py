"""RLOO: REINFORCE with a leave-one-out baseline; the KL to the reference is in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.

Defaults: ``rloo``'s ``defaults`` in ``nnx_posttrain.algorithms`` (a user's data) and
``nnx_posttrain/tasks/recipes/rloo.yaml`` (the built-in task's, ``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    experiment("rloo")
