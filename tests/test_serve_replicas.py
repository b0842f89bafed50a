"""Several Serve replicas: each `/metrics` is per replica; Ray's Prometheus export
carries every replica's moeflow series (tagged per replica), so the sum over
replicas equals the deployment's traffic. A runtime adapter load/unload reaches
every replica (the deployment's AdapterBook)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import re
import shutil
import tempfile
import time

import httpx
import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port, start
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model

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
    root = tmp_path_factory.mktemp("rep")
    base = build_debug_model("qwen3_moe", root / "tiny-moe")
    make_lora_adapter(base, root / "adapters" / "late", seed=5)
    url = start(ServeSettings(base_dir=str(base), expert_window_steps=2, adapter_root=str(root / "adapters")),
                port=free_port(), num_replicas=2, num_cpus=0.5)
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
    # tokens per expert, pushed each window: every replica, both MoE layers, labelled as /metrics
    experts = [line for line in text.splitlines() if line.startswith("ray_moeflow_expert_tokens_total{")]
    assert {re.search(r'replica="([^"]+)"', e).group(1) for e in experts} == set(tokens)
    assert {re.search(r'layer="([^"]+)"', e).group(1) for e in experts} == {"0", "1"}
    assert all(re.search(r'ep_rank="\d+"', e) and re.search(r'expert="\d+"', e) for e in experts)
    assert sum(float(e.rsplit(" ", 1)[1]) for e in experts) > 0


def _replicas_of(text: str, model: str) -> set[str]:
    return {re.search(r'replica="([^"]+)"', line).group(1) for line in text.splitlines()
            if line.startswith("ray_moeflow_request_success_total{") and f'model_name="{model}"' in line}


def test_runtime_adapter_reaches_every_replica(two_replicas):
    url = two_replicas["url"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late"}, timeout=60)
    assert r.status_code == 200, r.text

    def one(_):
        return httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "late", "prompt": "hi", "max_tokens": 2, "temperature": 0}).status_code

    with cf.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(24))) == [200] * 24  # whichever replica answers
    deadline, served = time.time() + 90, set()
    while time.time() < deadline and len(served) < 2:
        served = _replicas_of(httpx.get(two_replicas["metrics"], timeout=10).text, "late")
        time.sleep(1)
    assert len(served) == 2, f"adapter served by {served}"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(1.5)  # the other replica drops it on its next sync (at most 1 s apart)
    with cf.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [404] * 16


class _Remote:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    async def remote(self, *args):
        self.calls += 1
        await asyncio.sleep(0.05 * self.calls)  # actor calls answering one after another
        return self.fn(*args)


class _LocalBook:
    """The AdapterBook's methods as awaitable `.remote` calls, in-process."""

    def __init__(self, book):
        self.snapshot, self.put, self.remove = (_Remote(book.snapshot), _Remote(book.put),
                                                 _Remote(book.remove))


@pytest.fixture
def booked_service(tmp_path):
    """A Service with one adapter on disk (`late`) and an in-process AdapterBook."""
    from moeflow.serving.adapter_sync import AdapterBook
    from moeflow.serving.app import Service

    base = build_debug_model("qwen3_moe", tmp_path / "tiny-moe")
    make_lora_adapter(base, tmp_path / "adapters" / "late", seed=5)
    service = Service(ServeSettings(base_dir=str(base), adapter_root=str(tmp_path / "adapters")))
    book = AdapterBook()
    service.book = _LocalBook(book)
    try:
        yield service, book
    finally:
        service.close()


def _resolve_many(service, name: str, n: int = 8) -> list:
    async def many():
        return await asyncio.gather(*[service.resolve(name) for _ in range(n)], return_exceptions=True)

    return asyncio.run(many())


def test_concurrent_requests_for_a_new_adapter_all_find_it(booked_service):
    """Eight requests for an adapter another replica just loaded: the first sync registers it and
    the seven racing it (same book version, already applied when they look) must not answer 404."""
    service, book = booked_service
    book.put("late", "late")  # what the replica that took the load request wrote
    service._book_seen = (0, time.monotonic())  # this replica synced just before the load
    assert _resolve_many(service, "late") == [("late", "late")] * 8


def test_past_half_the_sync_interval_a_request_reads_the_book_in_the_background(booked_service):
    """A copy of the book between SYNC_S/2 and SYNC_S old: the request does not wait for the
    book's actor (steady traffic never pays for it), and the read it started applies the book."""
    from moeflow.serving.adapter_sync import SYNC_S

    service, book = booked_service
    asyncio.run(service.sync(force=True))
    book.put("late", "late")  # another replica's runtime load

    async def one():
        service._book_seen = (service._book_seen[0], time.monotonic() - 0.6 * SYNC_S)
        calls = service.book.snapshot.calls
        t0 = time.monotonic()
        got = await service.resolve(service.base_name)
        waited = time.monotonic() - t0
        assert service.book.snapshot.calls == calls  # not read before the request went on
        assert "late" not in service.registry.names()  # nor applied yet
        await service._refresh  # the read it started
        return got, waited, service.book.snapshot.calls - calls

    (served, _), waited, reads = asyncio.run(one())
    assert served == service.base_name and reads == 1 and waited < 0.05
    assert service.resolve_model("late") == ("late", "late")


def test_requests_racing_a_stale_sync_see_an_unloaded_adapter_gone(booked_service):
    """Another replica unloaded an adapter: requests arriving while this replica's routine sync
    is under way wait for it (one that skipped would still find the adapter here and answer 200)."""
    from moeflow.serving.adapter_sync import SYNC_S
    from moeflow.serving.errors import ModelNotFound

    service, book = booked_service
    book.put("late", "late")
    asyncio.run(service.sync(force=True))
    assert service.resolve_model("late") == ("late", "late")
    book.remove("late")  # what the replica that took the unload request wrote
    service._book_seen = (service._book_seen[0], time.monotonic() - 2 * SYNC_S)  # stale
    got = _resolve_many(service, "late")
    assert all(isinstance(g, ModelNotFound) for g in got), got
