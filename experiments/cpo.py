"""CPO: reference-free preference loss plus NLL on the chosen answers.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import CPO

ALGORITHM = CPO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer).
DEFAULT = experiment.config_for(CPO, experiment.PREFERENCE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run.
BUILTIN = experiment.BUILTIN_PREFERENCE

if __name__ == "__main__":
    experiment.main("cpo", CPO, DEFAULT, __doc__, builtin=BUILTIN)
