"""RLOO: REINFORCE with a leave-one-out baseline; the KL to the reference is in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import RLOO

ALGORITHM = RLOO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer); --algo.rewards is required.
DEFAULT = experiment.config_for(RLOO, experiment.ONLINE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run,
# rewarded by the program that checks the sum.
BUILTIN = experiment.BUILTIN_ONLINE

if __name__ == "__main__":
    experiment.main("rloo", RLOO, DEFAULT, __doc__, builtin=BUILTIN)
