"""Reward model: a scalar head on the backbone, Bradley-Terry loss on preference pairs.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs;
the eval metric `accuracy` is how often the correct answer gets the higher reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import Reward

ALGORITHM = Reward
# A user's data: TRL's defaults (learning rate 1e-4 as TRL's trainer).
DEFAULT = experiment.config_for(Reward, experiment.PREFERENCE_DATA, optim=dict(learning_rate=1e-4))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run.
BUILTIN = experiment.BUILTIN_PREFERENCE

if __name__ == "__main__":
    experiment.main("reward", Reward, DEFAULT, __doc__, builtin=BUILTIN)
