"""JAX's platform on a host without accelerators, where libtpu is installed anyway (``jax[tpu]``:
the test and tpu extras, for compiling plans): JAX would start the TPU runtime first, which logs
a page of start-up errors (``TPU_WORKER_HOSTNAMES``, "Failed to find host bounds") before JAX
falls back to the CPU.

``prefer_cpu()`` chooses the CPU in that case, and only where nothing else chose: the command
line calls it as it starts, the library where it first starts JAX's devices (a run, reading a
run), never on import. A TPU VM, a GPU host, ``JAX_PLATFORMS`` set or a process whose JAX is
already running are left as they are.
"""

from __future__ import annotations

import importlib.util
import os


def prefer_cpu() -> bool:
    """Set JAX's platforms to the CPU where nothing chose them (``JAX_PLATFORMS`` unset, JAX's
    backends not started), libtpu is installed, and this host has neither a TPU chip nor a GPU;
    returns whether it did."""
    if os.environ.get("JAX_PLATFORMS") is not None or importlib.util.find_spec("libtpu") is None:
        return False
    import jax
    from jax._src import hardware_utils, xla_bridge

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return False
    try:
        accelerators = (hardware_utils.num_available_tpu_chips_and_device_id()[0]
                        or hardware_utils.has_visible_nvidia_gpu()
                        or hardware_utils.num_available_amd_gpus(stop_at=1))
    except (OSError, AttributeError, TypeError):  # cannot tell: leave JAX to choose
        return False
    if accelerators:
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
