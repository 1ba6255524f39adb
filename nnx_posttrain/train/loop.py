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
import os
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from nnx_posttrain import (checkpoint, config as config_lib, host_allocator, metrics_log, model,
                           progress, runs, sharding)
from nnx_posttrain.algorithms.base import RunContext
from nnx_posttrain.metrics_log import MetricsLog, SecondaryLog
from nnx_posttrain.train import host_memory, memory, resume, rundir, setup
from nnx_posttrain.train import step as step_lib
from nnx_posttrain.train.evaluation import Evaluator
from nnx_posttrain.train.hooks import (Hooks, Interruptible, NonFiniteGuard, NonFiniteStep,
                                       StepInfo, StopSignals, Throughput)
from nnx_posttrain.train.mesh import (check_micro_batch, cpu_devices_for, initialize_distributed,
                                      make_mesh, place, shard_batch, split_host_cpu)


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

    Resumes from the latest complete checkpoint of the run directory when there is one (its
    settings must match: ``resume``); holds the directory's lock throughout (``rundir``)."""
    interruptible = Interruptible()  # a Ctrl-C from here on stops the run, wherever it lands
    try:
        with interruptible:
            interruptible.check()
            return _start(cfg, algorithm, experiment, echo, interruptible.check)
    except KeyboardInterrupt:
        print(f"interrupted ({'Ctrl-C' if interruptible.interrupted else 'Ctrl-C twice'}): "
              "stopped without writing a checkpoint; the run resumes from its latest complete "
              "one" + (", if it has one" if interruptible.interrupted else ""), file=sys.stderr)
        _exit_aborted()


def _start(cfg, algorithm, experiment, echo, interrupted) -> RunResult:
    """``run`` once Ctrl-C is handled: the devices and mesh, the run directory and its lock."""
    cpu_devices, why = cpu_devices_for(cfg)
    got = split_host_cpu(cpu_devices, cfg.mesh.cpu_devices)  # before anything starts JAX's backends
    if why:
        echo(f"mesh: {why}" + (f"; this process had already started JAX with {got}"
                                if got != cpu_devices else ""))
    initialize_distributed(cfg.mesh)  # before anything touches the devices
    host_memory.release_after_compiles()  # the compiler's freed memory goes back after each compile
    mesh = make_mesh(cfg.mesh)
    if mesh.size > 1:
        echo(f"mesh: {' x '.join(f'{k} {v}' for k, v in mesh.shape.items())} "
             f"({mesh.size} {mesh.devices.flat[0].platform} devices)")
    check_micro_batch(cfg, mesh)  # before the run directory exists: a refused run leaves none
    allowed = resume.allowed_keys(cfg.resume_changed)
    interrupted()  # a Ctrl-C Python swallowed while JAX started
    run_dir = Path(cfg.run_dir or f"runs/{experiment}")
    created = not run_dir.exists()
    run_dir = rundir.prepare(run_dir)
    try:
        lock = rundir.RunLock(run_dir, echo, jax.process_index() == 0)
        with rundir.sigterm_exits(lock.release), lock:
            return _run(cfg, algorithm, experiment, echo, run_dir, allowed, mesh, interrupted)
    except BaseException:  # refused (bad data, a setting, Ctrl-C) before writing anything: no
        if created and jax.process_index() == 0:  # directory
            rundir.remove_if_unused(run_dir)
        raise


def _exit_aborted() -> None:
    """Exit status 130 after Ctrl-C twice. A command (``python -m experiments...``) ends its process
    here, streams flushed: the run's own files are closed by now, and the threads of a checkpoint
    save the abort cut short would otherwise print a page of tracebacks at interpreter shutdown
    (closed event loops, a shut-down executor). Elsewhere (a notebook, a test): ``SystemExit``."""
    if host_allocator.started_as_command("experiments"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)
    raise SystemExit(128 + signal.SIGINT) from None


def _run(cfg, algorithm, experiment, echo, run_dir, allowed, mesh, interrupted) -> RunResult:
    ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    closing = [ckpt.close]
    try:
        record = resume.run_record(cfg, algorithm)
        changes = {}

        def check_settings(saved):  # of the checkpoint a training run resumes from
            if not cfg.eval_only:
                changes.update(resume.check(saved, record, allowed,
                                            f"{ckpt.directory}/{saved.get('step')}", run_dir))

        latest = ckpt.latest_intact_step(echo)  # damaged ones set aside
        if cfg.resume and latest is None:
            raise SystemExit(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        saved = ckpt.read_record(latest) if latest is not None else {}
        if latest is not None:  # refuse other settings before the model loads
            check_settings(saved)
        # the --init-from checkpoint a run starts from stays its own when that run trains on
        pinned = saved.get("init_from_step")
        record["init_from_step"] = (pinned if pinned is not None and cfg.init_from
                                    else runs.latest_step(cfg.init_from))
        train_src, eval_src = setup.sources(cfg, algorithm)  # a missing file: before the model
        lm, module = setup.build_model(cfg, algorithm, echo, record["init_from_step"])
        interrupted()  # a Ctrl-C Python swallowed while the model loaded
        graphdef, params, frozen_model = model.split(module)
        copy_reference = algorithm.reference_mode == "copy" and not (
            cfg.eval_only and latest is None)  # scoring the starting weights: they are the reference
        memory.check(cfg, lm.module, params, setup.sequences_per_example(algorithm),
                     copy_reference, dict(mesh.shape), echo)
        train_src, eval_src, transform, skipped = setup.datasets(cfg, lm, algorithm, echo,
                                                                 train_src, eval_src)

        frozen = place({"model": frozen_model, "reference": None}, mesh)
        if cfg.eval_only:  # the weights alone: no optimizer state
            tx = lr = None
            state = place({"params": params, "step": jnp.zeros((), jnp.int32),
                           "rng": jax.random.key_data(jax.random.key(cfg.seed))}, mesh)
        else:
            tx, lr = step_lib.optimizer(cfg.optim, cfg.steps)
            state = place(step_lib.init_state(params, tx, cfg.seed), mesh)
        if copy_reference:  # the starting weights, frozen (not donated)
            frozen["reference"] = place(jax.tree.map(jnp.copy, state["params"]), mesh)
        elif algorithm.reference_mode == "copy":
            frozen["reference"] = state["params"]
        record["model_record"] = checkpoint.model_record(cfg, state)
        ctx = RunContext(cfg, lm, graphdef, frozen, train_src, eval_src, transform, run_dir, echo,
                         load_run=runs.load)
        inputs = algorithm.inputs(ctx, state["params"])
        source = inputs.train
        closing.append(source.close)
        restored = None
        if latest is not None:
            restored = ckpt.restore_latest(checkpoint.abstract(state), record["model_record"],
                                           check_settings, echo, weights_only=cfg.eval_only)
        if restored is not None:
            state, data_state = restored[1], restored[2]
            if data_state and not cfg.eval_only:
                source.set_state(data_state)
            if cfg.eval_only:  # the module holds the weights scored: the starting ones are freed
                nnx.update(module, state["params"])
                del params
        if restored is not None and not cfg.eval_only and int(state["step"]) < cfg.steps:
            echo(f"resumed from {ckpt.directory / str(restored[0])} (step {restored[0]})"
                 + "".join(f"\n  changed: {k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
                 + ("\n  the learning-rate schedule now spans the new --steps" if "steps" in changes
                    and cfg.optim.schedule != "constant" else ""))
        start = int(state["step"])
        evaluator = Evaluator(ctx, algorithm, inputs.eval,
                              jax.jit(step_lib.make_eval_step(graphdef, algorithm.loss)), mesh,
                              (state["params"], frozen["model"]), source=source)
        setup.check_evaluation(cfg, algorithm, evaluator, state["params"], frozen)
        result = RunResult(run_dir, [], [], state, lm, graphdef, frozen, algorithm=algorithm,
                           source=source)
        if not cfg.eval_only and start >= cfg.steps and restored is not None:
            echo(f"{run_dir} is already complete at step {start} (--steps {cfg.steps}); nothing to "
                 "do. Raise --steps to continue training, or choose another --run-dir.")
            return result
        if not cfg.eval_only and jax.process_index() == 0:  # known to start: settings, history
            config_lib.save(cfg, run_dir / "config.json")
            rundir.append_history(run_dir, "resume" if restored else "start", start, changes)
        log = (MetricsLog(run_dir, keep_until=None if cfg.eval_only else
                          (start if restored is not None else -1),
                          echo=_console(echo), report_to=cfg.report_to,
                          config=config_lib.to_dict(cfg))
               if jax.process_index() == 0 else SecondaryLog())  # process 0 writes the metrics
        closing.append(log.close)
        if not cfg.eval_only and jax.process_index() == 0:  # per-problem records: as the log
            metrics_log.trim(run_dir / "exact_match.jsonl", start if restored is not None else -1,
                             _console(echo), missing_ok=True)

        def evaluate(step, state, fields=None):
            metrics = evaluator(state["params"], frozen, step)
            if metrics:
                result.eval.append(log.log(step, "eval", metrics, fields=fields))
                log.completions(step, "eval", [{**(fields or {}), **row}  # eval-only rows: kept
                                             for row in evaluator.completions])
            return metrics

        if cfg.eval_only:
            scored = (f"checkpoint {restored[0]}" if restored is not None else "initial weights")
            echo(f"--eval-only: scoring {'the ' * (restored is None)}{scored}"
                 + (f" ({ckpt.directory / str(restored[0])})" if restored is not None else
                    f" (no checkpoint in {ckpt.directory})"))
            print(json.dumps(evaluate(start, state, {"eval_only": scored}), indent=2))
            return result
        interrupted()
        # what the logs go on from: a checkpoint from before num_tokens was counted has none
        saved = restored[3] if restored is not None else {"num_tokens": 0}
        _train(cfg, experiment, echo, run_dir, result, state, start, source, mesh, frozen, log,
               ckpt, record, evaluate, skipped, interrupted, saved.get("num_tokens"),
               saved.get("unlogged_metrics", []),
               jax.jit(step_lib.make_train_step(graphdef, algorithm.loss, tx, lr),
                       donate_argnums=(0,),
                       # pinned: without it the state's shardings drift after an update
                       out_shardings=(sharding.tree_shardings(state, mesh),
                                      NamedSharding(mesh, P()))))
        return result
    finally:  # waits for the checkpoint being written: a Ctrl-C meanwhile says so, waits
        with StopSignals(_console(echo)) as signals, signals.saving():
            for close in reversed(closing):
                close()


def _train(cfg, experiment, echo, run_dir, result, state, start, source, mesh, frozen, log, ckpt,
           record, evaluate, skipped, interrupted, seen, unlogged, train_step) -> None:
    if start == 0:
        evaluate(0, state)
        interrupted()
    bar = progress.bar(total=cfg.steps, initial=start, desc=experiment, unit="step",
                       dynamic_ncols=True)
    throughput = Throughput(seen)
    guard = NonFiniteGuard(cfg.optim.on_nonfinite, _console(echo))
    try:
        with StopSignals(_console(echo)) as stop:
            hooks = _hooks(cfg, result, log, bar, throughput, source, ckpt, record, stop,
                           evaluate, echo, guard, list(unlogged))
            for step in range(start + 1, cfg.steps + 1):
                host_batch = source.next(step, state)
                throughput.count(host_batch)
                batch = shard_batch(source.to_device(host_batch), mesh, cfg.batching.grad_accum)
                state, metrics = train_step(state, frozen, batch)
                result.state = state
                guard.push(step, metrics)  # checks the step before (this one is running)
                bar.update(1)
                stop.check()  # a second Ctrl-C that landed where Python could not raise it
                if step == start + 1:  # the first step compiles: keep it out of the throughput
                    throughput.first_step_done(state)
                hooks.after(StepInfo(step, state, metrics, last=step == cfg.steps,
                                     stopping=stop.received is not None,
                                     boundary=source.checkpoint_ok(step)))
            guard.flush()
    except NonFiniteStep as exc:
        bar.close()
        ckpt.wait()
        kept = ckpt.all_steps()
        raise SystemExit(
            f"error: {exc}: the update was not applied and training stopped "
            f"(--optim.on-nonfinite {cfg.optim.on_nonfinite}). No checkpoint was written after "
            f"it; kept in {ckpt.directory}: "
            + (f"steps {', '.join(map(str, kept))}" if kept else "none")
            + ". Lower --optim.learning-rate, clip gradients (--optim.max-grad-norm), or skip "
            "such steps (--optim.on-nonfinite skip); resuming with another learning rate needs "
            "--resume-changed optim.learning_rate.") from None
    bar.close()
    echo(f"done: {cfg.steps} steps; run directory {run_dir}"
         + (f"; {skipped} bad records were skipped (--batching.skip-bad)" if skipped else "")
         + (f"; {guard.skipped} non-finite steps were skipped" if guard.skipped else ""))


def _console(echo):
    """Lines printed while the progress bar runs (nothing when ``echo`` is None)."""
    return lambda line: tqdm.write(line) if echo else None


def _host(steps: list[dict]) -> list[dict]:
    """Steps' device metrics as host floats (one transfer for all)."""
    return [{k: float(v) for k, v in m.items()} for m in jax.device_get(steps)]


def _hooks(cfg, result, log, bar, throughput, source, ckpt, record, stop, evaluate, echo,
           guard, pending) -> Hooks:
    """Logging every --log-every steps (each metric the mean of the steps since the last log,
    ``pending``), evaluation every --eval.every, checkpoints every --checkpoint.every (only
    where the batch source allows one, and only after the step's non-finite check), the stop
    signal; all at the end."""

    def collect(info):  # every step's device metrics, fetched when logged
        pending.append(info.metrics)

    def log_train(info):
        metrics = step_lib.interval_means(_host(pending))  # TRL's: the interval's means
        pending.clear()
        nonfinite = metrics.pop("nonfinite")  # this step's flag: not checked by the guard yet
        if cfg.optim.on_nonfinite == "skip":
            metrics["skipped_steps"] = float(guard.skipped + nonfinite)
        metrics.update(throughput.read())
        metrics.update(source.host_metrics())
        result.train.append(log.log(info.step, "train", metrics, echo=False))
        log.completions(info.step, "train", getattr(source, "logged_completions", list)())
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['learning_rate']:.2e}",
                        refresh=False)  # shown at the bar's next redraw (progress.interval)

    def evaluate_now(info):
        guard.flush()
        info.eval = evaluate(info.step, info.state)
        throughput.pause_done()

    def save(info):
        guard.flush()  # never a checkpoint after an unchecked step
        saved = {**record, "step": info.step, "num_tokens": throughput.seen,
                 "unlogged_metrics": _host(pending)}  # a resumed run's next log averages them
        with stop.saving():  # (Orbax may wait here for the previous checkpoint)
            ckpt.save(info.step, info.state, source.get_state(), saved, metrics=info.eval or None)

    def stop_now(info):
        name = signal.Signals(stop.received).name
        with stop.saving():
            ckpt.wait()
        bar.close()
        echo(f"{name}: saved checkpoint at step {info.step} in {ckpt.directory}; "
             "run the same command again to resume")
        result.stopped_by = name
        raise SystemExit(128 + stop.received)

    every = cfg.checkpoint.every
    hooks = Hooks()
    hooks.add(collect, every=1)
    hooks.add(log_train, every=cfg.log_every, when=lambda i: i.last or i.stopping)
    hooks.add(evaluate_now, every=cfg.eval.every, when=lambda i: i.last)
    hooks.add(save, when=lambda i: (bool(every and i.step % every == 0) or i.stopping) and i.boundary
              or i.last)
    hooks.add(stop_now, when=lambda i: i.stopping and (i.boundary or i.last))
    return hooks
