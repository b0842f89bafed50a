"""moeflow.core.fsutil.staged_dir: a directory is published whole or not at all."""

import pytest

from moeflow.core.fsutil import staged_dir


def test_success_replaces_and_failure_keeps_the_old_directory(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_dir(out) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("bad tensor")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dir left
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    with staged_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (out / "new.txt").exists()  # invisible until complete
    assert [p.name for p in out.iterdir()] == ["new.txt"]
