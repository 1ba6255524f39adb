"""CPO: reference-free preference loss plus NLL on the chosen answers.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``cpo``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/cpo.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("cpo"))
