"""`moeflow rebalance`: the live load summed over replicas and a window; a re-placement
better balanced than the served one and the operators stage's; a rolling update with no
failed request and identical greedy outputs (slow); a real Prometheus scraping the demo
deployment fires the skew alert under skewed traffic and clears it after the rebalance (slow)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from moeflow.core.errors import UserError
from moeflow.ops.rebalance import plan
from moeflow.serving import loadbook
from tests.conftest import BIN, REPO, cli_env, free_port
from tests.raypatient import PATIENT_ENV, _SlowClock


def test_plan_scores_served_operators_and_replaced():
    counts = np.array([[10, 10, 10, 10, 10, 10, 10, 10],  # even
                       [5, 90, 3, 80, 9, 10, 8, 1]])  # experts 1 and 3 hot, on rank 0
    served = [list(range(8))] * 2
    operators = [list(range(8)), [1, 0, 2, 4, 3, 5, 6, 7]]  # placed for other traffic: 1 and 4 apart only
    got = plan(counts, 2, 1, 2, 1, served, operators)
    bal = got["balancedness"]
    assert got["hottest_layer"] == 1
    assert bal["served"][0] == bal["replaced"][0] == 1.0  # an even layer keeps its order
    assert got["perms"][0] == list(range(8))
    assert bal["served"][1] == pytest.approx(103 / 178, abs=1e-5)  # mean 103 / rank 0 with 178
    assert bal["replaced"][1] > bal["operators"][1] and bal["replaced"][1] > 0.95
    hot = got["perms"][1]
    assert (hot.index(1) < 4) != (hot.index(3) < 4)  # the two hot experts on different ranks
    assert got["changed"] and got["phy2log"].shape == (2, 10)


def test_plan_refuses_an_idle_window():
    with pytest.raises(UserError, match="no routed tokens"):
        plan(np.zeros((2, 8)), 2, 1, 0, 1, [list(range(8))] * 2, None)


def test_load_book_sums_replicas_over_the_window(monkeypatch):
    book = loadbook.ExpertLoadBook()
    now = [1000.0]
    monkeypatch.setattr(loadbook.time, "time", lambda: now[0])
    book.report("r1", [[10, 0]], {"m": 1}, {"s": 1})  # t=1000: before the window
    now[0] = 1050
    book.report("r1", [[30, 5]], {"m": 1}, {"s": 1})
    book.report("r2", [[1, 1]], {"m": 1}, {"s": 1})  # started inside the window: counts from 0
    now[0] = 1060
    book.report("r2", [[4, 6]], {"m": 1}, {"s": 1})
    got = book.window(30)  # [1030, 1060]: r1 30-10, 5-0; r2 4, 6
    assert got["counts"] == [[24, 11]] and sorted(got["replicas"]) == ["r1", "r2"]
    assert book.window(5)["counts"] == [[3, 5]]  # only r2's last report is inside, over its previous


def test_rebalance_without_a_cluster_is_one_line(tmp_path):
    proc = subprocess.run([str(BIN / "moeflow"), "rebalance", "--run", "abc"], capture_output=True, text=True,
                          env=cli_env(tmp_path), timeout=120)
    assert proc.returncode == 2 and "--address" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- live (slow)


@pytest.fixture(scope="module", autouse=True)
def patient_serve():
    """Serve kills a proxy not ready within 5 s and Ray a node not up within 30 s, which a
    loaded 2-core host exceeds; the module's Ray (started after this) gets longer limits."""
    import ray._private.node as node

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    mp.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    # Ray's fixed node start-up limits, lengthened as tests/raypatient.py does (undone after)
    mp.setattr(node, "time", _SlowClock(6.0))
    for key, value in PATIENT_ENV.items():
        mp.setenv(key, value)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def demo_run(ray_local, tmp_path_factory):
    from tests.rebalance_assets import demo_operators_run

    return demo_operators_run(tmp_path_factory.mktemp("demo"))


def _deploy(record: dict) -> str:
    from moeflow.serving.app import ServeSettings, start

    settings = ServeSettings(base_dir=record["convert_dir"], served_model_name="demo", ep_size=record["ep_size"],
                             engine={"max_num_seqs": 16}, stream_interval=8)
    return start(settings, port=free_port(), num_cpus=0.5)


def _show(report: dict) -> str:
    bal, hot = report["balancedness"], report["hottest_layer"]
    return (f"hottest layer {hot}: served {bal['served'][hot]:.3f}, operators stage {bal['operators'][hot]:.3f}, "
            f"re-placed {bal['replaced'][hot]:.3f} (all layers: {json.dumps(bal)})")


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the operators run, two replicas starting and a rollout on 2 cores
def test_rebalance_rolls_out_under_16_clients(demo_run, tmp_path):
    import ray
    from ray import serve

    from moeflow.ops.rebalance import rebalance
    from tests.rebalance_assets import Clients

    uri, run_id, record = demo_run
    url = _deploy(record)
    clients = Clients(url, "demo", n=16).start()
    try:
        time.sleep(25)  # skewed load accumulates in the replicas' reports
        report = rebalance(run_id, tracking_uri=uri, out=tmp_path / "rb", window_s=60)
        time.sleep(5)
    finally:
        clients.stop()
    live = ray.get(loadbook.find_load_book("moeflow").window.remote(5))
    serve.shutdown()
    print(f"rebalance: {_show(report)}; rollout {report.get('rollout')}; "
          f"clients: {clients.ok} ok, {clients.failed} failed, {clients.mismatched} mismatched, "
          f"{clients.dropped} dropped connections sent again")
    assert clients.failed == 0 and clients.mismatched == 0, clients.errors[:5]
    assert clients.ok >= 32
    hot, bal = report["hottest_layer"], report["balancedness"]
    assert bal["replaced"][hot] > bal["operators"][hot] and bal["replaced"][hot] > bal["served"][hot]
    assert report["applied"] and report["rollout"]["surge"]
    assert live["settings"]["base_dir"] == report["model_path"] and live["meta"]["perms"] == report["perms"]
    files = report["files"]
    assert json.loads(Path(files["sglang"]).read_text())["physical_to_logical_map"]
    assert "--enable-eplb" in json.loads(Path(files["vllm"]).read_text())["args"]


def _prometheus(tmp: Path, target: str) -> tuple[subprocess.Popen, str]:
    import shutil

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found: install it (apt-get install prometheus)")
    port = free_port()
    conf = {"global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
            "rule_files": [str(REPO / "cluster" / "monitoring" / "rules.yml")],
            "scrape_configs": [{"job_name": "moeflow", "static_configs": [{"targets": [target]}]}]}
    (tmp / "prometheus.yml").write_text(json.dumps(conf))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # it listens a few seconds after it starts: wait for it before any query
        try:
            if httpx.get(f"{api}/-/ready", timeout=2).status_code == 200:
                return proc, api
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-800:]}")
        time.sleep(0.5)


def _skew_alerts(api: str) -> list[dict]:
    alerts = httpx.get(f"{api}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "MoeflowExpertLoadSkew"]


def _wait(what: str, check, timeout: float) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(2)
    return time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the operators run, the alert's 1 min rate + 1 min `for`, a rollout
def test_skew_alert_fires_live_and_clears_after_rebalance(demo_run, tmp_path):
    from ray import serve

    from moeflow.ops.rebalance import rebalance
    from tests.rebalance_assets import Clients
    from tests.test_monitoring import _as_promql, dashboard_queries

    uri, run_id, record = demo_run
    url = _deploy(record)
    prom, api = _prometheus(tmp_path, url.removeprefix("http://"))
    clients = Clients(url, "demo", n=8).start()
    try:
        fired = _wait("skew alert firing", lambda: any(a["state"] == "firing" for a in _skew_alerts(api)), 420)
        layers = sorted(a["labels"]["layer"] for a in _skew_alerts(api) if a["state"] == "firing")
        # every dashboard query runs on the live data without error (and most return series)
        empty = []
        for q in dashboard_queries():
            r = httpx.get(f"{api}/api/v1/query", params={"query": _as_promql(q)}, timeout=10).json()
            assert r["status"] == "success", (q, r)
            if not r["data"]["result"]:
                empty.append(q)
        report = rebalance(run_id, tracking_uri=uri, out=tmp_path / "rb", window_s=60)
        cleared = _wait("skew alert cleared", lambda: not _skew_alerts(api), 420)
        skew = httpx.get(f"{api}/api/v1/query", params={"query": "moeflow:expert_rank_skew:1m"},
                         timeout=10).json()["data"]["result"]
    finally:
        clients.stop()
        prom.terminate()
        prom.wait(timeout=30)
        serve.shutdown()
    print(f"skew alert fired after {fired:.0f} s of skewed traffic on layer(s) {layers}; {_show(report)}; "
          f"cleared {cleared:.0f} s after the rebalance returned; skew now "
          f"{[(s['metric']['layer'], round(float(s['value'][1]), 3)) for s in skew]}; "
          f"clients {clients.ok} ok {clients.failed} failed {clients.dropped} dropped and sent again; "
              f"dashboard queries without data: {empty}")
    assert clients.failed == 0, clients.errors[:5]
    assert report["applied"]
    assert skew and all(float(s["value"][1]) < 1.3 for s in skew), skew  # the rule has series
