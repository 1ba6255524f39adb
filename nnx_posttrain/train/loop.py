"""The one training loop, for every algorithm: ``train(run)`` and ``evaluate_only(run)``.

    for step in start+1 .. steps:
        batch = run.source.next(step, state)       # the dataset, or rollouts of the policy
        state, metrics = train_step(state, frozen, batch)
        hooks after the step: log, evaluate, checkpoint, stop on a signal

The loop knows no algorithm: it iterates the algorithm's batch source and calls the jitted step;
logging, evaluation, checkpoints and the stop signal are hooks (``Steps``).
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import jax

from nnx_posttrain import config as config_lib, errors, metrics_log, model, progress, sharding
from nnx_posttrain.metrics_log import MetricsLog, SecondaryLog
from nnx_posttrain.model import device_memory
from nnx_posttrain.progress import console
from nnx_posttrain.train import memory, rundir, storage
from nnx_posttrain.train import step as step_lib
from nnx_posttrain.train.hooks import (FrozenCollector, Hooks, NonFiniteGuard, NonFiniteStep,
                                       PromptSwitches, StepInfo, StopSignals, Throughput)
from nnx_posttrain.train.evaluation import scored_data
from nnx_posttrain.train.mesh import shard_batch
from nnx_posttrain.train.run import Run


@dataclasses.dataclass
class RunResult:
    """What a run leaves: its directory, the records it logged, the final state."""

    run_dir: Path
    train: list[dict]  # the train records logged by this call (metrics.jsonl has every one)
    eval: list[dict]  # the eval records logged by this call
    state: dict  # the final training state (params, opt_state, step, rng)
    lm: model.LanguageModel
    graphdef: object
    frozen: dict
    algorithm: object = None
    source: object = None  # the batch source (the dataset's batches, or the rollout engine)
    stopped_by: str | None = None  # "SIGTERM" / "SIGINT": stopped early, after a checkpoint

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def final_eval(self) -> dict:
        """The metrics of the last evaluation of this call ({} if none)."""
        return _metrics(self.eval[-1]) if self.eval else {}

    def best_eval(self, metric: str = "loss", mode: str = "min") -> dict:
        """The eval record (step and metrics) with the smallest (``mode`` 'min') or largest
        ``metric`` among this call's evaluations ({} if none measured it)."""
        scored = [r for r in self.eval if isinstance(r.get(metric), float)]
        pick = min if mode == "min" else max
        return pick(scored, key=lambda r: r[metric]) if scored else {}

    @property
    def module(self):
        """The trained model (an ``nnx.Module``) with the final weights."""
        return model.merge(self.graphdef, self.state["params"], self.frozen)[0]


def _metrics(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("step", "split", "eval_only")}


def _result(run: Run) -> RunResult:
    return RunResult(run.run_dir, [], [], run.state, run.lm, run.graphdef, run.frozen,
                     algorithm=run.algorithm, source=run.source)


def _open_log(run: Run, keep_until: int | None):
    """The metrics log (process 0 writes it; the others keep their records in memory)."""
    if jax.process_index() != 0:
        return SecondaryLog()
    return MetricsLog(run.run_dir, keep_until=keep_until, echo=console(run.echo),
                      report_to=run.cfg.report_to, config=config_lib.to_dict(run.cfg))


def evaluate_only(run: Run) -> dict:
    """Score the run's weights (its latest checkpoint's, or the model's own) on the eval data;
    the metrics are returned and appended to ``metrics.jsonl`` as an ``eval_only`` record (never
    the run's own ``eval``) naming the checkpoint, the data and the settings it scored."""
    scored = (f"checkpoint {run.restored.step}" if run.restored else "initial weights")
    run.echo(f"--eval-only: scoring {'the ' * (run.restored is None)}{scored}"
             + (f" ({run.restored.path})" if run.restored else
                f" (no checkpoint in {run.checkpointer.directory})"))
    with storage.reported(run.run_dir):
        log = _open_log(run, keep_until=None)
        try:
            metrics = run.evaluator(run.state["params"], run.frozen)  # no per-problem rows
            if metrics:
                fields = {"eval_only": scored, **scored_data(run.cfg)}
                log.log(run.start_step, "eval_only", metrics, fields=fields)
                log.completions(run.start_step, "eval_only",
                                [{**fields, **row} for row in run.evaluator.completions])
            return metrics
        finally:
            log.close()


def train(run: Run) -> RunResult:
    """Train ``run`` from its start step to ``--steps``: logs, evaluations and checkpoints as
    configured. A stop signal (SIGTERM, Ctrl-C) ends it after a checkpoint
    (``RunResult.stopped_by``); a non-finite step that must stop it raises ``TrainingError``."""
    result = _result(run)
    start = run.start_step
    if run.restored is not None and start >= run.cfg.steps:
        run.echo(f"{run.run_dir} is already complete at step {start} (--steps {run.cfg.steps}); "
                 "nothing to do. Raise --steps to continue training, or choose another --run-dir.")
        return result
    with storage.reported(run.run_dir):  # a full disk: one message, not the writers' tracebacks
        _record_start(run)
        log = _open_log(run, keep_until=start if run.restored else -1)
        try:
            steps = Steps(run, result, log)
            if start == 0:
                steps.evaluate(0, run.state)
                run.interrupted()
            steps.loop()
        finally:
            log.close()
    return result


def _record_start(run: Run) -> None:
    """Say what a resume changed; write config.json, history.jsonl, and cut the per-problem
    records after the start step (as the metrics log is cut)."""
    restored, start = run.restored, run.start_step
    if restored is not None:
        changes = run.changes
        run.echo(f"resumed from {restored.path} (step {restored.step})"
                 + "".join(f"\n  changed: {k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
                 + ("\n  the learning-rate schedule now spans the new --steps"
                    if "steps" in changes and run.cfg.optim.schedule != "constant" else ""))
    if jax.process_index() != 0:
        return
    if restored is None:  # starting over: an earlier run's files are kept aside, not rewritten
        rundir.keep_earlier(run.run_dir, config_lib.saved(run.cfg), console(run.echo))
    written = config_lib.save(run.cfg, run.run_dir / "config.json")
    rundir.append_history(run.run_dir, "resume" if restored else "start", start, run.changes,
                          config=written)
    metrics_log.trim(run.run_dir / "exact_match.jsonl", start if restored else -1,
                     console(run.echo), missing_ok=True)


def compile_step(run: Run):
    """The jitted training step of ``run``: state donated, its shardings pinned (without that
    they drift after an update); its ``jitted`` function is what ``nnx_posttrain.plan`` compiles
    for an abstract run (``prepare(..., abstract=)``)."""
    shardings = sharding.tree_shardings(run.state, run.mesh)
    return memory.CheckedStep(
        step_lib.jit_train_step(run.graphdef, run.algorithm.loss, run.optimizer, shardings,
                                run.mesh),
        run.cfg, console(run.echo), model.scanning(run.lm.module))


def _peak_memory() -> str:
    """"; peak memory X GiB (device)" for the run's last line, or "" where it cannot be told."""
    peak = device_memory.peak_bytes()
    return f"; peak memory {peak[0] / 2**30:.2f} GiB ({peak[1]})" if peak else ""


def _host(steps: list[dict]) -> list[dict]:
    """Steps' device metrics as host floats (one transfer for all)."""
    return [{k: float(v) for k, v in m.items()} for m in jax.device_get(steps)]


class Steps:
    """The loop over optimizer steps and the hooks that run after each: logging every
    ``--log-every`` steps (each metric the mean of the steps since the last log), evaluation
    every ``--eval.every``, checkpoints every ``--checkpoint.every`` (only where the batch source
    allows one, and only after the step's non-finite check), the stop signal; all at the end."""

    def __init__(self, run: Run, result: RunResult, log):
        self.run, self.result, self.log = run, result, log
        saved = run.restored.record if run.restored else {"num_tokens": 0}
        self.pending = list(saved.get("unlogged_metrics", []))  # averaged into the next log
        if run.restored and hasattr(run.source, "set_host_window"):  # and the host's, as well
            run.source.set_host_window(saved.get("host_window") or {})
        self.throughput = Throughput(saved.get("num_tokens"))  # None: a checkpoint without it
        self.guard = NonFiniteGuard(run.cfg.optim.on_nonfinite, console(run.echo))
        self.stop = self.bar = None
        self.said_removed = False  # checkpoints/ removed during the run: said once

    def evaluate(self, step: int, state: dict) -> dict:
        run = self.run
        metrics = run.evaluator(state["params"], run.frozen, step)
        if metrics:
            self.result.eval.append(self.log.log(step, "eval", metrics))
            self.log.completions(step, "eval", run.evaluator.completions)
        return metrics

    def loop(self) -> None:
        run, cfg = self.run, self.run.cfg
        train_step = compile_step(run)
        self.bar = progress.bar(total=cfg.steps, initial=run.start_step, desc=run.algorithm.name,
                                unit="step", dynamic_ncols=True)
        try:
            with (StopSignals(console(run.echo)) as self.stop, FrozenCollector() as collector,
                  PromptSwitches()):
                hooks = self.hooks()
                for step in range(run.start_step + 1, cfg.steps + 1):
                    self.one_step(step, train_step, hooks)
                    if self.result.stopped_by:
                        return
                    collector.freeze()  # what is alive after the first step stays
                self.guard.flush()
        except NonFiniteStep as exc:
            raise self.stopped_on(exc) from None
        finally:
            self.bar.close()
        run.echo(f"done: {cfg.steps} steps; run directory {run.run_dir}{_peak_memory()}"
                 + (f"; {run.skipped} bad records were skipped (--batching.skip-bad)"
                    if run.skipped else "")
                 + (f"; {self.guard.skipped} non-finite steps were skipped"
                    if self.guard.skipped else ""))

    def one_step(self, step: int, train_step, hooks: Hooks) -> None:
        run, result = self.run, self.result
        host_batch = run.source.next(step, result.state)
        self.throughput.count(host_batch)
        batch = shard_batch(run.source.to_device(host_batch), run.mesh,
                            run.cfg.batching.grad_accum)
        try:
            result.state, metrics = train_step(result.state, run.frozen, batch)
            # the state before was donated to the step: dropped here, before Orbax's threads
            # start (each array's release waits for the interpreter: 433 of them took 0.46 s
            # on the chip's host while Orbax's commit ran beside)
            run.state = result.state
        finally:  # the last checkpoint's transfer to the host, while the device runs the step
            run.checkpointer.write_held()
        self.guard.push(step, metrics)  # checks the step before (this one is running)
        self.bar.update(1)
        self.stop.check()  # a second Ctrl-C that landed where Python could not raise it
        if step == run.start_step + 1:  # the first step compiles: out of the throughput
            run.checkpointer.prepare(result.state)  # while the device runs it
            self.throughput.first_step_done(result.state)
        hooks.after(StepInfo(step, result.state, metrics, last=step == run.cfg.steps,
                             stopping=self.stop.received is not None,
                             boundary=run.source.checkpoint_ok(step)))

    def stopped_on(self, exc: NonFiniteStep) -> errors.TrainingError:
        ckpt, cfg = self.run.checkpointer, self.run.cfg
        ckpt.wait()
        kept = ckpt.all_steps()
        return errors.TrainingError(
            f"{exc}: the update was not applied and training stopped "
            f"(--optim.on-nonfinite {cfg.optim.on_nonfinite}). No checkpoint was written after "
            f"it; kept in {ckpt.directory}: "
            + (f"steps {', '.join(map(str, kept))}" if kept else "none")
            + ". Lower --optim.learning-rate, clip gradients (--optim.max-grad-norm), or skip "
            "such steps (--optim.on-nonfinite skip); resuming with another learning rate needs "
            "--resume-changed optim.learning_rate.")

    def hooks(self) -> Hooks:
        cfg, every = self.run.cfg, self.run.cfg.checkpoint.every
        hooks = Hooks()
        saving = (lambda i: (bool(every and i.step % every == 0) or i.stopping) and i.boundary
                  or i.last)
        # before the log waits for the step: the save's device copy overlaps the step
        hooks.add(lambda info: self.run.checkpointer.copy_ahead(info.state), when=saving)
        hooks.add(lambda info: self.pending.append(info.metrics), every=1)
        # not on a stop: the window's steps go into the checkpoint, and a resumed run logs the
        # record the uninterrupted run would have
        hooks.add(self.log_train, every=cfg.log_every, when=lambda i: i.last)
        hooks.add(self.evaluate_now, every=cfg.eval.every, when=lambda i: i.last)
        hooks.add(self.save, when=saving)
        hooks.add(self.stop_now, when=lambda i: i.stopping and (i.boundary or i.last))
        return hooks

    def log_train(self, info: StepInfo) -> None:
        source = self.run.source
        metrics = step_lib.interval_means(_host(self.pending))  # TRL's: the interval's means
        self.pending.clear()
        nonfinite = metrics.pop("nonfinite")  # this step's flag: not checked by the guard yet
        if self.run.cfg.optim.on_nonfinite == "skip":
            metrics["skipped_steps"] = float(self.guard.skipped + nonfinite)
        metrics.update(self.throughput.read())
        metrics.update(source.host_metrics())
        self.result.train.append(self.log.log(info.step, "train", metrics, echo=False))
        self.log.completions(info.step, "train", getattr(source, "logged_completions", list)())
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['learning_rate']:.2e}",
                             refresh=False)  # shown at the bar's next redraw

    def evaluate_now(self, info: StepInfo) -> None:
        self.guard.flush()
        info.eval = self.evaluate(info.step, info.state)
        self.throughput.pause_done()

    def save(self, info: StepInfo) -> None:
        folder = self.run.checkpointer.directory
        if not folder.is_dir() and not self.said_removed:
            self.said_removed = True
            self.run.echo(f"warning: {folder} was removed during the run, and the checkpoints "
                          f"it held with it; saving again from step {info.step}")
        source, pending = self.run.source, list(self.pending)
        saved = {**self.run.record, "step": info.step, "num_tokens": self.throughput.seen,
                 "host_window": source.host_window() if hasattr(source, "host_window") else {}}

        def record() -> dict:  # called once the next step is dispatched (the device busy)
            self.guard.flush()  # never a checkpoint after an unchecked step
            # a resumed run's next log averages them (the device's and the host's metrics)
            return {**saved, "unlogged_metrics": _host(pending)}

        with self.stop.saving():  # (Orbax may wait here for the previous checkpoint)
            self.run.checkpointer.save(info.step, info.state, source.get_state(), record,
                                       metrics=info.eval or None)

    def stop_now(self, info: StepInfo) -> None:
        name = signal.Signals(self.stop.received).name
        with self.stop.saving():
            self.run.checkpointer.wait()
        self.bar.close()
        self.run.echo(f"{name}: saved checkpoint at step {info.step} in "
                      f"{self.run.checkpointer.directory}; run the same command again to resume")
        self.result.stopped_by = name
