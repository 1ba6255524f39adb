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
BUILTIN = dict(
    init_from="runs/sft",
    steps=200,
    remat="none",
    optim=dict(learning_rate=3e-4, warmup_steps=5, min_lr_ratio=0.1),
    batching=dict(batch_size=128, grad_accum=1, max_length=32),
    eval=dict(every=50, exact_match=500, max_new_tokens=8),
    algo=dict(rewards="exact_match", max_completion_length=8, num_generations=4),
)

if __name__ == "__main__":
    experiment.main("grpo", GRPO, DEFAULT, __doc__, builtin=BUILTIN)
