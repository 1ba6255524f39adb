"""Online DPO: two samples per prompt, the higher-reward one chosen, DPO loss against the reference.

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's prompts with
the exact-match reward.
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import OnlineDPO

ALGORITHM = OnlineDPO
DEFAULT = experiment.config_for(OnlineDPO, **experiment.ONLINE_DEFAULTS)

if __name__ == "__main__":
    experiment.main("online_dpo", OnlineDPO, DEFAULT, __doc__)
