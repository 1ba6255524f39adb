"""Where a jitted step's time goes: the XLA operations of a ``jax.profiler`` trace, summed by kind
of fused operation and by the model component they came from (the op_name metadata of the
compiled HLO: ``decoder_block_3/attention/softmax``, ``token_embedding``, ...), forward and
backward apart.

    python -m tools.bench.ours --spec "$(python -c 'import json; from tools.bench import spec_of;
        print(json.dumps(spec_of("tiny")))')" --case sft --profile 3

(``tools.bench.ours --profile N`` traces N steps after its measurement and prints this.)
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re

# The runtime's own events, not XLA operations.
_RUNTIME = re.compile(r"^\$|ThunkExecutor|PjitFunction|SlinkyThreadPool|ParseArguments|"
                      r"PjRt|Execute|Handle input|AllocateOutput|: |^while")
COMPONENTS = ("attention/softmax", "attention", "ffw", "norm", "token_embedding")


def _component(op_name: str) -> str:
    for key in COMPONENTS:
        if key in op_name:
            return key
    if op_name.startswith("jit(") and "/while/" not in op_name:
        return "optimizer"  # outside the loss's scan over micro-batches: clipping, AdamW update
    return "other"


def _op_names(hlo_text: str) -> dict[str, str]:
    """instruction name -> op_name; a fusion without one (YNNPACK's) takes its body's first, or
    else its first operand's."""
    names, calls, bodies, operands, current = {}, {}, {}, {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"^%?([\w.\-]+) \(", line)
        if head and not line.startswith(" "):
            current = head.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if op:
            names[m.group(1)] = op.group(1)
            if current is not None:
                bodies.setdefault(current, op.group(1))
        elif called:
            calls[m.group(1)] = called.group(1)
            operands[m.group(1)] = re.findall(r"[(,] ?%([\w.\-]+)", line.split("calls=")[0])
    for name, body in calls.items():
        if body in bodies:
            names[name] = bodies[body]
        else:
            known = [names[o] for o in operands.get(name, []) if o in names]
            if known:
                names[name] = known[0]
    return names


def breakdown(trace_dir: str, hlo_text: str, steps: int, program_only: bool = False) -> dict:
    """ms per step by fusion kind and by (component, fwd|bwd), from the trace in ``trace_dir``.
    ``program_only``: only the events of ``hlo_text``'s own instructions (a trace that also
    holds compilations and other programs)."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    op_names = _op_names(hlo_text)
    events = [e for e in json.load(gzip.open(path))["traceEvents"]
              if e.get("ph") == "X" and not _RUNTIME.search(e["name"])
              and (not program_only or e["name"] in op_names)]
    by_kind, by_component, by_op = (collections.Counter() for _ in range(3))
    for e in events:
        ms = e["dur"] / 1000 / steps
        by_kind[re.sub(r"\.\d+$", "", e["name"])] += ms
        op = op_names.get(e["name"], "")
        by_component[f"{_component(op)} {'bwd' if 'transpose(' in op else 'fwd'}"] += ms
        by_op[_short(op) or re.sub(r"\.\d+$", "", e["name"])] += ms
    total = sum(by_kind.values())
    return {"ops_ms_per_step": total,
            "by_kind_ms": dict(by_kind.most_common(12)),
            "by_component_ms": dict(by_component.most_common()),
            "by_op_ms": dict(by_op.most_common(20))}


def _short(op_name: str) -> str:
    """An op_name without the jit / scan prefixes and the block number: every block's
    ``decoder_block_N/attention/query/...`` counts as one ``attention/query/...``."""
    op = re.sub(r"decoder_block_\d+/", "", op_name)
    op = re.sub(r"^jit\([^)]*\)/", "", op)
    op = re.sub(r"(while/body/|closed_call/|checkpoint/|remat/|jvp\(|transpose\()", "", op)
    return op.replace(")", "")[-90:]


def keep(trace_dir: str, hlo_text: str, prefix: str) -> None:
    """Copy the trace in ``trace_dir`` to ``PREFIX.trace.json.gz`` and write ``hlo_text`` to
    ``PREFIX.hlo.txt``: a trace to open in Perfetto, a program to read its operations in."""
    import shutil

    shutil.copyfile(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0],
                    f"{prefix}.trace.json.gz")
    with open(f"{prefix}.hlo.txt", "w") as f:
        f.write(hlo_text)


def trace_steps(run_step, steps: int, trace_dir: str) -> None:
    import jax

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(run_step())


def print_breakdown(result: dict) -> None:
    total = result["ops_ms_per_step"]
    print(f"XLA operations: {total:.1f} ms per step")
    for title, key in (("by kind of operation", "by_kind_ms"),
                       ("by model component", "by_component_ms"),
                       ("by operation (every block together)", "by_op_ms")):
        print(f"  {title}:")
        for name, ms in result.get(key, {}).items():
            print(f"    {ms:9.1f} ms  {100 * ms / total:5.1f}%  {name}")
