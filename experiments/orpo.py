"""ORPO: NLL plus an odds-ratio preference term, no reference model.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import ORPO

ALGORITHM = ORPO
DEFAULT = experiment.config_for(ORPO, **experiment.PREFERENCE_DEFAULTS, algo=dict(beta=1.0))

if __name__ == "__main__":
    experiment.main("orpo", ORPO, DEFAULT, __doc__)
