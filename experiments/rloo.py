"""RLOO: REINFORCE with a leave-one-out baseline; the KL to the reference is in the reward.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import RLOO

ALGORITHM = RLOO
# A user's data: TRL's defaults (learning rate 1e-6 as TRL's trainer); --algo.rewards is required.
DEFAULT = experiment.config_for(RLOO, experiment.ONLINE_DATA, optim=dict(learning_rate=1e-6))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run,
# rewarded by the program that checks the sum.
BUILTIN = dict(
    init_from="runs/sft",
    steps=200,
    remat="none",
    optim=dict(learning_rate=3e-4, warmup_steps=5, min_lr_ratio=0.1),
    batching=dict(batch_size=128, grad_accum=1, max_length=32),
    eval=dict(every=50, exact_match=500, max_new_tokens=8),
    algo=dict(rewards="exact_match", max_completion_length=8),
)

if __name__ == "__main__":
    experiment.main("rloo", RLOO, DEFAULT, __doc__, builtin=BUILTIN)
