"""GRPO: group-relative advantages over num_generations samples per prompt, clipped policy loss.

With no arguments: starts from the default SFT run (runs/sft) and trains on the built-in task's
prompts with the exact-match reward (1 when the answer is the correct sum).

    python -m experiments.grpo --algo.loss-type dr_grpo --algo.scale-rewards none
    python -m experiments.grpo --algo.beta 0.04 --algo.num-iterations 2 --algo.epsilon-high 0.28
    python -m experiments.grpo --model gemma_2b --data prompts.jsonl --lora.rank 8 \
        --algo.rewards my_rewards:correctness,format --algo.reward-weights 1,0.2
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import GRPO

ALGORITHM = GRPO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer); --algo.rewards is required.
DEFAULT = experiment.config_for(GRPO, experiment.ONLINE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run,
# rewarded by the program that checks the sum.
BUILTIN = experiment.recipe(experiment.BUILTIN_ONLINE, algo=dict(num_generations=4))

if __name__ == "__main__":
    experiment.main("grpo", GRPO, DEFAULT, __doc__, builtin=BUILTIN)
