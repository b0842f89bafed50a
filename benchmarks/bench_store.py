"""Benchmark: the demo with its workdir in an S3-compatible store vs on local disk.

    .venv/bin/python benchmarks/bench_store.py                       # the whole demo, once each
    .venv/bin/python benchmarks/bench_store.py --short               # finetune cut to 60 steps
    .venv/bin/python benchmarks/bench_store.py --repeats 2 --out /tmp/bench_store.json

Each run is `moeflow demo` in a fresh process (its own MLflow store, no cache, so every
stage executes) on one Ray node started here for all runs (with a start-up limit a loaded
host meets: tests/raypatient.py; its start is not timed), alternating store and local runs:
local: `workdir` on this host's disk; store: `workdir: s3://moeflow/bench-N` on
moto's S3 server on 127.0.0.1 (started here, stopped by process group), stages
working in a node-local scratch dir and handing off through the store (publish
with manifest, fetch into the verified cache), MLflow artifacts in the store.

Printed: wall seconds of each run, the sum of stage seconds (what the store adds
to stages, without interpreter start-up and the Ray start), per-stage seconds, and
the ratios store / local (median of pairs). Target (issue 29): wall ratio <= 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moeflow.core.ports import free_port  # noqa: E402

SHORT = ["finetune.max_steps=60", "finetune.checkpoint_every=30",
         "finetune.adapters.reverse.max_steps=30"]


def _stage_seconds(db: Path, run_id: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    parent = MlflowClient(f"sqlite:///{db}").get_run(run_id)
    return {k[:-len(".seconds")]: round(v, 1) for k, v in parent.data.metrics.items()
            if k.endswith(".seconds") and k.count(".") == 1}


def run_demo(kind: str, root: Path, env: dict, overrides: list[str], index: int) -> dict:
    work = root / f"{kind}-{index}"
    db = work / "mlflow.db"
    sets = [f"tracking.uri=sqlite:///{db}", f"experiment=bench-store-{kind}-{index}", *overrides]
    if kind == "store":
        sets.append(f"workdir=s3://moeflow/bench-{index}")
    cmd = [str(Path(sys.executable).parent / "moeflow"), "demo", "--workdir", str(work)]
    for item in sets:
        cmd += ["--set", item]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run {index} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    run_id = _run_id(db)
    stages = _stage_seconds(db, run_id)
    return {"kind": kind, "wall_s": round(wall, 1), "stages_s": round(sum(stages.values()), 1),
            "stages": stages}


def _run_id(db: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exps = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in exps],
                              filter_string="tags.`moeflow.kind` = 'pipeline'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id


def start_ray(root: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """One Ray head for every run (2 CPUs, the node's scratch under `root`), by process group."""
    port = free_port()
    offset = (root / "ray.log").stat().st_size if (root / "ray.log").exists() else 0
    log = open(root / "ray.log", "ab")
    cmd = [sys.executable, "-m", "tests.raypatient", "start", "--head", "--block",
           # 3 CPUs: a run's deploy leaves its Serve replica (1 CPU) up on this shared node,
           # and the next run's finetune still needs its 2 workers
           "--disable-usage-stats", "--include-dashboard", "false", "--num-cpus", "3",
           "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--temp-dir", tempfile.mkdtemp(prefix="/tmp/mfb")]
    for flag in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
                 "--ray-client-server-port"):
        cmd += [flag, str(free_port())]
    proc = subprocess.Popen(cmd, env=dict(env, MOEFLOW_SCRATCH=str(root / "scratch")), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while "Ray runtime started" not in (root / "ray.log").read_text(errors="replace")[offset:]:
        if proc.poll() is not None or time.time() > deadline:
            try:  # what the failed start left goes with its process group
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            raise SystemExit(f"Ray did not start (see {root / 'ray.log'})")
        time.sleep(1)
    return proc, f"127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="local/store pairs")
    ap.add_argument("--short", action="store_true", help="finetune cut to 60 + 30 steps")
    ap.add_argument("--set", action="append", default=[], help="more config overrides")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    from tests.s3server import s3_server

    overrides = (SHORT if args.short else []) + args.set
    root = Path(tempfile.mkdtemp(prefix="mf-bench-store-"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    runs = []
    with s3_server(str(root / "moto.log")) as s3env:
        from tests.raypatient import PATIENT_ENV

        env = dict(env, **s3env, **PATIENT_ENV, RAY_AUTH_MODE="disabled")
        for attempt in range(5):  # the raylet's own start-up waits can still fail on a loaded host
            try:
                ray_proc, address = start_ray(root, env)
                break
            except SystemExit:
                if attempt == 4:
                    raise
                print("Ray did not start; again", flush=True)
        env["RAY_ADDRESS"] = address
        try:
            for i in range(args.repeats):
                for kind in ("store", "local"):
                    res = run_demo(kind, root, env, overrides, i)
                    runs.append(res)
                    print(f"{kind:5s} #{i}: wall {res['wall_s']:7.1f} s, stages {res['stages_s']:7.1f} s  "
                          f"{json.dumps(res['stages'])}", flush=True)
        finally:
            import signal

            os.killpg(ray_proc.pid, signal.SIGTERM)
            try:
                ray_proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(ray_proc.pid, signal.SIGKILL)
    pairs = list(zip(runs[1::2], runs[::2]))  # (local, store): the store runs first in each pair
    wall = statistics.median(s["wall_s"] / loc["wall_s"] for loc, s in pairs)
    stages = statistics.median(s["stages_s"] / loc["stages_s"] for loc, s in pairs)
    load = os.getloadavg()[0]
    print(f"store / local: wall {wall:.2f}x, stages {stages:.2f}x (target <= 1.5x; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs)")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "wall_ratio": wall, "stages_ratio": stages,
                                              "load": load, "overrides": overrides}, indent=2))


if __name__ == "__main__":
    main()
