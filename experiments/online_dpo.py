"""Online DPO: two samples per prompt, the higher-reward one chosen, DPO loss against the reference.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import OnlineDPO

ALGORITHM = OnlineDPO
# A user's data: TRL's defaults (learning rate 5e-7 as TRL's trainer); --algo.rewards is required.
DEFAULT = experiment.config_for(OnlineDPO, experiment.ONLINE_DATA, optim=dict(learning_rate=5e-7))
# The built-in task (--data builtin, the default): its tuned recipe, from the default SFT run,
# rewarded by the program that checks the sum.
BUILTIN = experiment.BUILTIN_ONLINE

if __name__ == "__main__":
    experiment.main("online_dpo", OnlineDPO, DEFAULT, __doc__, builtin=BUILTIN)
