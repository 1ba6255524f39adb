"""KTO: unpaired desirable / undesirable examples (prompt, completion, label).

With no arguments: starts from the default SFT run (runs/sft) on the built-in task's unpaired
examples (half labelled desirable with the correct sum, half undesirable with a wrong one).

Defaults (``nnx_posttrain.api.ORDER``): ``nnx_posttrain/config.py``, ``kto``'s ``defaults``
over it (a user's data), then ``nnx_posttrain/tasks/recipes/kto.yaml`` (``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    raise SystemExit(experiment("kto"))
