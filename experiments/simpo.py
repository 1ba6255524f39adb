"""SimPO: reference-free, length-normalised preference optimisation (CPO-SimPO with --algo.nll-weight).

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.

    python -m experiments.simpo --model gemma_2b --data pairs.jsonl --lora.rank 8
    python -m experiments.simpo --algo.beta 2.5 --algo.gamma-beta-ratio 0.5
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import SimPO

ALGORITHM = SimPO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer).
DEFAULT = experiment.config_for(SimPO, experiment.PREFERENCE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run.
BUILTIN = experiment.BUILTIN_PREFERENCE

if __name__ == "__main__":
    experiment.main("simpo", SimPO, DEFAULT, __doc__, builtin=BUILTIN)
