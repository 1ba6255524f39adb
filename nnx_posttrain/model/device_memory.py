"""The memory free on the device a run computes on, for the checks that refuse what clearly
cannot fit (a training step, a generation's KV cache) before anything is allocated."""

from __future__ import annotations

import jax

GiB = 1 << 30


def available_bytes() -> int | None:
    """Free memory of the first local device (an accelerator's own; the host's MemAvailable on
    CPU); None where it cannot be told."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
