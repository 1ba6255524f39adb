"""Reward model: a scalar head on the backbone, Bradley-Terry loss on preference pairs.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs;
the eval metric `accuracy` is how often the correct answer gets the higher reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import Reward

ALGORITHM = Reward
DEFAULT = experiment.config_for(Reward, **experiment.PREFERENCE_DEFAULTS)

if __name__ == "__main__":
    experiment.main("reward", Reward, DEFAULT, __doc__)
