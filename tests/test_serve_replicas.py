"""Several Serve replicas: each `/metrics` is per replica; Ray's Prometheus export
carries every replica's moeflow series (tagged per replica), so the sum over
replicas equals the deployment's traffic."""

from __future__ import annotations

import concurrent.futures as cf
import re
import shutil
import tempfile
import time

import httpx
import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port, start
from moeflow.tiny import build_debug_model

pytestmark = pytest.mark.integration
NEW = 5


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    import ray
    from ray import serve

    torch.set_num_threads(1)
    temp = tempfile.mkdtemp(prefix="/tmp/mfr")
    metrics_port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 500})
    base = build_debug_model("qwen3_moe", tmp_path_factory.mktemp("rep") / "tiny-moe")
    url = start(ServeSettings(base_dir=str(base), expert_window_steps=2), port=free_port(), num_replicas=2,
                num_cpus=0.5)
    yield {"url": url, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _series(text: str, name: str) -> dict[str, float]:
    """{replica tag: value} of a Ray-exported series for model tiny-moe."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'model_name="tiny-moe"' in line:
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_ray_export_sums_every_replica(two_replicas):
    url = two_replicas["url"]
    n = 24

    def one(i):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny-moe", "prompt": f"request {i}", "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with cf.ThreadPoolExecutor(12) as pool:
        assert sum(pool.map(one, range(n))) == n * NEW
    # each scrape of /metrics reaches one replica: it never shows more than the total
    local = httpx.get(f"{url}/metrics", timeout=30).text
    value = float(re.search(r'moeflow_generation_tokens_total\{model_name="tiny-moe"\} (\S+)', local).group(1))
    assert 0 < value <= n * NEW
    deadline, tokens = time.time() + 90, {}
    while time.time() < deadline:
        text = httpx.get(two_replicas["metrics"], timeout=10).text
        tokens = _series(text, "ray_moeflow_generation_tokens_total")
        if sum(tokens.values()) == n * NEW and len(tokens) == 2:
            break
        time.sleep(1)
    assert sum(tokens.values()) == n * NEW, tokens
    assert len(tokens) == 2, f"traffic reached {len(tokens)} replica(s): {tokens}"
    assert sum(_series(text, "ray_moeflow_request_success_total").values()) == n
    # expert balancedness per replica and MoE layer (windows of 2 engine steps)
    balance = [line for line in text.splitlines() if line.startswith("ray_moeflow_expert_balancedness{")]
    assert {re.search(r'replica="([^"]+)"', b).group(1) for b in balance} == set(tokens)
    assert {re.search(r'layer="([^"]+)"', b).group(1) for b in balance} == {"0", "1"}
    assert all(0 < float(b.rsplit(" ", 1)[1]) <= 1 for b in balance)
