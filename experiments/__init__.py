"""One short file per algorithm: ``python -m experiments.NAME [options]``.

A command started here restarts itself once with glibc's allocator tuned for XLA:CPU's step
buffers, before anything heavy is imported (``nnx_posttrain.host_allocator``)."""

from nnx_posttrain import host_allocator

if host_allocator.started_as_command("experiments"):
    host_allocator.restart_tuned()
