"""Reward model: a scalar head on the backbone, Bradley-Terry loss on preference pairs.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs;
the eval metric `accuracy` is how often the correct answer gets the higher reward.

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``reward``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/reward.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("reward"))
