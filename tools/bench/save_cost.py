"""What an asynchronous checkpoint costs the training steps around it, piece by piece.

A LoRA-like state (``--layers`` x 4 projections x 2 factors, each with its two AdamW moments:
432 small arrays at 18 layers, as the headline's gemma_2b LoRA run holds) is saved by the
package's ``Checkpointer`` while a stand-in step (``--step-ms`` of matmuls on the device, the
state donated) runs, with a little host work between steps as the loop does. Printed and written
as JSON: the device copy's dispatch time (``jax.device_put``, and a jitted copy for comparison),
the save call's time on the calling thread, and each step's wall time around the saves against
the median (the ``steps after a save`` figure of ``tools.bench.headline``)::

    python -m tools.bench.save_cost --json out.json          # on the chip: --step-ms 380
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tools import exit_status


def lora_state(layers: int, hidden: int, rank: int):
    import jax.numpy as jnp

    def factors(i, j):
        return {"a": jnp.full((hidden, rank), 0.01 * (i + j), jnp.float32),
                "b": jnp.zeros((rank, hidden), jnp.float32)}

    params = {f"layer_{i}": {p: factors(i, j) for j, p in enumerate("qkvo")}
              for i in range(layers)}
    import jax
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "mu": zeros, "nu": jax.tree.map(jnp.zeros_like, params),
            "step": jnp.zeros((), jnp.int32)}


def stand_in_step(step_ms: float, size: int):
    """A jitted step that takes ~``step_ms`` on the device: matmuls of a fixed operand, the state
    touched (+ 1e-6) and donated, as the training step donates it."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def work(x):
        for _ in range(8):
            x = jnp.tanh(x @ x) * 0.5
        return x

    x = jnp.ones((size, size), jnp.bfloat16)
    work(x).block_until_ready()
    t = time.perf_counter()
    work(x).block_until_ready()
    one = (time.perf_counter() - t) * 1000
    repeats = max(1, round(step_ms / max(one, 1e-3)))

    @jax.jit
    def body(state, x):
        for _ in range(repeats):
            x = work(x)
        state = jax.tree.map(lambda v: v + jnp.asarray(1e-6, v.dtype), state)
        return state, jnp.sum(x.astype(jnp.float32))

    step = jax.jit(body, donate_argnums=(0,))
    return step, x, repeats * one


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t) * 1000


def copy_costs(state) -> dict:
    import jax

    from nnx_posttrain.checkpoint import device_copy

    out = {}
    for name, fn in (("device_put", device_copy),
                     ("jit", jax.jit(lambda t: jax.tree.map(lambda v: v.copy(), t)))):
        times = []
        for _ in range(4):
            copy, ms = timed(fn, state)
            jax.block_until_ready(copy)
            times.append(ms)
        out[name] = {"first_ms": times[0], "median_ms": statistics.median(times[1:])}
    return out


def host_work(ms: float) -> None:
    """~``ms`` of Python in ~1 ms slices, each followed by a call that releases the interpreter."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        stop = time.perf_counter() + 0.001
        while time.perf_counter() < stop:
            pass
        time.sleep(0)


def run_steps(args, state, step, x, mode: str) -> dict:
    """``args.steps`` stand-in steps, a save every ``args.every``; each step's time as a loop
    that reads every step's loss sees it: from one result on the host to the next, the save
    included. ``mode``: ``call`` (Orbax's save call made at once, blocking until the arrays are
    on the host), ``held`` (the package's loop: the device copy held, handed to Orbax by
    ``write_held`` right after the next step is dispatched, while the device runs it),
    ``held+wait`` (held, and the loop then waits for Orbax's commit thread while the device
    runs the step, so that the commit's Python does not compete with the loop's host work).
    ``args.host_ms``: Python work of the loop per step (in slices of ~1 ms that release the
    interpreter between them, as the loop's reads, transfers and writes do)."""
    import jax
    import numpy as np

    from nnx_posttrain import checkpoint
    from nnx_posttrain.config import CheckpointConfig

    folder = Path(tempfile.mkdtemp(prefix=f"save_cost_{mode}_"))
    ckpt = checkpoint.Checkpointer(folder, CheckpointConfig(async_save=True))
    ends, save_ms, saved = [time.perf_counter()], [], False
    try:
        for i in range(1, args.steps + 1):
            batch = jax.device_put(np.ones((16, 1024), np.int32))  # the loop's host work
            state, loss = step(state, x)
            ckpt.write_held()
            if saved and mode == "held+wait":
                ckpt.wait()
            saved = False
            float(loss)
            host_work(args.host_ms)
            del batch
            ends.append(time.perf_counter())
            if i % args.every == 0 and i < args.steps:
                s = time.perf_counter()
                ckpt.save(i, state, {}, {"step": i})
                saved = True
                if mode == "call":
                    ckpt.write_held()
                save_ms.append((time.perf_counter() - s) * 1000)
        ckpt.wait()
    finally:
        ckpt.close()
    walls = [(b - a) * 1000 for a, b in zip(ends, ends[1:])]  # walls[k]: step k + 1
    after = [walls[i] for i in range(args.every, args.steps, args.every)]
    others = [w for k, w in enumerate(walls[1:], 1) if k % args.every != 0]
    median = statistics.median(others)
    return {"mode": mode, "host_ms": args.host_ms, "median_step_ms": median, "save_call_ms": save_ms,
            "after_save_ms": after, "after_save_x": [a / median for a in after]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=380.0)
    parser.add_argument("--size", type=int, default=4096, help="the matmuls' side")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--host-ms", type=float, default=0.0,
                        help="the loop's Python work per step (ms)")
    parser.add_argument("--modes", default="call,held")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax

    state = lora_state(args.layers, args.hidden, args.rank)
    report = {"arrays": len(jax.tree.leaves(state)), "device": str(jax.devices()[0]),
              "copy": copy_costs(state)}
    step, x, step_ms = stand_in_step(args.step_ms, args.size)
    report["stand_in_step_ms"] = step_ms
    report["runs"] = [run_steps(args, jax.tree.map(lambda v: v.copy(), state), step, x, mode)
                      for mode in args.modes.split(",")]
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
