"""The README's Files table matches the tree: every path it names exists, and every package
folder -- and every module of the folders that group single modules (moeflow/core/,
moeflow/model/, moeflow/parallel/, moeflow_testing/, workflows/) -- is named by a row,
itself or through its folder."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EACH_MODULE = ("moeflow/core", "moeflow/model", "moeflow/parallel", "moeflow_testing", "workflows")
EACH_FOLDER = ("moeflow", "moeflow_testing", "tasks", "workflows", "benchmarks")


def expand(token: str) -> list[str]:
    """`a/{b,c}/{d,e}.py` -> the four paths it stands for."""
    braces = re.search(r"\{([^}]*)\}", token)
    if not braces:
        return [token]
    return [name for x in braces[1].split(",")
            for name in expand(token[:braces.start()] + x + token[braces.end():])]


def table_paths() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        cell = row.split(" | ")[0]
        base = ""
        for token in re.findall(r"`([^`]+)`", cell):
            token = token.rstrip("/")
            if "/" not in token and base:  # `memory.py` after `moeflow/parallel/planner.py`
                token = f"{base}/{token}"
            names = expand(token)
            paths += names
            base = names[0].rpartition("/")[0] if names[0].endswith(".py") else names[0]
    return paths


def test_every_path_in_the_table_exists():
    missing = [p for p in table_paths() if "<" not in p and not (REPO / p).exists()]
    assert not missing, f"README's Files table names paths that do not exist: {missing}"


def test_every_package_and_module_is_in_the_table():
    named = {p for p in table_paths() if "<" not in p}

    def covered(rel: str) -> bool:
        return any(rel == p or rel.startswith(p + "/") or p.startswith(rel + "/") for p in named)

    wanted = []
    for top in EACH_FOLDER:
        wanted += [d.relative_to(REPO).as_posix() for d in sorted((REPO / top).iterdir())
                   if d.is_dir() and (d / "__init__.py").is_file()]
        wanted.append(top)
    for folder in EACH_MODULE:
        wanted += [f.relative_to(REPO).as_posix() for f in sorted((REPO / folder).glob("*.py"))
                   if f.name != "__init__.py"]
    absent = [w for w in wanted if not covered(w)]
    assert not absent, f"not named in README's Files table: {absent}"
