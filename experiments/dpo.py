"""Direct Preference Optimization (and its TRL variants via --algo.loss-type).

With no arguments: starts from the default SFT run (runs/sft) and trains on the built-in task's
preference pairs (chosen = the correct sum, rejected = a plausible wrong one).

    python -m experiments.dpo --algo.loss-type ipo --algo.beta 0.5
    python -m experiments.dpo --model gemma_2b --data pairs.jsonl --lora.rank 8

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``dpo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/dpo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("dpo"))
