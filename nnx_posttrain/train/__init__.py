"""The one training loop and what it builds first.

    run = prepare(cfg, algorithm)      # train.run: model, data, state, evaluator, checkpoints
    result = train(run)                # train.loop: the steps, logs, evaluations, checkpoints
    metrics = evaluate_only(run)       # or: score the weights on the eval data
    run.close()                        # (or `with prepare(...) as run:`)
    prepare(cfg, algorithm, abstract=devices)   # the same run built for devices it will not
                                       # run on: shapes only (what nnx_posttrain.plan compiles)

Parts: the jitted step and optimizer (``step``), the device mesh (``mesh``), evaluation
(``evaluation``), what runs between steps (``hooks``), the model and data a run builds
(``setup``), resume rules (``resume``), the run directory (``rundir``), memory (``memory``,
``host_memory``). May import everything below it (model, data, losses, algorithms, runs); only
the API, the command line and tools import it. Nothing here names an algorithm or a data kind.
"""

from nnx_posttrain.model import merge
from nnx_posttrain.train.loop import RunResult, evaluate_only, train
from nnx_posttrain.train.mesh import (initialize_distributed, make_mesh, mesh_shape, place,
                                      shard_batch)
from nnx_posttrain.train.run import Run, prepare
from nnx_posttrain.train.step import (init_state, make_eval_step, make_train_step, metric_means,
                                      optimizer, schedule)

__all__ = ["prepare", "train", "evaluate_only", "Run", "RunResult", "merge",
           "initialize_distributed", "make_mesh", "mesh_shape", "place", "shard_batch",
           "init_state", "make_eval_step", "make_train_step", "metric_means", "optimizer",
           "schedule"]
