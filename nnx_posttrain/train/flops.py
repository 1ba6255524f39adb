"""FLOPs of a compiled step, every iteration of its loops counted.

XLA's ``compiled.cost_analysis()["flops"]`` counts the body of a ``while`` loop (a ``lax.scan``,
a ``fori_loop``) **once**, whatever its trip count: a step that accumulates gradients over 4
micro-batches in a scan reports about a quarter of its FLOPs. :func:`step_flops` corrects it from
the optimised program: for every ``while`` whose trip count the compiler knows (it annotates the
loop with ``known_trip_count``: scans, fixed-length ``fori_loop``s), the body's FLOPs — XLA's own
cost analysis of that computation, nested loops counted the same way — are counted that many
times. Loops whose trip count depends on the data (the blocked attention's walk over key blocks,
``model/flash.py``) stay counted once: XLA cannot know it either.

The CPU and GPU compilers annotate the trip count; the TPU compiler leaves it to be read from the
loop: a condition ``counter < N`` (a constant) on a counter that starts at 0, as every scan's is.

The body's cost comes from XLA's cost analysis of a module rooted at the body computation
(``jaxlib``'s ``hlo_module_cost_analysis``); where that is unavailable, :func:`step_flops`
returns XLA's uncorrected figure and says so through :func:`counted_loops`' empty result.
"""

from __future__ import annotations

import functools
import re

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_WHILE = re.compile(r"\bwhile\(%([\w.\-]+)\), condition=%([\w.\-]+), body=%([\w.\-]+)")
_TRIPS = re.compile(r"\"known_trip_count\":\{\"n\":\"(\d+)\"")
_NAME = re.compile(r"%([\w.\-]+)")
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][\w\-]*)\((.*?)\)")
_COUNTER = re.compile(r"ROOT %[\w.\-]+ = pred\[\]\S* compare\(%([\w.\-]+), %([\w.\-]+)\), "
                      r"direction=LT")


def xla_flops(compiled) -> float | None:
    """XLA's own count (each loop body once), where the backend gives it."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: nothing to show
        return None
    return _flops_of(cost)


def _flops_of(cost) -> float | None:
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    return float(cost["flops"]) if isinstance(cost, dict) and cost.get("flops") else None


def step_flops(compiled) -> float | None:
    """FLOPs per device of one call of ``compiled``: XLA's count with the body of every loop of
    known trip count counted once per iteration (module docstring). None where XLA gives no
    count."""
    total = xla_flops(compiled)
    if total is None:
        return None
    try:
        program = _Program(compiled.as_text())
        return total + program.loop_extra(program.entry)
    except Exception:  # noqa: BLE001 - the correction needs jaxlib internals: keep XLA's figure
        return total


def counted_loops(compiled) -> list[int]:
    """The trip counts of the loops :func:`step_flops` multiplies (outermost first; empty when
    there are none or the correction is unavailable)."""
    try:
        program = _Program(compiled.as_text())
        program.cost("")  # raises where the cost analysis is unavailable
    except Exception:  # noqa: BLE001
        return []
    return [n for _, n in program.top_loops(program.entry)]


class _Program:
    """An optimised HLO module's text: its computations, their loops, and XLA's cost of the
    module rooted at any one of them."""

    def __init__(self, text: str):
        self.header, _, _ = text.partition("\n")
        self.text = text
        self.bodies: dict[str, list[str]] = {}  # in the text's order
        self.headers: dict[str, str] = {}
        self.outside: list[str] = []  # the lines outside computations (stack frames' tables)
        self.entry = ""
        current = None
        for line in text.splitlines()[1:]:
            match = _HEADER.match(line)
            if match:
                current = match.group(2)
                self.bodies[current], self.headers[current] = [], line
                self.entry = current if match.group(1) else self.entry
            elif current is not None and line.strip() == "}":
                current = None
            elif current is not None:
                self.bodies[current].append(line)
            else:
                self.outside.append(line)

    def reachable(self, name: str) -> set[str]:
        """The computations ``name`` calls, directly or not, and itself."""
        seen, todo = {name}, [name]
        while todo:
            for line in self.bodies.get(todo.pop(), ()):
                for ref in _NAME.findall(line):
                    if ref in self.bodies and ref not in seen:
                        seen.add(ref)
                        todo.append(ref)
        return seen

    def rooted_at(self, name: str) -> str:
        """The module's text with ``name`` as its entry and only what it reaches (a real
        model's step holds hundreds of loops: parsing the whole module for each was minutes)."""
        keep, lines = self.reachable(name), ["HloModule cost", *self.outside]
        for computation, body in self.bodies.items():
            if computation in keep:
                header = self.headers[computation].removeprefix("ENTRY ")
                lines += ["ENTRY " * (computation == name) + header, *body, "}"]
        return "\n".join(lines)

    def top_loops(self, name: str) -> list[tuple[str, int]]:
        """(body, trip count) of the known-trip-count loops that ``name`` reaches without
        entering another loop's body."""
        loops, seen, todo = [], {name}, [name]
        while todo:
            caller = todo.pop()
            for line in self.bodies.get(caller, ()):
                loop = _WHILE.search(line)
                trips = loop and self.trips(line, caller, *loop.groups()[:2])
                if trips:
                    loops.append((loop.group(3), trips))
                    continue
                for ref in _NAME.findall(line):
                    if ref in self.bodies and ref not in seen:
                        seen.add(ref)
                        todo.append(ref)
        return loops

    def trips(self, line: str, caller: str, init: str, condition: str) -> int | None:
        """The trip count of the ``while`` on ``line``: the compiler's annotation, else read from
        a condition ``counter < N`` whose counter starts at 0; None when unknown."""
        known = _TRIPS.search(line)
        if known:
            return int(known.group(1))
        compare = next(filter(None, map(_COUNTER.search, self.bodies.get(condition, ()))), None)
        if compare is None:
            return None
        counter, limit = (self.definition(condition, n) for n in compare.groups())
        if not (counter and counter[0] == "get-tuple-element" and limit
                and limit[0] == "constant"):
            return None
        index = re.search(r"index=(\d+)", counter[2])
        start = self.definition(caller, init)
        if not (index and start and start[0] == "tuple"):
            return None
        operands = re.sub(r"/\*.*?\*/", "", start[1]).split(",")
        first = self.definition(caller, operands[int(index.group(1))].strip().lstrip("%"))
        while first and first[0] in ("copy", "bitcast"):
            first = self.definition(caller, first[1].strip().lstrip("%"))
        if first and first[0] == "constant" and first[1].strip() == "0":
            return int(limit[1])
        return None

    def definition(self, computation: str, name: str) -> tuple[str, str, str] | None:
        """(opcode, operands, the rest of the line) of instruction ``name`` in ``computation``."""
        return self._definitions(computation).get(name)

    @functools.lru_cache(maxsize=None)
    def _definitions(self, computation: str) -> dict[str, tuple[str, str, str]]:
        out = {}
        for line in self.bodies.get(computation, ()):
            match = _DEF.match(line)
            if match:
                out.setdefault(match.group(1), (match.group(2), match.group(3),
                                                line[match.end():]))
        return out

    def loop_extra(self, name: str) -> float:
        """FLOPs that XLA's count of ``name`` misses: each loop's further iterations."""
        extra = 0.0
        for body, trips in self.top_loops(name):
            full = self.cost(body) + self.loop_extra(body)
            extra += trips * full - self.cost(body)
        return extra

    @functools.lru_cache(maxsize=None)
    def cost(self, name: str) -> float:
        """XLA's FLOPs of the module rooted at computation ``name`` (its loops' bodies once);
        ``""``: the entry computation."""
        from jax._src.lib import _jax, hlo

        module = hlo.hlo_module_from_text(self.rooted_at(name or self.entry))
        return _flops_of(_jax.hlo_module_cost_analysis(_analysis_client(), module)) or 0.0


@functools.lru_cache(maxsize=1)
def _analysis_client():
    """The client that analyses a module's text: the host CPU's (the analysis is the module's,
    not the device's; the TPU's client cannot analyse a module rooted at a loop's body, and a ~1 B
    step on a v5e then counted 15.2 TFLOP for its 28.1), a CPU client of its own where
    ``JAX_PLATFORMS`` leaves JAX none."""
    import jax
    from jax._src.lib import xla_client

    try:
        return jax.local_devices(backend="cpu")[0].client
    except RuntimeError:  # JAX_PLATFORMS=tpu (or cuda): no CPU backend in JAX
        return xla_client.make_cpu_client()
