"""Supervised fine-tuning. With no arguments: the tiny built-in Gemma learns two-digit addition.

    python -m experiments.sft                         # built-in default, offline, a few minutes on CPU
    python -m experiments.sft --model gemma_2b --data chats.jsonl --lora.rank 8
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import SFT

ALGORITHM = SFT
# A user's data: TRL's defaults (SFTConfig's learning rate 2e-5).
DEFAULT = experiment.config_for(SFT, experiment.PREFERENCE_DATA, optim=dict(learning_rate=2e-5))
# The built-in task (--data builtin, the default): its tuned recipe.
BUILTIN = dict(
    steps=600,
    remat="none",
    optim=dict(learning_rate=3e-3, warmup_steps=30, min_lr_ratio=0.1,
               weight_decay=0.0),
    batching=dict(batch_size=32, grad_accum=1, max_length=32),
    eval=dict(every=200, exact_match=500, max_new_tokens=8),
)

if __name__ == "__main__":
    experiment.main("sft", SFT, DEFAULT, __doc__, builtin=BUILTIN)
