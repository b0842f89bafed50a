"""The repository stands alone: nothing points at files outside it (a clone has only this)."""

import subprocess

from tests.conftest import REPO

OUTSIDE = ("../shared", "/work/shared", "FACTS.md", "DESIGN.md", "STYLE.md")


def test_no_reference_to_paths_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if name.startswith("tests/test_repo_selfcontained") or not path.is_file() or \
                path.suffix not in (".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".txt", ""):
            continue
        text = path.read_text(errors="replace")
        hits += [f"{name}: {word}" for word in OUTSIDE if word in text]
    assert not hits, hits
