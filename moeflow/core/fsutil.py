"""Publishing a directory whole: readers see the old one or the complete new one.

Every stage output that is a directory of files (a checkpoint, a quantised or
permuted copy) is written into a temp dir beside its destination and renamed
into place only when complete, so a crash or a bad tensor never leaves a
half-written directory that looks like a checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temp dir beside `out`; on success it replaces `out` (an existing
    `out` is removed first), on any exception it is deleted and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
