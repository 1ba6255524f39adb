"""SimPO: reference-free, length-normalised preference optimisation (CPO-SimPO with --algo.nll-weight).

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.

    python -m experiments.simpo --model gemma_2b --data pairs.jsonl --lora.rank 8
    python -m experiments.simpo --algo.beta 2.5 --algo.gamma-beta-ratio 0.5

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``simpo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/simpo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("simpo"))
