"""The package's shape, read from its source with `ast` (nothing is imported): no import cycle
between modules nor between folders, every import points down the layer order or stays in its
layer, and no function is longer than MAX_FUNCTION_LINES.

This file is the one home of the layer order: docs/ARCHITECTURE.md links here.

Imports inside functions and under TYPE_CHECKING count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "relaytrain"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# The layers, lowest first, each a set of folders (or top-level modules): a module may import
# from its own folder, its layer and those below it. Layers name whole folders, so an upward
# import is one at folder level too. The package itself (its version) sits below everything, as
# do package __init__s that import nothing.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # what a user is told: one-line errors (exit 2) and warnings
    ("storage", "runlog"),  # fsspec URLs; a run's JSONL records
    ("checkpoint",),  # the checkpoint format: tensor keys, manifest, store, background writer
    ("model",),  # Olmo 3: modules, loss, GEMMs, stages, memory, accounting, HF interop
    # distributed building blocks that know nothing of configs, data or training: groups,
    # reductions, shards, FSDP, pipeline schedules as data and their simulation
    ("parallel",),
    ("data",),  # token files, orders, loader, ledger, audit, evaluation sets
    ("config",),  # the run config: typed sections, presets, overrides, checks
    ("train",),  # one process's step, stepper, pipeline stage, state, evaluation, metrics
    ("runtime",),  # controller, worker, engines, recovery
    ("parity", "compare", "bench", "cli"),  # entry points
)

MAX_FUNCTION_LINES = 80


def read_modules() -> dict[str, ast.Module]:
    """Package-relative dotted name ("model.olmo3"; "" for the package) -> its syntax tree."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _module_of(name: str, modules: dict[str, ast.Module]) -> str:
    """The module a dotted name refers to: itself, else the package it is in."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str, modules: dict[str, ast.Module]) -> dict[str, int]:
    """The package's modules that `module` imports -> the line of the first such import."""
    out: dict[str, int] = {}
    for node in ast.walk(modules[module]):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: relative import (write it absolute)"
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for full in names:
            if full == PACKAGE or full.startswith(PACKAGE + "."):
                target = _module_of(full[len(PACKAGE) + 1:], modules)
                if target != module:
                    out.setdefault(target, node.lineno)
    return out


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def folder_of(module: str) -> str:
    """The top-level folder (or module) of the package that `module` is in."""
    return module.partition(".")[0]


def layer_of(module: str, modules: dict[str, ast.Module]) -> int | None:
    if module == "" or not any(not _is_docstring(n) for n in modules[module].body):
        return -1
    folder = folder_of(module)
    return next((i for i, layer in enumerate(LAYERS) if folder in layer), None)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def layer_violations(modules: dict[str, ast.Module]) -> list[str]:
    out = []
    graph = {m: imports_of(m, modules) for m in modules}
    for module in sorted(graph):
        mine = layer_of(module, modules)
        if mine is None:
            out.append(f"{module}: in no layer (add it to LAYERS in tests/test_layers.py)")
            continue
        for dep, line in sorted(graph[module].items()):
            theirs = layer_of(dep, modules)
            if theirs is not None and theirs > mine:
                out.append(f"{module}:{line} imports {dep}, a higher layer "
                           f"({LAYERS[theirs][0]} above {LAYERS[mine][0]})")
    return out


def function_lengths() -> dict[str, int]:
    """"module:function" (methods "module:Class.method") -> lines from `def` to its last line."""
    out = {}
    for module, tree in read_modules().items():
        def walk(node: ast.AST, prefix: str, module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{module}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                    walk(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
                else:
                    walk(child, prefix)

        walk(tree, "")
    return out


def test_no_import_cycle():
    modules = read_modules()
    cycle = find_cycle({m: imports_of(m, modules) for m in modules})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def folder_graph(modules: dict[str, ast.Module]) -> dict[str, dict[str, int]]:
    """Folder -> the other folders its modules import (values: 0, for `find_cycle`)."""
    out: dict[str, dict[str, int]] = {}
    for module in modules:
        deps = out.setdefault(folder_of(module), {})
        for dep in imports_of(module, modules):
            if folder_of(dep) != folder_of(module) and dep != "":
                deps[folder_of(dep)] = 0
    return out


def test_no_import_cycle_between_folders():
    cycle = find_cycle(folder_graph(read_modules()))
    assert cycle is None, "folders import each other: " + " -> ".join(cycle)


def test_layers_name_whole_folders():
    entries = [e for layer in LAYERS for e in layer]
    assert all("." not in e for e in entries), "a layer names a folder, not a module in one"
    assert len(entries) == len(set(entries)), "a folder in two layers"


def _parsed(sources: dict[str, str]) -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in sources.items()}


def test_the_checks_catch_an_upward_import_and_a_cycle_of_folders():
    """The checker itself: a building block importing training is reported, and so are two
    entry-point folders importing each other through different modules (no module cycle)."""
    upward = _parsed({"train.step": "x = 1", "parallel.reduce": "x = 1",
                      "parallel.fsdp": "from relaytrain.train.step import x"})
    assert layer_violations(upward) == [
        "parallel.fsdp:1 imports train.step, a higher layer (train above parallel)"]
    assert find_cycle({m: imports_of(m, upward) for m in upward}) is None
    tangled = _parsed({"cli.a": "from relaytrain.bench.b import x",
                       "bench.b": "x = 1", "bench.c": "from relaytrain.cli.d import y",
                       "cli.d": "y = 2"})
    assert not layer_violations(tangled)  # one layer: no violation, but a tangle
    assert find_cycle({m: imports_of(m, tangled) for m in tangled}) is None
    assert find_cycle(folder_graph(tangled)) in (["bench", "cli", "bench"],
                                                 ["cli", "bench", "cli"])


def test_imports_follow_the_layers():
    violations = layer_violations(read_modules())
    assert not violations, "\n".join(violations)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_function_over_80_lines():
    lengths = function_lengths()
    found = sorted(f"{name} ({n} lines)" for name, n in lengths.items() if n > MAX_FUNCTION_LINES)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(found)}"
