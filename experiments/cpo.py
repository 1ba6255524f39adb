"""CPO: reference-free preference loss plus NLL on the chosen answers.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import CPO

ALGORITHM = CPO
DEFAULT = experiment.config_for(CPO, **experiment.PREFERENCE_DEFAULTS)

if __name__ == "__main__":
    experiment.main("cpo", CPO, DEFAULT, __doc__)
