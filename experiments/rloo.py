"""RLOO: REINFORCE with a leave-one-out baseline; the KL to the reference is in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``rloo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/rloo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("rloo"))
