"""The one training loop (``loop.run``) and its parts: the jitted step and optimizer (``step``),
the device mesh (``mesh``), evaluation (``evaluation``), what runs between steps (``hooks``) and
what a run builds first (``setup``). May import everything below it (model, data, losses,
algorithms, runs); only experiments and tools import it."""

from nnx_posttrain.model import merge
from nnx_posttrain.train.loop import RunResult, run
from nnx_posttrain.train.mesh import (initialize_distributed, make_mesh, mesh_shape, place,
                                      shard_batch)
from nnx_posttrain.train.step import (init_state, make_eval_step, make_train_step, metric_means,
                                      optimizer, schedule)

__all__ = ["run", "RunResult", "merge", "initialize_distributed", "make_mesh", "mesh_shape",
           "place", "shard_batch", "init_state", "make_eval_step", "make_train_step",
           "metric_means", "optimizer", "schedule"]
