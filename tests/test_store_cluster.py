"""The demo on a real multi-node Ray cluster on one host, with its workdir in an S3-compatible
store and no shared directory between the nodes' stages (slow: 8-14 min on 2 busy cores).

A head and two worker nodes are started with `ray start --block` (each its own temp dir,
ports, node-local scratch dir `MOEFLOW_SCRATCH` and custom resource `node_a` / `node_b`);
the model and the data are uploaded to the store and the config names only s3:// URIs.
Stages are placed on alternating nodes (`stages.resources.<stage>.resources`). While
finetune trains, the worker node running it is killed (its process group, SIGKILL) after
Ray Train registered a checkpoint in the store: the pipeline must finish, finetune resuming
from that checkpoint on the other node. Afterwards every cache entry on every node is
audited: an output was published from the node its stage was placed on, and an upstream
output published elsewhere was fetched from the store, never read from the other
node's scratch; no record names a path on any node. The lost Ray Train controller's
placement group, rescheduled onto the surviving worker, must be released by the runner
(else serving, placed there, waits forever). Runs on 2 busy cores: 8-14 min.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moeflow.core import storage as S
from tests.conftest import BIN, REPO, free_port
from tests.raypatient import PATIENT_ENV
from tests.s3server import BUCKET, s3_server

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(3600)]

PLACE = {"convert": "node_a", "plan": "node_b", "operators": "node_a", "calibrate": "node_b",
         "regress": "node_a", "serving": "node_b", "deploy": "node_a"}  # finetune: either worker


def _ray_start(name: str, root: Path, env: dict, extra: list[str]) -> subprocess.Popen:
    temp = Path(tempfile.mkdtemp(prefix=f"/tmp/mfc{name[-1]}"))  # short: Ray's socket paths
    ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    cmd = [sys.executable, "-m", "tests.raypatient", "start", "--block", "--disable-usage-stats",
           "--temp-dir", str(temp),
           "--node-ip-address", "127.0.0.1", *extra]
    for flag in ports:
        cmd += [flag, str(free_port())]
    log_path = root / f"{name}-{time.time_ns()}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def _started(proc: subprocess.Popen, timeout: float = 240) -> bool:
    """`ray start --block` said the node is up (True) or exited (False: Ray's fixed 30 s
    start-up limit, which a loaded host misses; the caller starts it again)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if "Ray runtime started" in proc.log_path.read_text(errors="replace"):  # type: ignore[attr-defined]
            return True
        if proc.poll() is not None:
            break
        time.sleep(1)
    try:  # what the failed start left (a GCS, a raylet) goes with its process group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return False


def _kill(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    with s3_server(str(root / "moto.log")) as s3env:
        base = dict(os.environ, **s3env, **PATIENT_ENV, RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO))
        base.pop("RAY_ADDRESS", None)
        port = free_port()
        nodes, scratch = {}, {}  # scratch: node name -> its scratch dirs (a replacement gets a new one)
        specs = {"head": ["--head", "--port", str(port), "--include-dashboard", "false",
                          "--ray-client-server-port", str(free_port()), "--num-cpus", "1",
                          "--resources", json.dumps({"head": 100})],
                 "node_a": ["--address", f"127.0.0.1:{port}", "--num-cpus", "2",
                            "--resources", json.dumps({"node_a": 100, "worker": 100})],
                 "node_b": ["--address", f"127.0.0.1:{port}", "--num-cpus", "2",
                            "--resources", json.dumps({"node_b": 100, "worker": 100})]}

        def start(name: str) -> None:
            scratch.setdefault(name, []).append(root / f"scratch-{name}-{len(scratch.get(name, []))}")
            for _ in range(6):
                nodes[name] = _ray_start(name, root, dict(base, MOEFLOW_SCRATCH=str(scratch[name][-1])),
                                         specs[name])
                if _started(nodes[name]):
                    return
            raise AssertionError(f"ray start of {name} failed 6 times (logs in {root})")

        try:
            for name in specs:
                start(name)
            _wait_for_nodes(f"127.0.0.1:{port}", base, 3)
            yield {"address": f"127.0.0.1:{port}", "env": base, "nodes": nodes, "scratch": scratch,
                   "root": root, "start": start}
        finally:
            for proc in reversed(list(nodes.values())):
                _kill(proc)


def _wait_for_nodes(address: str, env: dict, count: int, timeout: float = 300) -> None:
    probe = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))" % address)
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        if out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(3)
    raise AssertionError(f"{count} Ray nodes did not come up")


def _upload_demo_assets(root: Path) -> dict[str, str]:
    from workflows.demo import build_assets

    assets = build_assets(root / "assets")
    uris = {"model": f"s3://{BUCKET}/assets/model"}
    S.publish(assets["model"], uris["model"])
    S.publish(assets["train"].parent, f"s3://{BUCKET}/assets/data")
    for key in ("train", "eval", "train_reverse", "eval_reverse"):
        uris[key] = f"s3://{BUCKET}/assets/data/{assets[key].name}"
    return uris


def _finetune_checkpointed(prefix: str) -> bool:
    fs, _ = S.filesystem(f"s3://{BUCKET}")
    for snap in fs.glob(f"{BUCKET}/{prefix}/*/finetune-*/ray/*/checkpoint_manager_snapshot.json"):
        try:
            if json.loads(fs.cat_file(snap)).get("latest_checkpoint_result"):
                return True
        except (OSError, ValueError):
            continue
    return False


def _finetune_node(scratch: dict) -> str | None:
    for name in ("node_a", "node_b"):
        if list((scratch[name][-1] / "stages").glob("*/finetune-*")):
            return name
    return None


def _entries(scratch: Path) -> list[dict]:
    found = []
    for origin in (scratch / "cache").glob("*/.origin"):
        found.append(json.loads(origin.read_text()))
    return found


def test_demo_across_nodes_through_the_store_survives_a_lost_node(cluster, monkeypatch):
    for key, value in cluster["env"].items():
        if key.startswith(("AWS_", "MLFLOW_S3")):
            monkeypatch.setenv(key, value)
    root, scratch = cluster["root"], cluster["scratch"]
    assets = _upload_demo_assets(root)
    prefix = "cluster-run"
    sets = [f"workdir=s3://{BUCKET}/{prefix}", f"model.path={assets['model']}",
            f"data.train_file={assets['train']}", f"data.eval_file={assets['eval']}",
            f"finetune.adapters.reverse.train_file={assets['train_reverse']}",
            f"finetune.adapters.reverse.eval_file={assets['eval_reverse']}",
            f"tracking.uri=sqlite:///{root}/mlflow.db", "finetune.max_steps=60",
            "finetune.checkpoint_every=10",  # the tenant keeps its 200 steps: fewer fail the gate
            "stages.resources.finetune.resources={worker: 1}", "stages.resources.finetune.max_retries=1",
            "deploy.port=0"]
    sets += [f"stages.resources.{stage}.resources={{{node}: 1}}" for stage, node in PLACE.items()]
    cmd = [str(BIN / "moeflow"), "run", str(REPO / "configs/demo.yaml")]
    for item in sets:
        cmd += ["--set", item]
    env = dict(cluster["env"], RAY_ADDRESS=cluster["address"], MOEFLOW_SCRATCH=str(root / "driver"))
    log = root / "driver.log"
    with open(log, "wb") as out:
        driver = subprocess.Popen(cmd, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        killed = None
        try:
            deadline = time.time() + 3000
            while driver.poll() is None and time.time() < deadline:
                if killed is None and _finetune_checkpointed(prefix):
                    killed = _finetune_node(scratch)
                    if killed:  # the node and its disk are gone; a replacement joins (an autoscaler's)
                        _kill(cluster["nodes"][killed], signal.SIGKILL)
                        lost = scratch[killed][-1]
                        cluster["start"](killed)
                time.sleep(2)
        finally:
            if driver.poll() is None:
                _kill(driver)
    text = log.read_text(errors="replace")
    assert driver.returncode == 0, text[-4000:]
    assert killed, "finetune never had a checkpoint in the store before it finished"
    assert "resuming from checkpoint at step" in text, text[-4000:]
    # convert read the release by ranges into its node's sparse copy, never a whole download
    assert "convert: read " in text and f"by ranges from {assets['model']}" in text, text[-4000:]
    _audit(scratch, prefix, lost)


def _audit(scratch: dict, prefix: str, lost: Path) -> None:
    """Every output was published from its stage's node; everything a stage read from
    another node came from the store (a fetched cache entry); no record names a local path."""
    published = {}  # stage -> node it published from
    fetched = {(name, str(d)): set() for name, dirs in scratch.items() for d in dirs}
    for node, dirs in scratch.items():
        for d in dirs:
            for entry in _entries(d):
                stage = entry["uri"].rstrip("/").rsplit("/", 1)[-1].split("-")[0]
                if entry["how"] == "published" and f"/{prefix}/" in entry["uri"]:
                    published[stage] = (node, str(d))
                elif entry["how"] == "fetched":
                    fetched[(node, str(d))].add(stage)
    assert {s: n for s, (n, _) in published.items() if s != "finetune"} == PLACE, published
    assert published["finetune"][1] != str(lost), "finetune published from the killed node"
    expected = dict(published)
    edges = {"plan": ["convert"], "operators": ["convert"], "calibrate": ["convert"],
             "finetune": ["convert", "plan"], "regress": ["convert", "finetune"],
             "serving": ["convert", "finetune"], "deploy": ["convert", "finetune"]}
    for stage, ups in edges.items():
        where = expected[stage]
        for up in ups:
            if expected[up] != where:  # another node's output: it came through the store
                assert up in fetched[where], (stage, up, where, fetched[where])
    fs, _ = S.filesystem(f"s3://{BUCKET}")
    roots = [str(d) for dirs in scratch.values() for d in dirs]
    for record in fs.glob(f"{BUCKET}/{prefix}/*/*/result.json"):
        text = fs.cat_file(record).decode()
        assert not any(r in text for r in roots), (record, text[:2000])
