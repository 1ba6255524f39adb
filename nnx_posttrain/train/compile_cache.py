"""JAX's persistent compilation cache for runs (``--compile-cache``).

A step compiles in seconds on a CPU for the built-in models and in minutes on a TPU for a real
one (the gemma_2b-shaped SimPO step: 91-116 s on a v5e chip). With the cache, a resume or a second
run of the same shapes, model and settings reads the compiled program back instead: JAX keys each
entry by the program, the compiler and the devices, so a changed setting compiles afresh and an
unchanged one never runs stale code.

``auto`` puts it beside the run directory (``runs/.jax_cache`` for ``runs/NAME``), shared by the
runs of that folder, unless JAX already has a cache (``JAX_COMPILATION_CACHE_DIR``, or
``jax.config`` set by the caller): the caller's choice wins. ``none`` turns it off. Setting it is
process-wide (a JAX setting), done when a run is prepared, never on import. While a run uses
the folder, every program it compiles is written (``keeping_every_program``), not only those
that took JAX a second to compile (JAX's threshold): the many small ones (a built-in model's
random initializers, one per weight shape; the optimizer's and the metrics') were compiled again
by every process.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax

from nnx_posttrain import errors

FOLDER = ".jax_cache"


def resolve(setting: str, run_dir: Path) -> Path | None:
    """The folder ``--compile-cache setting`` names for ``run_dir``, or None (off, or JAX's own
    cache already set by the caller)."""
    if setting == "none":
        return None
    if setting == "auto":
        if jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return None
        return Path(run_dir).absolute().parent / FOLDER
    return Path(setting).expanduser().absolute()


def use(setting: str, run_dir: Path, echo=print) -> Path | None:
    """Point JAX's persistent compilation cache at ``--compile-cache``'s folder (created); the
    folder, or None where nothing changed. A folder that cannot be created is a ConfigError."""
    folder = resolve(setting, run_dir)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise errors.ConfigError(f"--compile-cache {setting}: cannot create {folder} ({exc}); "
                                 "name another folder, or pass --compile-cache none") from None
    if jax.config.jax_compilation_cache_dir != str(folder):
        jax.config.update("jax_compilation_cache_dir", str(folder))
        _reread()
        echo(f"compilation cache: {folder} (a resume or a rerun of these shapes reads its step "
             "from there; --compile-cache none: off)")
    return folder


@contextlib.contextmanager
def keeping_every_program(folder: Path | None):
    """Within the block, with ``folder`` (``use``'s: this package's cache, not the caller's),
    JAX writes every program it compiles to the cache, however short its compilation: the next
    process reads them back (gemma_tiny's load: 21 small initializer programs, 3.3 -> 1.0 CPU-s
    in a second process). A threshold the caller chose (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS,
    or ``jax.config`` set off JAX's default of 1 s) stands; JAX's setting is restored after."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    chosen = before != 1.0 or "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" in os.environ
    if folder is None or chosen:
        yield
        return
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _reread() -> None:
    """JAX reads its cache setting at its first compilation: make it read it again (a process
    that compiled before this run, a notebook's second run)."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # another JAX: the setting applies from its next start
        return
    compilation_cache.reset_cache()
