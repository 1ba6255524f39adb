"""The package's shape: no import cycle, imports only point down the layers, modules stay small,
every algorithm is registered once and reachable from the command line."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nnx_posttrain"

# model -> data -> losses -> algorithms -> train (DESIGN.md). A package may import packages of its
# own layer and below; the shared modules (config, chat, sharding, checkpoint, metrics_log,
# host_allocator, progress) are below everything; tasks (the built-in task) and runs sit above
# algorithms, below train.
LAYERS = [
    {"config", "config_files", "chat", "metrics_log", "host_allocator", "progress"},
    {"sharding"},
    {"model"},
    {"checkpoint"},
    {"data"},
    {"tasks"},
    {"losses"},
    {"sampling"},
    {"algorithms"},
    {"runs", "inspection"},
    {"train"},
    {"experiment"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every nnx_posttrain module a file imports, at any depth of the file (lazy imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("nnx_posttrain"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nnx_posttrain"):
            for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                candidate = f"{node.module}.{alias.name}"
                out.add(candidate if candidate in MODULES else node.module)
    return out


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {_module_name(p) for p in FILES}
GRAPH = {_module_name(p): _imports(p) - {_module_name(p)} for p in FILES}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle():
    state, path = {}, []

    def visit(node):
        state[node] = "active"
        path.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == "active":
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_imports_point_down_the_layers():
    upward = []
    for module, imported in GRAPH.items():
        here = _top(module)
        if here not in LEVEL:
            continue
        for other in imported:
            there = _top(other)
            if there in LEVEL and LEVEL[there] > LEVEL[here]:
                upward.append(f"{module} imports {other} ({here} is below {there})")
    assert not upward, "\n".join(upward)


def test_every_subpackage_is_placed_in_a_layer():
    tops = {_top(m) for m in MODULES} - {""}
    assert tops <= set(LEVEL), f"add these to LAYERS: {sorted(tops - set(LEVEL))}"


def test_modules_stay_small():
    long = {str(p.relative_to(PACKAGE)): n for p in FILES
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, f"modules over ~400 lines (split them by job): {long}"


def test_each_package_says_what_lives_there():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init.relative_to(PACKAGE)} needs a docstring"


def test_every_algorithm_has_an_experiment_file_and_a_description():
    from nnx_posttrain import algorithms

    experiments = Path(__file__).resolve().parents[1] / "experiments"
    assert algorithms.names()[:3] == ["sft", "dpo", "simpo"]
    for name in algorithms.names():
        assert (experiments / f"{name}.py").exists(), name
        assert algorithms.registry.summary(algorithms.get(name)), name
