"""The manifest of a converted checkpoint: its file name, format tag and reader.

`convert` writes it last (it is what makes an output directory complete); `verify`,
`export` and the operators' placement read it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moeflow.core.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "moeflow.converted/1"


def read_manifest(path: str | Path) -> dict:
    """The manifest of a converted directory (UserError if it is not one)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise UserError(f"{path / MANIFEST}: missing (not a moeflow-converted checkpoint)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path / MANIFEST}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path / MANIFEST}: unknown format {manifest.get('format')!r}")
    return manifest


def publish(stage: Path, out: Path, fam, source: str, tensors: int, files: int, total: int,
            report: dict | None) -> dict:
    """Rename a verified staging dir to `out` (an empty `out` left by a resume goes first)
    and describe what was published: the convert stage's result (`report`: its verification,
    None when verification was skipped)."""
    if out.exists():
        out.rmdir()
    stage.rename(out)
    return {"output_dir": str(out), "manifest": str(out / MANIFEST),
            "manifest_sha256": hashlib.sha256((out / MANIFEST).read_bytes()).hexdigest(),
            "family": fam.model_type, "architecture": fam.architecture, "source_dir": source,
            "tensors": tensors, "files": files, "bytes": total, "report": report}
