"""The import graph of moeflow/, moeflow_testing/, tasks/, workflows/ and benchmarks/ stays
layered, file by file (README: Layers).

A layer is a list of folders. Every first-party import -- at the top of a file or inside a
function -- points to a file of the same layer or a lower one, no files import each other in
a cycle, a stage module imports no other stage module, and an import inside a function
carries a comment saying why it is there (a heavy, optional dependency; a module the CLI
must not load for `--help`). The README's picture shows these layers, in this order.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Bottom to top: a file may import files of its own layer or a lower one. A layer is the
# folders (with everything under them) listed here; moeflow/__init__.py (the version) is core.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("moeflow/core",)),
    # what a model is and how it loads, and the checkpoint formats it loads from: a kept
    # quantised base loads packed (model/models.py -> checkpoint/), and checkpoint/ reads a
    # model's anatomy (checkpoint/ -> model/anatomy.py): one layer, no cycle between files
    ("model and formats", ("moeflow/model", "moeflow/checkpoint")),
    ("cost model", ("moeflow/parallel",)),
    ("capabilities", ("moeflow/training", "moeflow/evaluation", "moeflow/operators", "moeflow/quant")),
    ("serving", ("moeflow/serving",)),
    ("operations", ("moeflow/ops",)),
    ("fixtures", ("moeflow_testing",)),
    ("stages", ("tasks",)),
    ("workflows", ("workflows",)),
    ("benchmarks", ("benchmarks",)),
]
PACKAGES = ("moeflow", "moeflow_testing", "tasks", "workflows", "benchmarks")
ROOT_FILES = {"moeflow/__init__.py": "core"}  # the package itself: its version


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
BENCHMARKS = {m.rpartition(".")[2] for m in MODULES if m.startswith("benchmarks.")}
LAYER_NAMES = [name for name, _ in LAYERS]


def layer(module: str) -> int:
    rel = MODULES[module].relative_to(REPO).as_posix()
    if rel in ROOT_FILES:
        return LAYER_NAMES.index(ROOT_FILES[rel])
    for i, (_, folders) in enumerate(LAYERS):
        if any(rel.startswith(folder + "/") for folder in folders):
            return i
    raise AssertionError(f"{rel} is in no layer's folder: move it into one, or add its folder to "
                         "LAYERS (and README's picture)")


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
                if module.startswith("benchmarks.") and name.split(".")[0] in BENCHMARKS:
                    name = "benchmarks." + name
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


# the product and its fixtures; benchmarks are scripts run one at a time, loaded by no command
@pytest.mark.parametrize("package", ("moeflow", "moeflow_testing", "tasks", "workflows"))
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


def test_no_loose_module_in_moeflow():
    """moeflow/ holds only folders (and its __init__.py): each folder is a layer's part."""
    loose = [p.name for p in (REPO / "moeflow").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules directly in moeflow/: {loose} (put each in the folder of its layer)"


def test_readme_picture_shows_the_layers():
    """The README's picture names each layer's folders, one layer a line (its description
    may go on the next, indented), top layer first."""
    text = (REPO / "README.md").read_text()
    picture = text.split("\n## Layers\n", 1)[1].split("```", 2)[1]
    folder = re.compile(rf"(?<![\w/])((?:{'|'.join(PACKAGES)})(?:/\w+)*)/(?=\s|$)")
    drawn = [tuple(folder.findall(line.split("  ")[0])) for line in picture.splitlines()]
    drawn = [d for d in drawn if d]
    stated = [folders for _, folders in reversed(LAYERS)]
    assert drawn == stated, f"README's Layers picture shows {drawn}, tests/test_layers.py states {stated}"
