"""Small real stages for the object-storage tests (`stages.plugins: [tests.store_stages]`).

    make ──> read ──> reread          each records its node, scratch dir and the paths it read

`make` writes a file and a sub-directory; `read` opens what `make` handed on (it must be
a path under its own node's scratch), `reread` reads `read`'s output. Every stage
records the Ray node it ran on and its MOEFLOW_SCRATCH, so a multi-node test can check
that a stage only touched its own node's scratch.
"""

import os
from pathlib import Path

from moeflow.core.storage import scratch_root
from tasks.base import StageSpec


def _where(ctx) -> dict:
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "scratch": str(scratch_root()),
            "out_dir": str(ctx.out_dir), "pid": os.getpid()}


def _must_be_mine(path: str) -> str:
    if not Path(path).resolve().is_relative_to(scratch_root().resolve()):
        raise AssertionError(f"{path} is not under this node's scratch {scratch_root()}")
    return Path(path).read_text()


def _make(ctx):
    (ctx.out_dir / "data").mkdir()
    (ctx.out_dir / "data" / "x.txt").write_text("made")
    (ctx.out_dir / "big.bin").write_bytes(os.urandom(1 << 20))
    (ctx.out_dir / "unread.bin").write_bytes(b"never fetched by read")
    ctx.note("made x")
    return {"data_dir": str(ctx.out_dir / "data"), "file": str(ctx.out_dir / "data" / "x.txt"),
            "where": _where(ctx)}


def _read(ctx):
    got = ctx.input("make")
    text = _must_be_mine(got["file"]) + "+" + _must_be_mine(str(Path(got["data_dir"]) / "x.txt"))
    (ctx.out_dir / "read.txt").write_text(text)
    return {"text": text, "file": str(ctx.out_dir / "read.txt"), "upstream_dir": got["data_dir"],
            "where": _where(ctx)}


def _reread(ctx):
    got = ctx.input("read")
    return {"text": _must_be_mine(got["file"]), "where": _where(ctx)}


STAGES = [
    StageSpec(name="make", run=_make, sections=("model",)),
    StageSpec(name="read", run=_read, upstream=("make",), sections=("model",)),
    StageSpec(name="reread", run=_reread, upstream=("read",), sections=("model",)),
]
