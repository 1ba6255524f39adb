"""CPO: reference-free preference loss plus NLL on the chosen answers.

With no arguments: starts from the default SFT run (runs/sft) on the built-in preference pairs.

Defaults: ``cpo``'s ``defaults`` in ``nnx_posttrain.algorithms`` (a user's data) and
``nnx_posttrain/tasks/recipes/cpo.yaml`` (the built-in task's, ``--data builtin``).
"""

from nnx_posttrain.cli import experiment

if __name__ == "__main__":
    experiment("cpo")
