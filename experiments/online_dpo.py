"""Online DPO: two samples per prompt, the higher-reward one chosen, DPO loss against the reference.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``online_dpo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/online_dpo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("online_dpo"))
