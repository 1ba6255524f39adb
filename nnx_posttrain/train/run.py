"""What a run builds before its first step: ``prepare(cfg, algorithm) -> Run``.

    devices and mesh -> run directory (created, locked) -> checkpoints and the settings they
    were written with (a changed setting is refused here, before the model loads) -> data
    opened -> model -> memory check -> data validated -> training state on the mesh -> the
    algorithm's batch source -> the latest checkpoint restored -> the evaluator

``Run`` holds all of it by name and owns what must be closed (the batch source, the
checkpointer, the lock, the signal handlers): use it as a context manager, or call ``close()``.
``train.train(run)`` and ``train.evaluate_only(run)`` take it from there.

``prepare(cfg, algorithm, abstract=devices)`` is the same sequence for devices the run will not
run on (a TPU topology's, ``nnx_posttrain.plan``), minus what only a running run needs: the mesh
over those devices, no run directory, checkpoint, batch source or evaluator, the model built
without weights and the state as shapes laid out on the mesh.
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
from nnx_posttrain.train.mesh import (abstract_mesh, check_micro_batch, cpu_devices_for,
                                      initialize_distributed, make_mesh, place, place_abstract,
                                      split_host_cpu)


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
    context: RunContext | None = None  # what the algorithm is handed (builds its inputs on)
    abstract: bool = False  # built for devices it will not run on (``prepare``'s ``abstract``)

    @property
    def load_run(self):
        """What reads another run's weights (a reward model, a teacher): ``runs.load``; None when
        abstract (no weights are read: a reward-model run is only checked)."""
        return None if self.abstract else runs.load

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


def prepare(cfg, algorithm, echo=print, abstract=None) -> Run:
    """Build a run of ``algorithm`` (an instance) with settings ``cfg``; raises a ``UserError``
    naming the problem, leaving no new run directory behind, when it cannot run. The built-in
    task's data and models are registered first (``tasks.register``).

    ``abstract``: the devices to build the run for without running it (a list of devices, or an
    object with ``devices`` and ``slices``: ``plan.Topology``): the same sequence on a mesh over
    them, the data read and validated, the model built without weights, the state and frozen
    weights ``jax.ShapeDtypeStruct``s laid out on the mesh; no run directory created or locked,
    no checkpoint opened, no weights read, no memory check against this host's memory, no batch
    source or evaluator, nothing allocated, nothing left open. Its ``context`` is what the
    algorithm would build its batch source on; ``train.loop.compile_step`` gives its step."""
    tasks.register()
    run = Run(cfg, algorithm, Path(cfg.run_dir or f"runs/{algorithm.name}"), echo,
              abstract=abstract is not None)
    created = not run.run_dir.exists()
    try:
        run.interrupted = run.guards.enter_context(Interruptible()).check
        run.guards.enter_context(checkpoint.quiet_failed_io())
        run.guards.enter_context(storage.quiet_logs(run.run_dir))
        run.interrupted()
        run.cfg = setup.settings_for_data(cfg, algorithm, echo)
        run.mesh = _devices(run, abstract)
        # the run's mesh in context (kernels XLA cannot partition run per device: model.attention)
        run.guards.enter_context(jax.set_mesh(run.mesh))
        latest, allowed = (None, set()) if run.abstract else _open_run_dir(run)
        sources = algorithm.open_sources(run.cfg)  # a missing file: before the model loads
        params, reference_copy = _build_model(run, latest)
        run.interrupted()  # a Ctrl-C Python swallowed while the model loaded
        run.context = _build_state(run, params, reference_copy, sources)
        if run.abstract:  # nothing to hold open: the mesh in context and Ctrl-C's handler end
            run.guards.close()
        else:
            _start(run, latest, allowed)
        return run
    except BaseException:
        try:
            run.resources.close()
        finally:
            run.guards.close()
        if created and jax.process_index() == 0:  # refused before writing anything: no directory
            rundir.remove_if_unused(run.run_dir)
        raise


def _devices(run: Run, abstract) -> jax.sharding.Mesh:
    """The run's mesh: over ``abstract``'s devices (``prepare``), or over this process's after
    the compilation cache, the CPU split and multi-process start-up, before anything else touches
    JAX; its batch split checked before the run directory exists (a refused run leaves none)."""
    if abstract is None:
        # before any compile; the run's small programs kept in it too
        folder = compile_cache.use(run.cfg.compile_cache, run.run_dir, run.echo)
        run.guards.enter_context(compile_cache.keeping_every_program(folder))
        mesh = _host_mesh(run.cfg, run.echo)
    else:  # the memory the step may use is the devices', not this host's (plan checks it)
        run.cfg = dataclasses.replace(run.cfg, memory_check=False)
        mesh = abstract_mesh(run.cfg.mesh, list(getattr(abstract, "devices", abstract)),
                             getattr(abstract, "slices", 1))
    check_micro_batch(run.cfg, mesh)
    return mesh


def _host_mesh(cfg, echo) -> jax.sharding.Mesh:
    """The CPU split, multi-process start-up and the mesh over this process's devices."""
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
    return mesh


def _open_run_dir(run: Run) -> tuple[int | None, set]:
    """The run directory created and locked (SIGTERM before training ends the run cleanly), the
    checkpointer, the run's record; returns (the latest intact checkpoint or None, the settings a
    resume may change): another setting is refused here, before the model loads."""
    cfg = run.cfg
    rundir.prepare(run.run_dir)
    run.guards.enter_context(rundir.RunLock(run.run_dir, run.echo, jax.process_index() == 0))
    run.guards.enter_context(rundir.sigterm_exits())
    allowed = resume.allowed_keys(cfg.resume_changed)
    run.checkpointer = checkpoint.Checkpointer(run.run_dir / "checkpoints", cfg.checkpoint)
    run.resources.callback(run.checkpointer.close)
    run.record = resume.run_record(cfg, run.algorithm)
    if not cfg.eval_only:  # a resume rewrites config.json: a hand edit of it is not dropped
        resume.check_config_edit(run.run_dir, cfg)
    latest, run.changes = _latest_checkpoint(cfg, run.checkpointer, run.record, allowed, run.echo)
    return latest, allowed


def _build_model(run: Run, latest: int | None):
    """The model (``run.lm``, ``run.module``, ``run.graphdef``) for the mesh's platform, the host
    allocator, the memory check; returns (the trainable weights, whether the reference is a copy
    of them). Abstract: no weights, nor ``--init-from``'s (its latest checkpoint checked)."""
    cfg, algorithm, echo = run.cfg, run.algorithm, run.echo
    run.lm, run.module = setup.build_model(
        cfg, algorithm, echo, None if run.abstract else run.record["init_from_step"],
        run.abstract, platform=run.mesh.devices.flat[0].platform)
    if jax.default_backend() == "cpu" and not run.abstract:  # what runs here allocates
        echo(host_memory.set_allocator(host_memory.choose(
            cfg.host_allocator, run.lm.tokenizer.vocab_size, int(run.lm.module.hidden_dim))))
    run.graphdef, params, frozen_model = model.split(run.module)
    run.frozen = {"model": frozen_model, "reference": None}
    reference_copy = algorithm.reference_mode == "copy" and not (cfg.eval_only and latest is None)
    memory.check(cfg, memory.estimate(cfg, run.lm.module, params, algorithm.sequences_per_example,
                                      reference_copy, dict(run.mesh.shape)), echo)
    return params, reference_copy


def _build_state(run: Run, params, reference_copy: bool, sources) -> RunContext:
    """The validated data, the state and frozen variables on the mesh; returns the context the
    algorithm is handed."""
    cfg, algorithm = run.cfg, run.algorithm
    ds = setup.datasets(cfg, run.lm, algorithm, run.echo, *sources)
    run.skipped = ds.skipped
    run.optimizer = None if cfg.eval_only else step_lib.optimizer(cfg.optim, cfg.steps)
    run.state = _on_mesh(run, lambda p: _initial_state(p, run.optimizer, cfg.seed), params)
    run.frozen = _on_mesh(run, _same, run.frozen)
    memory.check_weights(cfg, f"the {algorithm.name} partner model", algorithm.partner_bytes())
    partner = algorithm.partner(run.lm, run.echo, run.load_run)
    if partner is not None:  # another frozen model the loss reads (its state; no optimizer)
        run.frozen["partner"] = _on_mesh(run, _same, partner)
    if reference_copy:  # the starting weights, frozen (not donated)
        run.frozen["reference"] = _on_mesh(run, _copy, run.state["params"])
    elif algorithm.reference_mode == "copy":  # scoring the starting weights: the reference
        run.frozen["reference"] = run.state["params"]
    return RunContext(cfg, run.lm, run.graphdef, run.frozen, ds.train, ds.eval, ds.transform,
                      run.run_dir, run.echo, load_run=run.load_run)


def _on_mesh(run: Run, make, tree):
    """``make(tree)`` laid out on the run's mesh; abstract: its shapes laid out (nothing
    computed)."""
    if run.abstract:
        return place_abstract(jax.eval_shape(make, tree), run.mesh)
    return place(make(tree), run.mesh)


def _same(tree):
    return tree


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _start(run: Run, latest: int | None, allowed) -> None:
    """What only a run that runs builds: the algorithm's batch source (``run.inputs``,
    ``run.source``), the latest checkpoint restored, the evaluator."""
    algorithm, params = run.algorithm, run.state["params"]
    run.record["model_record"] = checkpoint.model_record(run.cfg, run.state)
    run.inputs = algorithm.inputs(run.context, params)
    run.source = run.inputs.train
    run.resources.callback(run.source.close)
    run.restored = _restore(run, latest, allowed)
    run.start_step = int(run.state["step"])
    params = run.state["params"]  # restored
    run.evaluator = Evaluator(run.context, algorithm, run.inputs, run.mesh, params)
    setup.check_evaluation(run.cfg, algorithm, run.evaluator, params, run.frozen)


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
