"""Supervised fine-tuning. With no arguments: the tiny built-in Gemma learns two-digit addition.

    python -m experiments.sft                         # built-in default, offline, a few minutes on CPU
    python -m experiments.sft --model gemma_2b --data chats.jsonl --lora.rank 8
"""

from nnx_posttrain import experiment
from nnx_posttrain.algorithms import SFT

ALGORITHM = SFT
DEFAULT = experiment.config_for(
    SFT,
    steps=600,
    optim=dict(learning_rate=3e-3, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.0),
    batching=dict(batch_size=32, max_length=32),
    eval=dict(every=200, exact_match=500),
)

if __name__ == "__main__":
    experiment.main("sft", SFT, DEFAULT, __doc__)
