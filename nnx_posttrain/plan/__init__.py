"""Plan a run before renting its accelerators: the run's own training step compiled ahead of time
for a TPU topology (or this host's CPU as N devices) on this machine, abstractly (no weight read,
nothing allocated), and what it needs per device.

    from nnx_posttrain import plan
    p = plan.plan(cfg, algorithm, plan.resolve("v5e-16"))   # -> plan.Plan
    print(p.table())

The command line: ``nnx-posttrain plan ALGORITHM [the run's options] --topology v5e-16``.
"""

from nnx_posttrain.plan.compiled import Plan, collectives, plan
from nnx_posttrain.plan.topology import GENERATIONS, Topology, chip_grid, resolve

__all__ = ["GENERATIONS", "Plan", "Topology", "chip_grid", "collectives", "plan", "resolve"]
