"""The package's shape, read from its source with `ast` (nothing is imported): no import cycle
between modules, every import points down the layer order or stays in its layer, and no function
is longer than MAX_FUNCTION_LINES.

Imports inside functions and under TYPE_CHECKING count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "relaytrain"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# The layers, lowest first: a module may import from its own layer and those below it. A module
# belongs to the longest entry that names it or a package it is in. The package itself (its
# version) sits below everything, as do package __init__s that import nothing.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("storage", "runlog"),  # fsspec URLs; a run's JSONL records
    ("checkpoint",),  # the checkpoint format: tensor keys, store, background writer
    ("model",),  # Olmo 3: modules, loss, GEMMs, stages, memory, accounting, HF interop
    # distributed building blocks that know nothing of configs or training
    ("parallel.groups", "parallel.reduce", "parallel.shards", "parallel.pipeline.schedules"),
    ("parallel.fsdp",),  # sharding on FSDP2, with exact mode's integer reduce-scatter
    ("config",),
    ("data",),
    ("train",),  # one process's step, optimizer, evaluation, metrics
    ("parallel.pipeline",),  # the stage executor and the schedule simulation
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


def layer_of(module: str, modules: dict[str, ast.Module]) -> int | None:
    if module == "" or not any(not _is_docstring(n) for n in modules[module].body):
        return -1
    best = None
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if _in(module, (entry,)) and (best is None or len(entry) > best[1]):
                best = (i, len(entry))
    return None if best is None else best[0]


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


def test_imports_follow_the_layers():
    violations = layer_violations(read_modules())
    assert not violations, "\n".join(violations)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_function_over_80_lines():
    lengths = function_lengths()
    found = sorted(f"{name} ({n} lines)" for name, n in lengths.items() if n > MAX_FUNCTION_LINES)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(found)}"
