"""The dry run and the planner share one cost model (moeflow/parallel/) through public names:
no module of theirs imports a private (`_x`) name from another, the dry run imports no stage
module (tasks/*), and none of their files is over 500 lines. Pure: reads the sources."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = sorted([*(REPO / "moeflow" / "parallel").glob("*.py"), REPO / "moeflow" / "parallel" / "planner.py",
                REPO / "moeflow" / "parallel" / "estimate.py", REPO / "moeflow" / "parallel" / "vllm_plan.py",
                REPO / "moeflow" / "parallel" / "memory.py", REPO / "workflows" / "dryrun.py"])


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_private_name_is_imported_across_modules():
    private = [f"{p.relative_to(REPO)}:{n.lineno}: {n.module}.{a.name}" for p in FILES for n in _imports(p)
               if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("moeflow", "tasks", "workflows"))
               for a in n.names if a.name.startswith("_") and a.name != "__version__"]
    assert not private, private


def test_the_dry_run_imports_no_stage_module():
    dryrun = REPO / "workflows" / "dryrun.py"
    names = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in _imports(dryrun)
             for a in (n.names if isinstance(n, ast.Import) else [n])]
    assert not [m for m in names if m and (m == "tasks" or m.startswith("tasks."))], names


def test_no_file_of_the_cost_model_is_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in FILES if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
