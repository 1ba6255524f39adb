"""Reading runs back: a checkpoint into a live NNX model in a fresh process (notebooks, tools)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nnx_posttrain import checkpoint, config as config_lib, model, train


@dataclasses.dataclass
class LoadedRun:
    run_dir: Path
    config: dict
    step: int
    lm: model.LanguageModel
    state: dict  # params, opt_state, step, rng — as saved
    module: nnx.Module  # the trained model with the checkpoint's weights in it: the backbone, or
    # the algorithm's wrapper around it (a reward model's scalar head, a policy's value head)


def load(run_dir: str | Path, step: int | None = None, mesh_devices: int = -1) -> LoadedRun:
    """Load ``run_dir``'s checkpoint ``step`` (default: the latest complete one) into a model built
    from the run's own config, laid out on a mesh of this process's devices."""
    run_dir = Path(run_dir)
    saved_cfg = json.loads((run_dir / "config.json").read_text())
    cfg = config_lib.Config(
        model=saved_cfg["model"], dtype=saved_cfg["dtype"], seed=saved_cfg["seed"],
        lora=config_lib.LoraConfig(**saved_cfg["lora"]),
        optim=config_lib.OptimConfig(**saved_cfg["optim"]),
        checkpoint=dataclasses.replace(config_lib.CheckpointConfig(), async_save=False),
    )
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in ckpt.all_steps():
            raise FileNotFoundError(
                f"{run_dir / 'checkpoints'}: no complete checkpoint"
                + (f" at step {step}; available: {ckpt.all_steps()}" if step is not None else "")
            )
        lm = model.load(cfg.model, dtype=cfg.dtype, seed=cfg.seed)
        if cfg.lora.rank:
            model.enable_lora(lm.module, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
        module = _algorithm_module(saved_cfg, lm)
        _, params, _ = model.split(module)
        tx, _ = train.optimizer(cfg.optim, saved_cfg["steps"])
        mesh = train.make_mesh(config_lib.MeshConfig(data=mesh_devices))
        template = train.init_state(params, tx, cfg.seed)
        abstract = checkpoint.abstract(template, NamedSharding(mesh, P()))
        state, _, _ = ckpt.restore(step, abstract, checkpoint.model_record(cfg, template))
    finally:
        ckpt.close()
    nnx.update(module, state["params"])
    return LoadedRun(run_dir, saved_cfg, step, lm, state, module)


def _algorithm_module(saved_cfg: dict, lm) -> nnx.Module:
    """The module the run trained: the algorithm (found by its settings' class name) builds it."""
    from nnx_posttrain import algorithms

    by_config = {a.Config.__name__: a for a in algorithms.registry().values()}
    algorithm = by_config.get(saved_cfg.get("algo_name"))
    if algorithm is None:
        return lm.module
    return algorithm(algorithm.Config(**(saved_cfg.get("algo") or {}))).build_module(lm)


def param_leaves(state) -> dict[str, jax.Array]:
    """{Keras variable path: array} of the trainable variables of a training state."""
    return model.named_variables(state["params"])


def init_weights(module, run_dir: str | Path) -> str:
    """Copy the weights of ``run_dir``'s latest checkpoint into ``module`` (same architecture),
    matching variables by their Keras path. Returns a one-line summary."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise SystemExit(
            f"--init-from {run_dir}: not a run directory (no config.json). The preference "
            "experiments start from the SFT run: run `python -m experiments.sft` first, or pass "
            "--init-from with another run, or --init-from '' to start from the model's own weights."
        )
    loaded = load(run_dir)
    if loaded.config["lora"]["rank"]:
        raise SystemExit(f"--init-from {run_dir}: a LoRA run; export it with LoRA merged first")
    source = model.named_variables(nnx.state(loaded.module))
    target = {v.path: v for v in module.weights}
    missing = sorted(set(target) - set(source))
    if missing or any(tuple(source[k].shape) != tuple(target[k].shape) for k in target):
        raise SystemExit(f"--init-from {run_dir}: its model ({loaded.config['model']}) does not "
                         f"match this one; e.g. {missing[:1] or 'shapes differ'}")
    for path, variable in target.items():
        variable.assign(source[path])
    return f"initialised from {run_dir} (step {loaded.step}, {len(target)} variables)"
