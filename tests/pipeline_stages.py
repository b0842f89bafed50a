"""Small real stages for runner tests, loaded through `stages.plugins`.

    a ──> b ──> c          b reads data.train_file: a line "bad" fails it
     └──> d                d runs concurrently with b

Each stage writes a file into its out dir and returns a small record;
`b` and `d` record their start/end wall times so tests can see overlap.
"""

import time
from pathlib import Path

from moeflow.core.errors import UserError
from tasks.base import StageSpec


def _a(ctx):
    (ctx.out_dir / "a.txt").write_text("1")
    return {"value": 1, "path": str(ctx.out_dir / "a.txt")}


def _b(ctx):
    start = time.time()
    path = Path(ctx.config.data.train_file)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() == "bad":
            raise UserError(f"{path}:{number}: bad line")
    time.sleep(float(ctx.config.optimizer.lr) if ctx.config.optimizer.lr < 5 else 0)
    value = ctx.input("a")["value"] + 1
    (ctx.out_dir / "b.txt").write_text(str(value))
    return {"value": value, "start": start, "end": time.time()}


def _c(ctx):
    return {"value": ctx.input("b")["value"] * 10}


def _d(ctx):
    start = time.time()
    time.sleep(float(ctx.config.optimizer.lr) if ctx.config.optimizer.lr < 5 else 0)
    return {"value": -1, "start": start, "end": time.time()}


def _crashy(ctx):
    """Kills its worker process the first time (a lost worker), succeeds after."""
    import os

    marker = Path(ctx.config.workdir) / "crashy.attempts"
    marker.parent.mkdir(parents=True, exist_ok=True)
    with marker.open("a") as fh:
        fh.write("x")
    if len(marker.read_text()) == 1:
        os._exit(1)
    return {"attempts_seen": len(marker.read_text())}


def _rendezvous(me: str, other: str):
    """Stages p and q each wait for the other to start: passes only if they overlap."""

    def run(ctx):
        root = Path(ctx.config.workdir)
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{me}.started").write_text(str(time.time()))
        deadline = time.time() + 60
        while not (root / f"{other}.started").exists():
            if time.time() > deadline:
                raise UserError(f"stage {me}: {other} never ran at the same time")
            time.sleep(0.05)
        return {"met": other}

    return run


def _partial(ctx):
    """Resumable: writes piece-1..3, keeping the pieces an earlier attempt wrote; while
    <workdir>/fail-once exists it fails after one piece (and removes the file)."""
    kept = sorted(p.name for p in ctx.out_dir.glob("piece-*"))
    if kept:
        ctx.note(f"kept {len(kept)} piece(s) of an earlier attempt")
    flag = Path(ctx.config.workdir) / "fail-once"
    for i in range(1, 4):
        piece = ctx.out_dir / f"piece-{i}"
        if not piece.exists():
            piece.write_text(str(i))
        if flag.exists():
            flag.unlink()
            raise UserError("partial: failing once after a piece")
    return {"kept": len(kept), "metrics": {"pieces": 3}, "label": "x",
            "headline": {"kept": len(kept), "ok": True}}


def _noisy(ctx):
    """Chatters like a library on the worker, and has one thing to tell the user."""
    import warnings

    print("NOISE-from-worker stdout", flush=True)
    warnings.warn("NOISE-from-worker FutureWarning", FutureWarning, stacklevel=1)
    ctx.note("the one line the user needs")
    ctx.progress(2, 2, "pieces")  # in a log (not a terminal): one line per quarter reached
    time.sleep(1.5)  # Ray's log monitor forwards worker output about once a second
    return {"value": 1}


def _nested_run(ctx) -> None:
    """A run nested under the stage's own, left open (as finetune's per-tenant runs are while
    they train)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    parent = client.get_run(ctx.mlflow_run_id)
    client.create_run(parent.info.experiment_id, run_name="slow:tenant",
                      tags={"mlflow.parentRunId": ctx.mlflow_run_id})


def _slow(ctx):
    _nested_run(ctx)
    ctx.note("nested run open")  # tests signal the driver once it is
    time.sleep(600)
    return {}


def _nesty(ctx):
    _nested_run(ctx)
    raise RuntimeError("failed, its nested run left open")


def _gpus_for(cfg) -> float:
    """num_gpus decided from the config at submit time (as operators / regress do)."""
    return 1.0 if cfg.seed == 7 else 0.0


def _granted(ctx):
    import ray

    return {"gpus": ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)}


def _bindy(ctx):
    """Fails its first attempt as a port taken between choosing and binding it does."""
    marker = Path(ctx.config.workdir) / "bindy.attempts"
    marker.parent.mkdir(parents=True, exist_ok=True)
    with marker.open("a") as fh:
        fh.write("x")
    if len(marker.read_text()) == 1:
        raise RuntimeError("HAProxy crashed:\n[ALERT] (7) : Starting frontend stats: cannot bind socket "
                           "(Address already in use) [127.0.0.1:8404]\n[ALERT] (7) : Fatal errors")
    return {"attempts_seen": len(marker.read_text())}


def _wordy(ctx):
    raise RuntimeError("the first line says it\n  File \"x.py\", line 2\n" + "detail " * 400)


STAGES = [
    StageSpec(name="a", run=_a, sections=("model",)),
    StageSpec(name="b", run=_b, upstream=("a",), sections=("data", "optimizer")),
    StageSpec(name="c", run=_c, upstream=("b",), sections=("lora",)),
    StageSpec(name="d", run=_d, upstream=("a",), sections=("optimizer",)),
    StageSpec(name="p", run=_rendezvous("p", "q"), upstream=("a",)),
    StageSpec(name="q", run=_rendezvous("q", "p"), upstream=("a",)),
    StageSpec(name="live", run=_c, upstream=("b",), sections=("lora",), cacheable=False),
    StageSpec(name="crashy", run=_crashy, max_retries=2),
    StageSpec(name="slow", run=_slow),
    StageSpec(name="nesty", run=_nesty),
    StageSpec(name="noisy", run=_noisy),
    StageSpec(name="partial", run=_partial, upstream=("a",), sections=("model",), resumable=True),
    StageSpec(name="gpu_by_config", run=_granted, num_gpus=_gpus_for),
    StageSpec(name="bindy", run=_bindy),
    StageSpec(name="wordy", run=_wordy),
]
