"""The import graph of moeflow/, tasks/ and workflows/ stays layered (README: Layers).

Every first-party import -- at the top of a file or inside a function -- points to a module
of the same layer or a lower one, the graph has no cycle, a stage module imports no other
stage module, and an import inside a function carries a comment saying why it is there
(a heavy, optional dependency; a module the CLI must not load for `--help`).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("moeflow", "tasks", "workflows")

# Bottom to top: a module may import modules of its own layer or a lower one. The first
# matching prefix names a module's layer (a package's modules share its layer).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("moeflow.core.errors", "moeflow.core.fsutil", "moeflow.core.sections", "moeflow.core.config",
              "moeflow.core.devices", "moeflow.model.remote_code", "moeflow.model.anatomy",
              "moeflow.model.params", "moeflow.model.routing", "moeflow.model.multimodal", "moeflow.model.split_lora",
              "moeflow.model.grouped_gemm", "moeflow.core.memmeter",
              "moeflow.core.hardware", "moeflow.parallel.memory", "moeflow.core.tracking", "moeflow.core.storage")),
    ("formats and plans", ("moeflow.checkpoint", "moeflow.parallel", "moeflow.parallel.planner", "moeflow.parallel.estimate",
                           "moeflow.parallel.estimate_constants",
                           "moeflow.parallel.vllm_plan", "moeflow.model.packed_base",
                           # which class loads a checkpoint: a kept quantised base loads packed
                           "moeflow.model.models")),
    ("capabilities", ("moeflow.training", "moeflow.evaluation", "moeflow.operators",
                      "moeflow.quant", "moeflow.quant.streamed", "moeflow_testing.tiny", "moeflow_testing.tiny_auto", "moeflow_testing.demo_data",
                      "moeflow_testing.demo_base", "moeflow_testing.reference")),
    ("serving", ("moeflow.serving",)),
    ("operations", ("moeflow.ops",)),
    ("stages", ("tasks",)),
    ("workflows", ("workflows",)),
]
PACKAGE_INITS = {"moeflow": 0}  # the package itself (its version) is core


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = modules()


def layer(module: str) -> int:
    if module in PACKAGE_INITS:
        return PACKAGE_INITS[module]
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and README's picture)")


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@lru_cache(maxsize=None)
def imports(module: str) -> list[tuple[str, int, bool, ast.stmt]]:
    """(first-party target module, line, inside a function, statement) of every import."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = package[: len(package) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in child.names] + [base]
            for name in names:
                target = _resolve(name) if name.split(".")[0] in PACKAGES else None
                if target and target != module:
                    out.append((target, child.lineno, in_function, child))
            visit(child, inner)

    visit(tree, False)
    return out


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_points_up():
    up = []
    for module in MODULES:
        for target, line, _, _ in imports(module):
            if layer(target) > layer(module):
                up.append(f"{MODULES[module].relative_to(REPO)}:{line}: {module} "
                          f"({LAYERS[layer(module)][0]}) imports {target} ({LAYERS[layer(target)][0]})")
    assert not up, "imports pointing to a higher layer:\n" + "\n".join(sorted(set(up)))


def test_no_import_cycle():
    graph = {m: {t for t, *_ in imports(m)} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_stage_imports_no_other_stage():
    shared = {"tasks", "tasks.base", "tasks.records"}
    bad = [f"{module} imports {target}" for module in MODULES if module.startswith("tasks.")
           for target, *_ in imports(module) if target.startswith("tasks.") and target not in shared]
    assert not bad, "stage modules share code through the library, not each other:\n" + "\n".join(bad)


def _function_imports(path: Path) -> list[tuple[int, int]]:
    """(first line, last line) of each block of consecutive import statements inside a
    function."""
    tree = ast.parse(path.read_text())
    blocks = []

    def visit(node, in_function):
        body_lists = [getattr(node, f) for f in ("body", "orelse", "finalbody", "handlers")
                      if isinstance(getattr(node, f, None), list)]
        for body in body_lists:
            block: list[ast.stmt] = []
            for stmt in body + [None]:
                if in_function and isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    block.append(stmt)
                    continue
                if block:
                    blocks.append((block[0].lineno, block[-1].end_lineno or block[-1].lineno))
                    block = []
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return blocks


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_inside_functions_say_why(package):
    """An import inside a function has a comment on one of its lines or on the line
    above its block of imports; everything else is imported at the top of the file."""
    bare = []
    for path in sorted((REPO / package).rglob("*.py")):
        lines = path.read_text().splitlines()
        for first, last in _function_imports(path):
            span = lines[first - 2: last] if first >= 2 else lines[:last]
            if not any("#" in line for line in span):
                bare.append(f"{path.relative_to(REPO)}:{first}: {lines[first - 1].strip()}")
    assert not bare, (f"{len(bare)} imports inside functions without a comment saying why "
                      "(move them to the top, or say why they are lazy):\n" + "\n".join(bare))
