"""PPO: a value head on the policy's backbone, GAE, clipped policy and value losses, a per-token
KL penalty in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import PPO

ALGORITHM = PPO
# A user's data: TRL's defaults (learning rate 3e-6 as TRL's trainer); --algo.rewards is required.
DEFAULT = experiment.config_for(PPO, experiment.ONLINE_DATA, optim=dict(learning_rate=3e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run,
# rewarded by the program that checks the sum.
BUILTIN = experiment.BUILTIN_ONLINE

if __name__ == "__main__":
    experiment.main("ppo", PPO, DEFAULT, __doc__, builtin=BUILTIN)
