"""RLOO: REINFORCE with a leave-one-out baseline; the KL to the reference is in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import RLOO

ALGORITHM = RLOO
DEFAULT = experiment.config_for(RLOO, **experiment.ONLINE_DEFAULTS)

if __name__ == "__main__":
    experiment.main("rloo", RLOO, DEFAULT, __doc__)
