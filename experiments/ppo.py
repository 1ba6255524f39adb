"""PPO: a value head on the policy's backbone, GAE, clipped policy and value losses, a per-token
KL penalty in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``ppo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/ppo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("ppo"))
