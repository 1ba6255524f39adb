"""ORPO: NLL plus an odds-ratio preference term, no reference model.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import ORPO

ALGORITHM = ORPO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer).
DEFAULT = experiment.config_for(ORPO, experiment.PREFERENCE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run.
BUILTIN = experiment.recipe(experiment.BUILTIN_PREFERENCE, algo=dict(beta=1.0))

if __name__ == "__main__":
    experiment.main("orpo", ORPO, DEFAULT, __doc__, builtin=BUILTIN)
