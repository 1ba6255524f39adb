"""PPO: a value head on the policy's backbone, GAE, clipped policy and value losses, a per-token
KL penalty in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import PPO

ALGORITHM = PPO
DEFAULT = experiment.config_for(PPO, **experiment.ONLINE_DEFAULTS)

if __name__ == "__main__":
    experiment.main("ppo", PPO, DEFAULT, __doc__)
