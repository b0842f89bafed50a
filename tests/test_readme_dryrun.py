"""README's dry-run example is the dry run's own output for configs/reference-2.8t.yaml, never
typed by hand: this module writes it, and its test fails when README and output differ.

    python -m tests.test_readme_dryrun          # rewrite README's block from a fresh dry run
    pytest tests/test_readme_dryrun.py          # check it

The block sits between README's `<!-- dryrun:reference -->` markers: the command, then what
`moeflow run configs/reference-2.8t.yaml --dry-run` prints first (the stage table and the
critical path), or the refusal it exits 2 with.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moeflow.config import load_config

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
REFERENCE = REPO / "configs" / "reference-2.8t.yaml"
BEGIN, END = "<!-- dryrun:reference begin -->", "<!-- dryrun:reference end -->"
COMMAND = "$ moeflow run configs/reference-2.8t.yaml --dry-run"
# rows whose figures include the plan stage's own time, measured by each dry run (the planner's
# searches on the host it runs on): compared by their stage and devices only
MEASURED_ROWS = ("│ plan ", "│ pipeline ", "│ booked ")


def block() -> str:
    """The README block from a fresh dry run of the reference config."""
    from workflows.dryrun import dry_run, refusal, render_text

    est, inp = dry_run(load_config(REFERENCE))
    out = ("error: " + refusal(est)) if est.refused else render_text(est, inp, width=100, parts=2)
    lines = [ln.rstrip() for ln in out.strip("\n").splitlines()]
    return "\n".join([BEGIN, "```", COMMAND, *lines, "```", END])


def readme_block(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{README}: no {BEGIN} ... {END} block")
    return text[start:end + len(END)]


def _comparable(text: str) -> list[str]:
    """The block's lines, those of MEASURED_ROWS cut to their stage cell and devices."""
    return [ln.split("│")[1:3] if ln.startswith(MEASURED_ROWS) else ln for ln in text.splitlines()]


def test_readme_shows_the_reference_dry_run_as_it_prints():
    have = readme_block(README.read_text())
    want = block()
    assert _comparable(have) == _comparable(want), (
        "README's dry-run block is stale: run `python -m tests.test_readme_dryrun`")


if __name__ == "__main__":
    text = README.read_text()
    README.write_text(text.replace(readme_block(text), block()))
    print(f"{README}: dry-run block rewritten", file=sys.stderr)
