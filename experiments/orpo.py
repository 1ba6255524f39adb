"""ORPO: NLL plus an odds-ratio preference term, no reference model.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``orpo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/orpo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("orpo"))
