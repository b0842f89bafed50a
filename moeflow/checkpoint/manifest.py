"""The manifest of a converted checkpoint: its file name, format tag and reader.

`convert` writes it last (it is what makes an output directory complete); `verify`,
`export` and the operators' placement read it.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeflow.errors import UserError

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
