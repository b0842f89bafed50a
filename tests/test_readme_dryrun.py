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

from moeflow.core.config import load_config

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

    cfg = load_config(REFERENCE)
    est, inp = dry_run(cfg)
    if not est.refused:
        lines = _lines(render_text(est, inp, width=100, parts=2))
        return "\n".join([BEGIN, "```", COMMAND, *lines, "```", END])
    # refused: the refusal, then the stages that can run priced, as the refusal's fix suggests
    out = [BEGIN, "```", COMMAND, *_lines("error: " + refusal(est)), "```"]
    runnable = _runnable(cfg, {c.name.split(".", 1)[1] for c in est.refused})
    rest = cfg.model_copy(update={"stages": cfg.stages.model_copy(update={"enabled": runnable})})
    est, inp = dry_run(rest)
    out += ["", "The stages that run at this size, priced (`--set stages.enabled=[...]`):", "", "```",
            f"{COMMAND} --set 'stages.enabled=[{','.join(runnable)}]'",
            *_lines(render_text(est, inp, width=100, parts=2)), "```", END]
    return "\n".join(out)


def _runnable(cfg, refused: set[str]) -> list[str]:
    """The enabled stages less the refused ones and every stage downstream of them."""
    from workflows import dag

    specs = dag.registry()
    out = set(refused) | dag.downstream(specs, refused)
    return [n for n in (cfg.stages.enabled or list(specs)) if n not in out]


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.strip("\n").splitlines()]


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
