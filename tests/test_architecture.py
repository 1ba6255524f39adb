"""The package's shape: no import cycle, imports only point down the layers, modules stay small,
every algorithm is registered once and reachable from the command line."""

import ast
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nnx_posttrain"

# model -> data -> losses -> algorithms -> train (DESIGN.md). A package may import packages of its
# own layer and below; the shared modules (errors, config, chat, families, sharding, checkpoint,
# metrics_log, progress) are below everything; agents (tool calling) beside the sampler; tasks
# (the built-in tasks) and runs sit above algorithms, below train; plan (a run's step compiled ahead of time) above train; the Python API and the command line are the library's users, on top.
LAYERS = [
    {"errors"},
    {"config", "config_files", "chat", "metrics_log", "progress", "user_code", "cpu_host", "families", "chat_formats",
     "chat_harmony"},
    {"sharding"},
    {"model"},
    {"checkpoint"},
    {"data"},
    {"losses"},
    {"sampling", "agents"},
    {"algorithms"},
    {"tasks"},
    {"runs", "inspection", "export", "compare", "harness"},
    {"train"},
    {"plan"},
    {"api"},
    {"cli"},
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


# ----------------------------------------------------------------------------- a library


def _calls(path: Path):
    """(each raise's exception and each call's function, as source; the name of the function
    it is in, None at a module's top level). A bare ``raise`` re-raises what its ``except``
    caught: ``raise SystemExit`` inside ``except SystemExit``."""
    def visit(node, function, caught):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = ast.unparse(node.type)
        if isinstance(node, ast.Raise):
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            yield "raise " + (caught if exc is None else ast.unparse(exc)), function
        elif isinstance(node, ast.Call):
            yield ast.unparse(node.func), function
        for child in ast.iter_child_nodes(node):
            yield from visit(child, function, caught)

    yield from visit(ast.parse(path.read_text()), None, "")


# where the process may end with SystemExit: the module run as the command, which turns main's
# status into it (the console script's wrapper and python -m experiments.NAME exit with the
# status console() / experiment() return)
ENTRY_POINTS = {"cli/__main__.py": {None}}


def test_only_the_command_line_ends_the_process():
    """The library raises typed exceptions and the command line's ``main`` returns a status;
    SystemExit is raised (or re-raised) by the two-line __main__ alone, os._exit only in the
    command line's package, os.exec* nowhere."""
    found = []
    for path in FILES:
        where = path.relative_to(PACKAGE)
        for call, function in _calls(path):
            if call in ("raise SystemExit", "sys.exit", "exit", "quit"):
                if function not in ENTRY_POINTS.get(str(where), ()):
                    found.append(f"{where}: {call} in {function or 'the module'}")
            elif call.startswith("os._exit") and where.parts[0] != "cli":
                found.append(f"{where}: {call}")
            elif call.startswith("os.exec"):
                found.append(f"{where}: {call}")
    assert not found, found


def test_tools_end_the_process_only_when_run_as_commands():
    """A tool's ``main(argv)`` and helpers raise ``ToolError`` (tests and other tools call them);
    only its ``if __name__ == "__main__"`` block exits, with ``tools.exit_status(main)``."""
    found = [f"{path.relative_to(PACKAGE.parent)}: {call} in {function}"
             for path in sorted((PACKAGE.parent / "tools").rglob("*.py"))
             for call, function in _calls(path)
             if call in ("raise SystemExit", "sys.exit", "exit", "quit") and function is not None]
    assert not found, found


def test_tools_use_the_librarys_public_names():
    """A tool (benchmarks, results scripts) imports no private name of the library: what a tool
    needs is public, so that it does not break silently when the library's insides change."""
    private = []
    for path in sorted((PACKAGE.parent / "tools").rglob("*.py")):
        tree = ast.parse(path.read_text())
        ours = set()  # the names a tool binds to the library's modules and objects
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnx_posttrain"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
                ours |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                ours |= {(a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.startswith("nnx_posttrain")}
        private += [f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}"
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ours and node.attr.startswith("_")
                    and not node.attr.startswith("__")]
    assert not private, private


MAX_LINES, MAX_PARAMETERS = 60, 6


def _parameters(node) -> list[str]:
    """What a caller passes: positional and keyword parameters, ``*args`` and ``**kwargs`` one
    each; ``self`` / ``cls`` are not counted (the caller does not pass them), and an options
    object counts as one, like any parameter."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
    return names + [x.arg for x in (a.vararg, a.kwarg) if x is not None]


def test_functions_fit_on_a_screen():
    """No function (or method, nested ones included) of the package over 60 lines (from its
    ``def`` to its last line, docstring included) or over 6 parameters (``_parameters``). Long
    lists of settings are grouped in a small frozen dataclass (a loss family's options, a
    ``Projection``, a ``Draw``); a long function is split by job."""
    over = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params, lines = _parameters(node), node.end_lineno - node.lineno + 1
                if lines > MAX_LINES or len(params) > MAX_PARAMETERS:
                    over.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: "
                                f"{lines} lines, {len(params)} parameters")
    assert not over, "\n".join(over)


# ----------------------------------------------------------------------------- options, registries


def test_each_algorithm_option_is_its_loss_familys_and_written_once():
    """An algorithm's settings (``--algo.*``) derive from its loss family's options
    (``losses.common.Options``: the fields, TRL's defaults, the checks): the algorithm's
    ``Config`` adds fields of its own, never declares one of the options' again."""
    import dataclasses

    from nnx_posttrain import algorithms
    from nnx_posttrain.losses.common import Options

    with_options = set()
    for name, cls in algorithms.ALGORITHMS.items():
        families = [b for b in cls.Config.__mro__ if issubclass(b, Options) and b is not Options
                    and "Config" not in b.__name__]
        for family in families:
            with_options.add(name)
            assert dataclasses.is_dataclass(family) and family.__dataclass_params__.frozen
            again = {f.name for f in dataclasses.fields(family)} & set(
                cls.Config.__dict__.get("__annotations__", {}))
            assert not again, f"{name}: {cls.Config.__name__} declares {again} again"
    assert with_options >= {"dpo", "simpo", "cpo", "orpo", "kto", "reward", "grpo", "rloo", "ppo",
                            "distill"}


def test_losses_take_arrays_and_options():
    import inspect

    from nnx_posttrain.losses import distill, dpo, grpo, kto, preference, reward, rl, rloo

    for fn in (dpo.dpo, preference.simpo, preference.cpo, preference.orpo, kto.kto,
               reward.reward_bt, grpo.clipped_policy_loss, rloo.rloo_loss, rl.ppo_loss):
        assert list(inspect.signature(fn).parameters)[1:] == ["options"], fn.__name__
    assert list(inspect.signature(distill.divergence).parameters)[-1] == "options"


def _top_level_calls(path: Path):
    """The names of the functions a module calls when it is imported (its top-level statements,
    not the bodies of its functions and classes)."""
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from (ast.unparse(d.func if isinstance(d, ast.Call) else d)
                        for d in stmt.decorator_list)  # a decorator runs on import too
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                yield ast.unparse(node.func)


def test_importing_a_module_registers_nothing():
    """Algorithms, the built-in task's data and models are in tables (``algorithms.registry``,
    ``tasks.BUILTIN_MODELS``): no module registers anything, or reads a file, when imported;
    ``tasks.register()`` is called by those who need the built-in task."""
    found = [f"{path.relative_to(PACKAGE)}: {call}" for path in FILES
             for call in _top_level_calls(path)
             if "register" in call.split(".")[-1] or call.split(".")[-1] in (
                 "read_bytes", "read_text", "hexdigest")]
    assert not found, found
    from nnx_posttrain import algorithms

    assert list(algorithms.ALGORITHMS) == algorithms.names() and len(set(
        cls.Config for cls in algorithms.ALGORITHMS.values())) == len(algorithms.ALGORITHMS)


TRAIN_DIR = None  # (another checkout's train/, to see the test fail on the code before the fix)


def test_train_names_no_algorithm_and_no_data_kind():
    """What differs between algorithms is a member of the algorithm protocol: the loop and its
    setup compare nothing with an algorithm's name or a data kind, and read no data kind."""
    from nnx_posttrain import algorithms

    words = set(algorithms.names()) | {a.data_kind for a in algorithms.ALGORITHMS.values()}
    found = []
    for path in sorted((TRAIN_DIR or PACKAGE / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "data_kind":
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = [ast.unparse(x) for x in sides if
                         (isinstance(x, ast.Constant) and x.value in words)
                         or (isinstance(x, ast.Attribute) and x.attr == "name"
                             and ast.unparse(x.value).endswith("algorithm"))
                         or (isinstance(x, (ast.Tuple, ast.List, ast.Set)) and any(
                             isinstance(e, ast.Constant) and e.value in words for e in x.elts))]
                if named:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("hasattr", "getattr") \
                    and any(isinstance(a, ast.Constant) and a.value in ("rewards", "calculate_kl")
                            for a in node.args):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_importing_the_package_changes_nothing_but_the_keras_backend_defaults():
    import json
    import subprocess
    import sys

    probe = """
import json, os, sys
before = (dict(os.environ), list(sys.meta_path), sys.unraisablehook, set(sys.modules))
import nnx_posttrain
env, meta, hook, modules = before
print(json.dumps({
    "env": sorted(k for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k)),
    "meta_path": [repr(f) for f in sys.meta_path if f not in meta],
    "hook": sys.unraisablehook is hook,
    "none": sorted(k for k, v in sys.modules.items() if v is None),
    "heavy": sorted({"jax", "keras", "tensorflow", "torch"} & set(sys.modules)),
}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=120, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["env"] == ["KERAS_BACKEND", "KERAS_NNX_ENABLED"]
    assert seen["meta_path"] == [] and seen["hook"] and seen["none"] == []
    assert seen["heavy"] == []  # the API is imported when first used
