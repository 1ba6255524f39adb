"""Direct Preference Optimization (and its TRL variants via --algo.loss-type).

With no arguments: starts from the default SFT run (runs/sft) and trains on the built-in task's
preference pairs (chosen = the correct sum, rejected = a plausible wrong one).

    python -m experiments.dpo --algo.loss-type ipo --algo.beta 0.5
    python -m experiments.dpo --model gemma_2b --data pairs.jsonl --lora.rank 8
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import DPO

ALGORITHM = DPO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer).
DEFAULT = experiment.config_for(DPO, experiment.PREFERENCE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run.
BUILTIN = experiment.recipe(experiment.BUILTIN_PREFERENCE, algo=dict(beta=1.0))

if __name__ == "__main__":
    experiment.main("dpo", DPO, DEFAULT, __doc__, builtin=BUILTIN)
