"""A Serve replica killed under load: in-flight requests get a clean error promptly (never a
hang), Serve starts a new replica, new requests succeed within 30 s, and the new replica
serves the adapters loaded at run time before it started (the deployment's AdapterBook); with
the engine core in its own process too (deploy.engine_process)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port, start
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _replica_handles():
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::moeflow#MoeflowServer")]



def _serving_again(url: str, model: str, since: float, limit_s: float) -> float | None:
    """When (time.monotonic) a completion of `model` first succeeds after `since`; None
    when none does within `limit_s`."""
    while time.monotonic() - since < limit_s:
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=10,
                           json={"model": model, "prompt": "hi", "max_tokens": 2})
            if r.status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return None

@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_killed_replica_is_replaced_and_in_flight_requests_fail_cleanly(ray_local, tmp_path, engine_process):
    import ray
    from ray import serve

    torch.set_num_threads(1)
    base = build_debug_model("qwen3_moe", tmp_path / "tiny-moe")
    make_lora_adapter(base, tmp_path / "adapters" / "rt", seed=3)
    url = start(ServeSettings(base_dir=str(base), adapter_root=str(tmp_path / "adapters"),
                              engine_process=engine_process), port=free_port())
    try:
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": "rt"},
                          timeout=60).status_code == 200

        with cf.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_long_request, url) for _ in range(6)]
            _wait_running(url, 6)  # the kill lands while all six decode (each takes ~1.5 s here)
            (victim,) = _replica_handles()
            cores = _cores(ray_local)
            assert len(cores) == (1 if engine_process else 0), cores
            killed_at = time.monotonic()
            ray.kill(victim, no_restart=True)
            results = [f.result(timeout=120) for f in futures]
        while any(p in _cores(ray_local) for p in cores) and time.monotonic() - killed_at < 10:
            time.sleep(0.2)
        assert not any(p in _cores(ray_local) for p in cores), "the killed replica's core lives on"
        assert all(isinstance(code, str) or code >= 500 or code == 200 for code, _ in results), results
        assert any(code != 200 for code, _ in results), results  # the kill hit requests in flight
        assert all(took < 60 for _, took in results), results  # an answer, not a hang
        ok_at = _serving_again(url, "rt", killed_at, 60)
        print(f"replica kill: in-flight (status, seconds) {results}; "
              f"new replica serving after {None if ok_at is None else round(ok_at - killed_at, 1)} s")
        assert ok_at is not None and ok_at - killed_at < 30, "no new replica serving within 30 s"
    finally:
        serve.shutdown()


def _long_request(url: str) -> tuple:
    """A 400-token completion: (status or the transport error's name, seconds)."""
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=90, json={
            "model": "tiny-moe", "prompt": "go", "max_tokens": 400, "ignore_eos": True})
        return r.status_code, time.monotonic() - t0
    except httpx.HTTPError as exc:  # the connection dropped: also a clean, prompt failure
        return type(exc).__name__, time.monotonic() - t0


def _wait_running(url: str, n: int, limit_s: float = 30.0) -> None:
    """Until the replica's running gauge shows `n` requests decoding."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        running = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("moeflow_num_requests_running{"))
        if running >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never ran together within {limit_s} s")


def _cores(ray_temp: str) -> list[int]:
    """Engine core processes of this module's Ray (their output goes to its session's logs)."""
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read()
            out = os.readlink(f"/proc/{pid}/fd/2")
        except OSError:
            continue
        if "moeflow.serving.core" in cmd and out.startswith(ray_temp):
            pids.append(int(pid))
    return pids


def test_a_killed_engine_core_fails_its_requests_and_serve_replaces_the_replica(ray_local, tmp_path):
    """deploy.engine_process: SIGKILL of a replica's engine core (not the replica): its in-flight
    requests get a 503 at once, the health check fails, Serve starts a new replica (and core),
    and after the app is deleted no core is left."""
    import os
    import signal

    from ray import serve

    torch.set_num_threads(1)
    base = build_debug_model("qwen3_moe", tmp_path / "tiny-moe")
    url = start(ServeSettings(base_dir=str(base), engine_process=True), port=free_port())
    try:
        (core,) = _cores(ray_local)

        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_long_request, url) for _ in range(4)]
            time.sleep(0.4)  # they take ~1.4 s on a quiet host
            killed_at = time.monotonic()
            os.kill(core, signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
        assert any(code == 503 for code, _ in results), results  # the engine stopped serving
        assert all(code in (200, 503) for code, _ in results), results
        assert all(took < 60 for _, took in results), results  # an answer, not a hang
        ok_at = _serving_again(url, "tiny-moe", killed_at, 120)
        print(f"core kill: in-flight {results}; serving again after "
              f"{None if ok_at is None else round(ok_at - killed_at, 1)} s")
        assert ok_at is not None, "no new replica serving within 120 s"
        assert [p for p in _cores(ray_local) if p != core], "the new replica has no core of its own"
    finally:
        serve.shutdown()
    deadline = time.monotonic() + 15
    while _cores(ray_local) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _cores(ray_local), "an engine core outlived its replica"
