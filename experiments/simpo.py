"""SimPO: reference-free, length-normalised preference optimisation (CPO-SimPO with --algo.nll-weight).

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.

    python -m experiments.simpo --model gemma_2b --data pairs.jsonl --lora.rank 8
    python -m experiments.simpo --algo.beta 2.5 --algo.gamma-beta-ratio 0.5
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import SimPO

ALGORITHM = SimPO
DEFAULT = experiment.config_for(SimPO, **experiment.PREFERENCE_DEFAULTS)

if __name__ == "__main__":
    experiment.main("simpo", SimPO, DEFAULT, __doc__)
