"""Soak benchmark: minutes of mixed traffic against one Ray Serve replica of the demo model.

    nice .venv/bin/python benchmarks/bench_soak.py                 # 10 minutes
    nice .venv/bin/python benchmarks/bench_soak.py --minutes 2 --clients 8

Traffic (each client loops until the time is up): completions on the base and two adapters,
chat, streams (one in five dropped by the client after two chunks), hostile requests from the
serving issue (empty stop string, top_p 1e-46, temperature 1e-40, a lone surrogate, a NaN
adapter load: each must get a 4xx or a correct answer), and a runtime adapter loaded and
unloaded every 20 s.

Pass criteria, printed and checked:
- zero 5xx (and zero connection errors);
- replica RSS growth <= 10% from the end of warm-up (the first 10% of the run, at least 30 s)
  to the end;
- replica CPU < 5% when idle afterwards, and the running gauge back to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

HOSTILE = [({"stop": [""]}, {400}), ({"top_p": 1e-46, "temperature": 1}, {200}),
           ({"temperature": 1e-40}, {200}), ({"seed": 2 ** 64}, {400})]


def _deploy(work: Path, port: int, ingress: str, stream_interval: int) -> tuple[str, psutil.Process]:
    import ray
    import torch

    from moeflow.serving.app import ServeSettings, start
    from moeflow.serving.fixtures import make_lora_adapter, poison_adapter
    from moeflow.serving.ingress import ingress_environment
    from moeflow.tiny import build_debug_model

    torch.set_num_threads(1)
    base = build_debug_model("qwen3_moe", work / "demo")
    for i, name in enumerate(("a1", "a2", "rt")):
        make_lora_adapter(base, work / "adapters" / name, seed=i + 1)
    poison_adapter(work / "adapters" / "a1", work / "adapters" / "nan")
    temp = tempfile.mkdtemp(prefix="/tmp/mfr")
    with ingress_environment(ingress, temp):  # Ray's processes read it when they start
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp)
    url = start(ServeSettings(base_dir=str(base), adapter_root=str(work / "adapters"), stream_interval=stream_interval,
                              adapters={"a1": str(work / "adapters" / "a1"), "a2": str(work / "adapters" / "a2")}),
                port=port)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    # the replica's worker process, among the Ray processes this script started
    (replica,) = [p for p in psutil.Process().children(recursive=True)
                  if "ServeReplica:moeflow" in " ".join(p.cmdline())]
    return url, replica


class Soak:
    def __init__(self, url: str, until: float, seed: int):
        self.url, self.until, self.rng = url, until, random.Random(seed)
        self.codes: Counter = Counter()
        self.kinds: Counter = Counter()
        self.errors: list[str] = []

    def _note(self, kind: str, code, expected: set[int] | None = None) -> None:
        self.kinds[kind] += 1
        self.codes[code] += 1
        if isinstance(code, str) or code >= 500 or (expected and code not in expected):
            if len(self.errors) < 20:
                self.errors.append(f"{kind}: {code}")

    async def client(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.until:
            roll = self.rng.random()
            try:
                if roll < 0.25:
                    await self._complete(http, "demo")
                elif roll < 0.5:
                    await self._complete(http, self.rng.choice(["a1", "a2", "demo:a2"]))
                elif roll < 0.6:
                    r = await http.post("/v1/chat/completions", json={
                        "model": "a1", "messages": [{"role": "user", "content": "reverse: kqzm"}], "max_tokens": 8})
                    self._note("chat", r.status_code, {200})
                elif roll < 0.9:
                    await self._stream(http, drop=self.rng.random() < 0.2)
                else:
                    await self._hostile(http)
            except httpx.HTTPError as exc:
                self._note("transport", type(exc).__name__)

    async def _complete(self, http, model: str) -> None:
        r = await http.post("/v1/completions", json={"model": model, "prompt": f"count {self.rng.randint(0, 999)}",
                                                     "max_tokens": self.rng.randint(1, 24), "temperature": 0.7,
                                                     "seed": self.rng.randint(0, 2 ** 32)})
        self._note("completion", r.status_code, {200})

    async def _stream(self, http, drop: bool) -> None:
        body = {"model": self.rng.choice(["demo", "a2"]), "prompt": "stream please", "stream": True,
                "max_tokens": 48, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if drop and n >= 2:
                    break  # the client goes away mid-stream: the server must free the slot
            self._note("stream-dropped" if drop else "stream", r.status_code, {200})

    async def _hostile(self, http) -> None:
        if self.rng.random() < 0.2:
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "nan", "lora_path": "nan"})
            self._note("hostile", r.status_code, {400})
            return
        extra, expected = self.rng.choice(HOSTILE)
        body = {"model": "demo", "prompt": ["hello"] * self.rng.randint(1, 4), "max_tokens": 4} | extra
        r = await http.post("/v1/completions", json=body)
        self._note("hostile", r.status_code, expected)
        r = await http.post("/v1/completions", content=b'{"model": "demo", "prompt": "\\ud800"}',
                            headers={"content-type": "application/json"})
        self._note("hostile", r.status_code, {400})

    async def adapters(self, http: httpx.AsyncClient) -> None:
        """Load, use and unload a runtime adapter every 20 s (409 while busy is fine)."""
        while time.monotonic() < self.until - 20:
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": "rt"})
            self._note("adapter-load", r.status_code, {200})
            await self._complete(http, "rt")
            await asyncio.sleep(10)
            for _ in range(10):
                r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "rt"})
                if r.status_code != 409:
                    break
                await asyncio.sleep(0.5)
            self._note("adapter-unload", r.status_code, {200})
            await asyncio.sleep(10)


async def _traffic(url: str, minutes: float, clients: int, proc: psutil.Process) -> tuple[Soak, list]:
    start = time.monotonic()
    soak = Soak(url, start + minutes * 60, seed=0)
    rss: list[tuple[float, float]] = []

    async def sample():
        while time.monotonic() < soak.until:
            rss.append((time.monotonic() - start, proc.memory_info().rss / 2 ** 20))
            await asyncio.sleep(5)
        rss.append((time.monotonic() - start, proc.memory_info().rss / 2 ** 20))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients + 4)) as http:
        await asyncio.gather(sample(), soak.adapters(http), *[soak.client(http) for _ in range(clients)])
    return soak, rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--ingress", choices=["auto", "proxy", "haproxy"], default="auto", help="deploy.ingress")
    p.add_argument("--stream-interval", type=int, default=8, help="deploy.stream_interval")
    args = p.parse_args()
    if args.stream_interval < 1:
        p.error("--stream-interval: at least 1")
    import ray
    from ray import serve

    from moeflow.serving.app import free_port

    work = Path(tempfile.mkdtemp(prefix="moeflow-soak-"))
    try:
        url, proc = _deploy(work, args.port or free_port(), args.ingress, args.stream_interval)
        soak, rss = asyncio.run(_traffic(url, args.minutes, args.clients, proc))
        time.sleep(3)
        idle_cpu = proc.cpu_percent(interval=5.0)
        running = re.findall(r"moeflow_num_requests_running\{[^}]*\} (\S+)", httpx.get(f"{url}/metrics").text)
        report = _report(args, soak, rss, idle_cpu, running)
        print(json.dumps(report, indent=1))
        sys.exit(0 if report["pass"] else 1)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def _report(args, soak: Soak, rss: list, idle_cpu: float, running: list[str]) -> dict:
    warm = max(30.0, args.minutes * 6)  # the first 10% of the run (at least 30 s)
    after = [m for t, m in rss if t >= warm] or [rss[-1][1]]
    growth = (after[-1] - after[0]) / after[0]
    fivexx = sum(n for c, n in soak.codes.items() if isinstance(c, str) or c >= 500)
    checks = {"zero_5xx_or_transport_errors": fivexx == 0, "unexpected_statuses": not soak.errors,
              "rss_growth_le_10pct": growth <= 0.10, "idle_cpu_lt_5pct": idle_cpu < 5.0,
              "running_gauge_zero": all(float(v) == 0 for v in running)}
    return {"minutes": args.minutes, "clients": args.clients, "requests": sum(soak.kinds.values()),
            "requests_per_s": round(sum(soak.kinds.values()) / (args.minutes * 60), 1),
            "by_kind": dict(soak.kinds), "statuses": {str(k): v for k, v in soak.codes.items()},
            "unexpected": soak.errors, "rss_mb_after_warmup": round(after[0], 1), "rss_mb_end": round(after[-1], 1),
            "rss_growth_pct": round(100 * growth, 2), "idle_cpu_pct": idle_cpu, "running_gauge": running,
            "checks": checks, "pass": all(checks.values())}


if __name__ == "__main__":
    main()
