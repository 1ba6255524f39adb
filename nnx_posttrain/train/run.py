"""What a run builds before its first step: ``prepare(cfg, algorithm) -> Run``.

    devices and mesh -> run directory (created, locked) -> checkpoints and the settings they
    were written with (a changed setting is refused here, before the model loads) -> data
    opened -> model -> memory check -> data validated -> training state on the mesh -> the
    algorithm's batch source -> the latest checkpoint restored -> the evaluator

``Run`` holds all of it by name and owns what must be closed (the batch source, the
checkpointer, the lock, the signal handlers): use it as a context manager, or call ``close()``.
``train.train(run)`` and ``train.evaluate_only(run)`` take it from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from nnx_posttrain import checkpoint, cpu_host, errors, model, runs, tasks
from nnx_posttrain.progress import console
from nnx_posttrain.algorithms.base import RunContext
from nnx_posttrain.train import compile_cache, host_memory, memory, resume, rundir, setup, storage
from nnx_posttrain.train import step as step_lib
from nnx_posttrain.train.evaluation import Evaluator
from nnx_posttrain.train.hooks import Interruptible, StopSignals
from nnx_posttrain.train.mesh import (check_micro_batch, cpu_devices_for, initialize_distributed,
                                      make_mesh, place, split_host_cpu)


@dataclasses.dataclass
class Restored:
    """The checkpoint a run continues from (or, evaluating, scores)."""

    step: int
    data_state: dict | None  # the batch source's position (None when evaluating)
    record: dict  # what the checkpoint recorded besides the state (num_tokens, unlogged metrics)
    path: Path


@dataclasses.dataclass
class Run:
    """A prepared run: everything ``train`` and ``evaluate_only`` read, by name."""

    cfg: Any  # nnx_posttrain.config.Config, with the settings that depend on the data resolved
    algorithm: Any
    run_dir: Path
    echo: Callable[[str], None]
    interrupted: Callable[[], None] = lambda: None  # raises a Ctrl-C Python swallowed
    resources: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)
    guards: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)
    mesh: jax.sharding.Mesh | None = None
    checkpointer: checkpoint.Checkpointer | None = None
    record: dict | None = None  # what every checkpoint of this run records (resume.run_record)
    changes: dict = dataclasses.field(default_factory=dict)  # a resume's: {key: [before, after]}
    lm: model.LanguageModel | None = None
    module: Any = None  # the trained nnx.Module (the backbone, or the algorithm's wrapper)
    graphdef: Any = None
    frozen: dict | None = None  # {"model": frozen variables, "reference": starting weights or None}
    state: dict | None = None  # {params, step, rng} (+ opt_state training); the latest as it trains
    optimizer: tuple | None = None  # (optax transformation, learning-rate schedule); None: evaluating
    inputs: Any = None  # the algorithm's Inputs: its batch source, the eval-loss batches
    source: Any = None  # the algorithm's BatchSource (inputs.train)
    skipped: int = 0  # bad records skipped (--batching.skip-bad)
    restored: Restored | None = None
    start_step: int = 0  # the step training starts after (a restored checkpoint's)
    evaluator: Evaluator | None = None

    def close(self) -> None:
        """Waits for a checkpoint being written (a Ctrl-C meanwhile says so and waits), closes
        the batch source and the checkpointer, then releases the lock and restores the signal
        handlers."""
        try:
            with StopSignals(console(self.echo)) as signals, signals.saving():
                self.resources.close()
        finally:
            self.guards.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            self.close()
        except Exception as exc:  # the last checkpoint's write failed as it was awaited
            if storage.fault_of(exc, self.run_dir) is None:
                raise
            if value is None:
                raise storage.error(self.run_dir, exc) from None
            # else: the error already on its way (the same fault, reported) is what is said


def prepare(cfg, algorithm, echo=print) -> Run:
    """Build a run of ``algorithm`` (an instance) with settings ``cfg``; raises a ``UserError``
    naming the problem, leaving no new run directory behind, when it cannot run. The built-in
    task's data and models are registered first (``tasks.register``)."""
    tasks.register()
    run = Run(cfg, algorithm, Path(cfg.run_dir or f"runs/{algorithm.name}"), echo)
    created = not run.run_dir.exists()
    try:
        run.interrupted = run.guards.enter_context(Interruptible()).check
        run.guards.enter_context(checkpoint.quiet_failed_io())
        run.guards.enter_context(storage.quiet_logs(run.run_dir))
        run.interrupted()
        run.cfg = setup.settings_for_data(cfg, algorithm, echo)
        compile_cache.use(run.cfg.compile_cache, run.run_dir, echo)  # before anything compiles
        run.mesh = _devices(run.cfg, echo)
        # the run's mesh in context (kernels XLA cannot partition run per device: model.attention)
        run.guards.enter_context(jax.set_mesh(run.mesh))
        _lock(run)
        latest, allowed = _open_checkpoints(run)
        sources = algorithm.open_sources(run.cfg)  # a missing file: before the model loads
        params, reference_copy = _build_model(run, latest)
        run.interrupted()  # a Ctrl-C Python swallowed while the model loaded
        ctx = _build_state(run, params, reference_copy, sources)
        run.restored = _restore(run, latest, allowed)
        run.start_step = int(run.state["step"])
        run.evaluator = Evaluator(ctx, algorithm, run.inputs, run.mesh, run.state["params"])
        setup.check_evaluation(run.cfg, algorithm, run.evaluator, run.state["params"], run.frozen)
        return run
    except BaseException:
        try:
            run.resources.close()
        finally:
            run.guards.close()
        if created and jax.process_index() == 0:  # refused before writing anything: no directory
            rundir.remove_if_unused(run.run_dir)
        raise


def _devices(cfg, echo) -> jax.sharding.Mesh:
    """The CPU split, multi-process start-up and the mesh, before anything else touches JAX."""
    cpu_host.prefer_cpu()
    cpu_devices, why = cpu_devices_for(cfg)
    got = split_host_cpu(cpu_devices, cfg.mesh.cpu_devices)
    if why:
        echo(f"mesh: {why}" + (f"; this process had already started JAX with {got}"
                                if got != cpu_devices else ""))
    initialize_distributed(cfg.mesh)
    host_memory.release_after_compiles()
    mesh = make_mesh(cfg.mesh)
    if mesh.size > 1:
        echo(f"mesh: {' x '.join(f'{k} {v}' for k, v in mesh.shape.items())} "
             f"({mesh.size} {mesh.devices.flat[0].platform} devices)")
    check_micro_batch(cfg, mesh)  # before the run directory exists: a refused run leaves none
    return mesh


def _lock(run: Run) -> None:
    """The run directory created and locked; SIGTERM before training ends the run cleanly."""
    rundir.prepare(run.run_dir)
    lock = rundir.RunLock(run.run_dir, run.echo, jax.process_index() == 0)
    run.guards.enter_context(lock)
    run.guards.enter_context(rundir.sigterm_exits())


def _open_checkpoints(run: Run) -> tuple[int | None, set]:
    """The checkpointer, the run's record, and (the latest intact checkpoint or None, the
    settings a resume may change); another setting is refused here, before the model loads."""
    cfg = run.cfg
    allowed = resume.allowed_keys(cfg.resume_changed)
    run.checkpointer = checkpoint.Checkpointer(run.run_dir / "checkpoints", cfg.checkpoint)
    run.resources.callback(run.checkpointer.close)
    run.record = resume.run_record(cfg, run.algorithm)
    if not cfg.eval_only:  # a resume rewrites config.json: a hand edit of it is not dropped
        resume.check_config_edit(run.run_dir, cfg)
    latest, run.changes = _latest_checkpoint(cfg, run.checkpointer, run.record, allowed, run.echo)
    return latest, allowed


def _build_model(run: Run, latest: int | None):
    """The model (``run.lm``, ``run.module``, ``run.graphdef``), the host allocator, the memory
    check; returns (the trainable weights, whether the reference is a copy of them)."""
    cfg, algorithm, echo = run.cfg, run.algorithm, run.echo
    run.lm, run.module = setup.build_model(cfg, algorithm, echo, run.record["init_from_step"])
    if jax.default_backend() == "cpu":
        echo(host_memory.set_allocator(host_memory.choose(
            cfg.host_allocator, run.lm.tokenizer.vocab_size, int(run.lm.module.hidden_dim))))
    run.graphdef, params, frozen_model = model.split(run.module)
    run.frozen = {"model": frozen_model, "reference": None}
    reference_copy = algorithm.reference_mode == "copy" and not (cfg.eval_only and latest is None)
    memory.check(cfg, memory.estimate(cfg, run.lm.module, params, algorithm.sequences_per_example,
                                      reference_copy, dict(run.mesh.shape)), echo)
    return params, reference_copy


def _build_state(run: Run, params, reference_copy: bool, sources) -> RunContext:
    """The validated data, the state and frozen variables on the mesh, the algorithm's inputs
    (``run.source``, ``run.inputs``); returns the context the algorithm was handed."""
    cfg, algorithm = run.cfg, run.algorithm
    ds = setup.datasets(cfg, run.lm, algorithm, run.echo, *sources)
    run.skipped = ds.skipped
    run.optimizer = None if cfg.eval_only else step_lib.optimizer(cfg.optim, cfg.steps)
    run.state = place(_initial_state(params, run.optimizer, cfg.seed), run.mesh)
    run.frozen = place(run.frozen, run.mesh)
    memory.check_weights(cfg, f"the {algorithm.name} partner model", algorithm.partner_bytes())
    partner = algorithm.partner(run.lm, run.echo, runs.load)
    if partner is not None:  # another frozen model the loss reads (its state; no optimizer)
        run.frozen["partner"] = place(partner, run.mesh)
    if reference_copy:  # the starting weights, frozen (not donated)
        run.frozen["reference"] = place(jax.tree.map(jnp.copy, run.state["params"]), run.mesh)
    elif algorithm.reference_mode == "copy":  # scoring the starting weights: the reference
        run.frozen["reference"] = run.state["params"]
    run.record["model_record"] = checkpoint.model_record(cfg, run.state)
    ctx = RunContext(cfg, run.lm, run.graphdef, run.frozen, ds.train, ds.eval, ds.transform,
                     run.run_dir, run.echo, load_run=runs.load)
    run.inputs = algorithm.inputs(ctx, run.state["params"])
    run.source = run.inputs.train
    run.resources.callback(run.source.close)
    return ctx


def _initial_state(params, optimizer, seed: int) -> dict:
    """The training state, or for evaluation the weights alone (no optimizer state)."""
    if optimizer is None:
        return {"params": params, "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.key(seed))}
    return step_lib.init_state(params, optimizer[0], seed)


def _latest_checkpoint(cfg, ckpt, record, allowed, echo) -> tuple[int | None, dict]:
    """(the latest intact checkpoint step or None, the setting changes a resume from it makes),
    refusing other settings before the model loads; pins the ``--init-from`` step the run
    started from in ``record``."""
    latest = ckpt.latest_intact_step(echo)  # damaged ones set aside
    if cfg.resume and latest is None:
        raise errors.CheckpointError(
            f"--resume: no complete checkpoint in {ckpt.directory}")
    saved = ckpt.read_record(latest) if latest is not None else {}
    changes = {}
    if latest is not None and not cfg.eval_only:
        changes = resume.check(saved, record, allowed, f"{ckpt.directory}/{latest}",
                               ckpt.directory.parent)
    pinned = saved.get("init_from_step")  # the --init-from checkpoint a run started from
    record["init_from_step"] = (pinned if pinned is not None and cfg.init_from
                                else runs.latest_step(cfg.init_from))
    return latest, changes


def _restore(run: Run, latest: int | None, allowed) -> Restored | None:
    """The newest checkpoint that restores, into ``run.state`` (and the batch source's
    position); evaluating, its weights alone, also put into ``run.module``."""
    if latest is None:
        return None
    cfg, ckpt = run.cfg, run.checkpointer

    def check_settings(saved):  # of the checkpoint actually restored (an older one if damaged)
        if not cfg.eval_only:
            run.changes.update(resume.check(saved, run.record, allowed,
                                            f"{ckpt.directory}/{saved.get('step')}", run.run_dir))

    got = ckpt.restore_latest(checkpoint.abstract(run.state), run.record["model_record"],
                              check_settings, run.echo, weights_only=cfg.eval_only)
    if got is None:
        return None
    step, run.state, data_state, saved = got
    if cfg.eval_only:  # the module holds the weights scored
        from flax import nnx

        nnx.update(run.module, run.state["params"])
    elif data_state:
        run.source.set_state(data_state)
    return Restored(step, data_state, saved, ckpt.directory / str(step))
