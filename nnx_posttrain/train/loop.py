"""The one training loop, for every algorithm.

    model + data (setup) -> state on the mesh -> algorithm.inputs -> [restore] ->
    for each step: batch = source.next(step, state); state = train_step(state, batch); hooks

The loop knows no algorithm: it iterates the algorithm's batch source (the dataset, or rollouts
of the policy) and calls the jitted step; logging, evaluation, checkpoints and the stop signal
are hooks that run after a step.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from nnx_posttrain import checkpoint, config as config_lib, model, runs, sharding
from nnx_posttrain.algorithms.base import RunContext
from nnx_posttrain.metrics_log import MetricsLog, SecondaryLog
from nnx_posttrain.train import setup
from nnx_posttrain.train import step as step_lib
from nnx_posttrain.train.evaluation import Evaluator
from nnx_posttrain.train.hooks import Hooks, StepInfo, StopSignals, Throughput
from nnx_posttrain.train.mesh import (check_micro_batch, initialize_distributed, make_mesh, place,
                                      shard_batch)


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    train: list[dict]
    eval: list[dict]
    state: dict
    lm: model.LanguageModel
    graphdef: object
    frozen: object
    stopped_by: str | None = None
    algorithm: object = None
    source: object = None  # the batch source (the dataset's batches, or the rollout engine)


def run(cfg: config_lib.Config, algorithm, experiment: str = "run", echo=print) -> RunResult:
    """Train (or, with ``eval_only``, evaluate) per ``cfg``; returns what notebooks and tests use.

    Resumes from the latest complete checkpoint of the run directory when there is one."""
    initialize_distributed(cfg.mesh)  # before anything touches the devices
    run_dir = Path(cfg.run_dir or f"runs/{experiment}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    resume_step = ckpt.latest_step()
    if cfg.resume and resume_step is None:
        raise SystemExit(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
    config_lib.save(cfg, run_dir / "config.json")
    mesh = make_mesh(cfg.mesh)
    check_micro_batch(cfg, mesh)
    lm, module = setup.build_model(cfg, algorithm, echo)
    train_src, eval_src, transform, skipped = setup.datasets(cfg, lm, algorithm, echo)

    graphdef, params, frozen_model = model.split(module)
    tx, lr = step_lib.optimizer(cfg.optim, cfg.steps)
    frozen = place({"model": frozen_model, "reference": None}, mesh)
    if algorithm.reference_mode == "copy":  # the starting weights, frozen (not donated)
        frozen["reference"] = place(jax.tree.map(jnp.copy, params), mesh)
    state = place(step_lib.init_state(params, tx, cfg.seed), mesh)
    record = checkpoint.model_record(cfg, state)
    ctx = RunContext(cfg, lm, graphdef, frozen, train_src, eval_src, transform, run_dir, echo,
                     load_run=runs.load)
    inputs = algorithm.inputs(ctx, state["params"])
    source = inputs.train
    if resume_step is not None:
        state, data_state, _ = ckpt.restore(resume_step, checkpoint.abstract(state), record)
        if data_state and not cfg.eval_only:
            source.set_state(data_state)
        echo(f"resumed from {ckpt.directory / str(resume_step)} (step {resume_step})")
    start = int(state["step"])

    train_step = jax.jit(
        step_lib.make_train_step(graphdef, algorithm.loss, tx, lr),
        donate_argnums=(0,),
        # pinned: without it the state's shardings drift after an update
        out_shardings=(sharding.tree_shardings(state, mesh), NamedSharding(mesh, P())),
    )
    evaluator = Evaluator(ctx, algorithm, inputs.eval,
                          jax.jit(step_lib.make_eval_step(graphdef, algorithm.loss)), mesh,
                          (state["params"], frozen["model"]))
    log = (MetricsLog(run_dir, keep_until=start if resume_step is not None else None,
                      echo=lambda s: tqdm.write(s) if echo else None)
           if jax.process_index() == 0 else SecondaryLog())  # process 0 writes the metrics
    result = RunResult(run_dir, [], [], state, lm, graphdef, frozen, algorithm=algorithm,
                       source=source)

    def evaluate(step, state):
        metrics = evaluator(state["params"], frozen, step)
        if metrics:
            result.eval.append(log.log(step, "eval", metrics))
        return metrics

    try:
        if cfg.eval_only:
            print(json.dumps(evaluate(start, state), indent=2))
            return result
        if start == 0:
            evaluate(0, state)
        elif start >= cfg.steps:
            echo(f"{run_dir} is already complete at step {start} (--steps {cfg.steps}); nothing to "
                 "do. Raise --steps to continue training, or choose another --run-dir.")
            return result
        bar = tqdm(total=cfg.steps, initial=start, desc=experiment, unit="step", dynamic_ncols=True)
        throughput = Throughput()
        with StopSignals() as stop:
            hooks = _hooks(cfg, result, log, bar, throughput, source, ckpt, record, stop, evaluate,
                           echo)
            for step in range(start + 1, cfg.steps + 1):
                host_batch = source.next(step, state)
                throughput.count(host_batch)
                batch = shard_batch(source.to_device(host_batch), mesh, cfg.batching.grad_accum)
                state, metrics = train_step(state, frozen, batch)
                result.state = state
                bar.update(1)
                if step == start + 1:  # the first step compiles: keep it out of the throughput
                    throughput.first_step_done(state)
                hooks.after(StepInfo(step, state, metrics, last=step == cfg.steps,
                                     stopping=stop.received is not None,
                                     boundary=source.checkpoint_ok(step)))
        bar.close()
        echo(f"done: {cfg.steps} steps; run directory {run_dir}"
             + (f"; {skipped} bad records were skipped (--batching.skip-bad)" if skipped else ""))
    finally:
        ckpt.close()
        log.close()
        source.close()
    return result


def _hooks(cfg, result, log, bar, throughput, source, ckpt, record, stop, evaluate, echo) -> Hooks:
    """Logging every --log-every steps, evaluation every --eval.every, checkpoints every
    --checkpoint.every (only where the batch source allows one), the stop signal; all at the end."""

    def log_train(info):
        metrics = {k: float(v) for k, v in jax.device_get(info.metrics).items()}
        metrics.update(throughput.read())
        metrics.update(source.host_metrics())
        result.train.append(log.log(info.step, "train", metrics, echo=False))
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['learning_rate']:.2e}")

    def evaluate_now(info):
        info.eval = evaluate(info.step, info.state)
        throughput.pause_done()

    def save(info):
        saved = {"model_record": record, "config": config_lib.to_dict(cfg), "step": info.step}
        ckpt.save(info.step, info.state, source.get_state(), saved, metrics=info.eval or None)

    def stop_now(info):
        name = signal.Signals(stop.received).name
        ckpt.wait()
        bar.close()
        echo(f"{name}: saved checkpoint at step {info.step} in {ckpt.directory}; "
             "run the same command again to resume")
        result.stopped_by = name
        raise SystemExit(128 + stop.received)

    every = cfg.checkpoint.every
    hooks = Hooks()
    hooks.add(log_train, every=cfg.log_every, when=lambda i: i.last or i.stopping)
    hooks.add(evaluate_now, every=cfg.eval.every, when=lambda i: i.last)
    hooks.add(save, when=lambda i: (bool(every and i.step % every == 0) or i.stopping) and i.boundary
              or i.last)
    hooks.add(stop_now, when=lambda i: i.stopping and (i.boundary or i.last))
    return hooks
