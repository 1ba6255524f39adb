"""Orbax checkpoints of the whole training state, for exact resume and for inspection.

A checkpoint ``runs/<name>/checkpoints/<step>/`` holds, as Orbax items:

- ``state``: the trainable variables (all weights, or only the LoRA factors), the optimizer state,
  the step and the RNG key — one tree, saved sharded and restored into the current mesh;
- ``data``: the Grain iterator state, so the data continue exactly where they stopped;
- ``record``: the resolved config and a description of the model (name, dtype, LoRA, the path and
  shape of every saved variable), used to refuse a checkpoint of a different model clearly.

Orbax writes a checkpoint to a temporary directory and renames it only when complete, so a save
interrupted by a crash is never picked up: the last complete one is. A complete checkpoint damaged
later (a truncated or deleted file, an emptied metadata file) is found when it is read
(``restore_latest``), reported by name, moved aside to ``<step>.damaged-<time>`` (Orbax ignores
that name) and the next older one is used.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from nnx_posttrain import config as config_lib, errors
from nnx_posttrain import model
from nnx_posttrain.model import device_memory


class CheckpointMismatchError(errors.CheckpointError):
    """A checkpoint does not fit the model being restored; the message names the differences."""


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def shapes(tree) -> dict[str, list]:
    """{'params/decoder_block_0/...': [shape..., dtype]} of every leaf."""
    return {
        path_str(path): [*map(int, leaf.shape), str(leaf.dtype)]
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def model_settings(config: dict) -> dict:
    """The settings that make a model, from a run's config (as ``config_lib.to_dict`` gives it)."""
    lora = config["lora"]
    dtype = model.resolve_dtype(config["model"], config["dtype"], bool(lora["rank"]))
    return {"model": config["model"], "dtype": dtype, "quantize": config.get("quantize", "none"),
            "lora": {"rank": lora["rank"], "alpha": lora["alpha"], "targets": lora["targets"]}}


def model_record(cfg: config_lib.Config, state) -> dict:
    return {
        **model_settings(config_lib.to_dict(cfg)),
        "variables": {
            name: [*map(int, v.shape), str(v.dtype)]
            for name, v in model.named_variables(state["params"]).items()
        },
    }


def model_problems(saved: dict, current: dict) -> list[str]:
    """The differences of model, dtype, quantization and LoRA between two model records."""
    old, new = ({"quantize": "none", **record} for record in (saved, current))  # older records
    return [f"{key}: checkpoint has {old.get(key)!r}, this run has {new.get(key)!r}"
            for key in ("model", "dtype", "quantize", "lora") if old.get(key) != new.get(key)]


def mismatch(where: str, problems: list[str]) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"checkpoint {where} was written for a different model configuration:\n  "
        + "\n  ".join(problems))


def check_compatible(saved: dict, current: dict, where: str) -> None:
    problems = model_problems(saved, current)
    old, new = saved.get("variables", {}), current.get("variables", {})
    missing, extra = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if missing:
        problems.append(f"{len(missing)} saved variable(s) absent from this model, e.g. {missing[0]}")
    if extra:
        problems.append(f"{len(extra)} variable(s) of this model absent from the checkpoint, e.g. {extra[0]}")
    for name in sorted(set(old) & set(new)):
        if old[name] != new[name]:
            problems.append(f"{name}: checkpoint {old[name]}, this model {new[name]}")
            if len(problems) > 8:
                break
    if problems:
        raise mismatch(where, problems)


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: config_lib.CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.cfg = cfg
        policies = [pp.LatestN(n=max(cfg.keep, 1))]
        metric = None
        if cfg.keep_best:
            def metric(m):
                return float(m[cfg.keep_best])

            policies.append(pp.BestN(
                get_metric_fn=metric, reverse=cfg.best_mode == "min", n=1,
                keep_checkpoints_without_metrics=False,
            ))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_save,
            preservation_policy=pp.AnyPreservationPolicy(policies),
            best_fn=metric,  # makes Orbax store each checkpoint's metrics
            best_mode=cfg.best_mode,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._held: tuple | None = None  # a save whose device copy waits for write_held
        self._ahead: tuple | None = None  # (state, its device copy) taken by copy_ahead

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Orbax's manager, once a save held back by ``save`` has been handed to it: every use
        of it comes after the saves asked for before."""
        self.write_held()
        return self._manager

    def write_held(self) -> None:
        """Hand the save that ``save`` held back (its state's device copy) to Orbax, whose call
        blocks until the arrays are on the host. The loop calls this right after it dispatched
        the next step, so that the transfer overlaps the device's work instead of delaying the
        step (a v5e: ~120 ms for a LoRA state's 433 arrays); a no-op when nothing is held."""
        held, self._held = self._held, None
        if held is not None:
            self._write(*held)

    def _write(self, step: int, state, data_state: dict | None, record, metrics) -> None:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
            record=ocp.args.JsonSave(record() if callable(record) else record),
        )
        self._manager.save(step, args=args, metrics=metrics, force=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def problem(self, step: int) -> str | None:
        """What is visibly wrong with checkpoint ``step``'s files (a missing item directory or
        metadata file, metadata that is not JSON), without reading its arrays; None if nothing
        is. (A truncated array file shows only when it is read: see ``restore_latest``.)"""
        root = self.directory / str(step)
        for name in ("record/metadata", "data/metadata", "state/_METADATA", "state/manifest.ocdbt"):
            path = root / name
            if not path.is_file():
                return f"{name} is missing"
            if path.suffix != ".ocdbt":
                try:
                    json.loads(path.read_text())
                except (ValueError, OSError) as exc:
                    return f"{name} is not readable JSON ({exc})"
            elif path.stat().st_size == 0:
                return f"{name} is empty"
        return None

    def set_aside(self, step: int, why: str, echo=print) -> Path:
        """Move damaged checkpoint ``step`` out of the way (kept for inspection), say so."""
        target = self.directory / f"{step}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        self.manager.reload()
        echo(f"checkpoint {self.directory / str(step)} is damaged ({why}); moved it to {target}")
        return target

    def latest_intact_step(self, echo=print) -> int | None:
        """The newest checkpoint whose files look complete (``problem``); the damaged ones
        newer than it set aside."""
        while (step := self.latest_step()) is not None:
            why = self.problem(step)
            if why is None:
                return step
            self.set_aside(step, why, echo)
        return None

    def restore_latest(self, abstract_state, current_record: dict, check=None, echo=print,
                       weights_only: bool = False):
        """(step, state, data state, record) of the newest checkpoint that restores, or None
        when there is none. ``check(saved_record)`` may refuse one (an exception, passed on,
        as is ``CheckpointMismatchError``); a checkpoint that fails to read is set aside and the
        next older one tried. ``weights_only``: only what ``abstract_state`` names
        (``restore_weights``), the data state is None."""
        failed = False
        while (step := self.latest_intact_step(echo)) is not None:
            try:
                with _quiet_coroutines(collect=failed):
                    saved = self.read_record(step)
                    if check is not None:
                        check(saved)
                    if weights_only:
                        return (step, self.restore_weights(step, abstract_state, current_record),
                                None, saved)
                    return (step, *self.restore(step, abstract_state, current_record))
            except Exception as exc:  # noqa: BLE001  (Orbax and TensorStore raise many kinds)
                why = damage(exc)
                if why is None:
                    raise
                self.set_aside(step, why, echo)
                failed = True
        return None

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict | None,
             record: dict | Callable[[], dict], metrics=None) -> None:
        """Start saving (asynchronously unless disabled); training continues meanwhile. With
        ``async_save``, a state whose copy takes at most a quarter of the device's free memory
        is copied on the device (the step that follows may donate the original) and held until
        ``write_held`` (or any other use of the checkpointer) hands it to Orbax; a larger state
        is handed to Orbax here (its call blocks until the arrays are on the host). ``record``
        is the run's record, or a function giving it, called when the save is handed to Orbax
        (the loop's reads the step's metrics then, so that this call never waits for the
        device; an exception it raises drops the save)."""
        self.write_held()  # the save held before goes first, in order
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] is not state:  # no copy_ahead of this state
            ahead = (state, device_copy(state) if self.cfg.async_save else None)
        copy = ahead[1]
        if copy is None:
            self._write(step, state, data_state, record, metrics)
        else:
            self._held = (step, copy, data_state, record, metrics)

    def copy_ahead(self, state) -> None:
        """Take now the device copy that ``save`` of this same ``state`` will hold (async saves
        only): the loop calls this before it waits for the step's metrics, so that the copy's
        dispatch and its host transfers' start (~80 ms of the host's time for a LoRA state's
        433 arrays on the chip's host) overlap the step still running, rather than follow it
        with the device idle."""
        if self.cfg.async_save:
            self._ahead = (state, device_copy(state))

    def prepare(self, state) -> None:
        """Compile the device copy that async saves of ``state`` take (its arrays' shapes and
        shardings; they may still be computing): the loop calls this while the device runs its
        first step, so that the first save does not wait for it (1.8 s on the chip's host)."""
        if self.cfg.async_save:
            _copied.lower(state).compile()

    def read_record(self, step: int) -> dict:
        out = self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
        return out.record

    def restore(self, step: int, abstract_state, current_record: dict):
        """(state, data_state, record) of ``step``, laid out like ``abstract_state`` (shapes,
        dtypes and shardings of the current mesh), after checking the model matches."""
        saved = self.read_record(step)
        check_compatible(saved["model_record"], current_record, f"{self.directory}/{step}")
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        ))
        return out.state, out.data, saved

    def restore_weights(self, step: int, abstract_state, current_record: dict) -> dict:
        """The part of ``step``'s state that ``abstract_state`` names (e.g. params, step, rng,
        without the optimizer state), after checking the model matches: what inspection and
        ``--init-from`` read, without building an optimizer."""
        saved = self.read_record(step)
        check_compatible(saved["model_record"], current_record, f"{self.directory}/{step}")
        args = ocp.args.PyTreeRestore(
            abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
            partial_restore=True)
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(self.directory / str(step) / "state", args=args)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.write_held()
            self._manager.wait_until_finished()
        finally:
            self._manager.close()


def device_copy(state):
    """A copy of ``state`` on its devices, or None when it would take more than a quarter of
    the first device's free memory (or that cannot be told)."""
    leaves = jax.tree.leaves(state)
    first = jax.local_devices()[0]
    held = sum(shard.data.nbytes for leaf in leaves if isinstance(leaf, jax.Array)
               for shard in leaf.addressable_shards if shard.device == first)
    free = device_memory.available_bytes()
    if free is None or 4 * held > free:
        return None
    copy = _copied(state)
    for leaf in jax.tree.leaves(copy):  # the transfers to the host start now, not when Orbax
        leaf.copy_to_host_async()       # asks (its save call then waits less: 0.19 -> 0.14 s)
    return copy


# one program for the whole state (compiled by ``Checkpointer.prepare``, or at the first save):
# a ``device_put`` copy dispatched each of a LoRA state's 433 arrays alone, 0.07 s of the host's
# time on the chip while the device waited (the loop had read the step's metrics)
_copied = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def _late_io_noise(record: logging.LogRecord) -> bool:
    """False for asyncio's "Task exception was never retrieved" (a read of a checkpoint whose
    failure was reported, its other reads' tasks collected later)."""
    return not record.getMessage().startswith("Task exception was never retrieved")


@contextlib.contextmanager
def quiet_failed_io():
    """While the block runs, drop what Orbax's cancelled I/O reports after a read or write has
    failed: the ``RuntimeError: Event loop is closed`` of TensorStore's late callbacks (from their
    own threads, as unraisable exceptions) and asyncio's "Task exception was never retrieved" for
    the other reads of a damaged checkpoint. The failure itself is reported by name (a damaged
    checkpoint set aside, a full disk). Everything else reaches the previous
    ``sys.unraisablehook`` and asyncio's log, both put back at the end."""
    previous = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(_late_io_noise)
    try:
        yield
    finally:
        asyncio_log.removeFilter(_late_io_noise)
        sys.unraisablehook = previous


class _VanishingFiles(logging.Filter):
    """Drops Orbax's warnings about the files of a checkpoint folder under ``directory`` that
    are missing (one being written or removed by the run that owns them)."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("does not exist" in text and self.directory in text)


@contextlib.contextmanager
def quiet_reads(directory: str | Path):
    """While the block reads the checkpoints in ``directory``, which a run still training may be
    writing and rotating meanwhile: Orbax's warnings about a step folder's missing files and the
    reports of a read that failed (``quiet_failed_io``, the coroutines it left) are dropped; the
    reader says what it did instead. Other records pass; everything is put back at the end."""
    noise, log = _VanishingFiles(Path(directory).absolute()), logging.getLogger("absl")
    log.addFilter(noise)
    try:
        with quiet_failed_io(), _quiet_coroutines(collect=False):
            yield
    finally:
        log.removeFilter(noise)


@contextlib.contextmanager
def _quiet_coroutines(collect: bool):
    """A failed TensorStore read leaves Orbax's reading coroutines to be finalised with their
    exception, which Python prints as "Exception ignored in <coroutine>" and a traceback: the
    failure itself is reported (``set_aside``), so those are dropped; other unraisable
    exceptions still reach the usual hook. ``collect``: an earlier read failed, its coroutines
    are finalised here (a full garbage collection on exit, which costs seconds in a process
    that holds many objects: only after a failure)."""
    old = sys.unraisablehook

    def hook(unraisable):
        if not inspect.iscoroutine(unraisable.object):
            old(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if collect:
            gc.collect()
        sys.unraisablehook = old


def damage(exc: Exception) -> str | None:
    """``Type: first line`` of ``exc`` where it is what reading damaged or vanishing checkpoint
    files raises (a missing file, a truncated stream, metadata that is not JSON or not UTF-8);
    None for anything else: out of memory, a refusal (a ``UserError``: a checkpoint of another
    model, other settings), a bug of the caller's."""
    if isinstance(exc, (errors.UserError, MemoryError)) or "RESOURCE_EXHAUSTED" in str(exc):
        return None
    if not (isinstance(exc, (OSError, ValueError, KeyError)) or type(exc) is Exception):
        return None
    first = (str(exc).strip().splitlines() or [""])[0].split(" See full")[0][:200]
    return f"{type(exc).__name__}: {first}"


def abstract(tree, sharding=None):
    """ShapeDtypeStructs of a tree (optionally all with ``sharding``) to restore into."""
    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None))
    return jax.tree.map(one, tree)
