"""Soak benchmark: minutes of mixed traffic against one Ray Serve replica of the demo model.

    nice .venv/bin/python benchmarks/bench_soak.py                 # 10 minutes
    nice .venv/bin/python benchmarks/bench_soak.py --minutes 2 --clients 8

Traffic (each client loops until the time is up): completions on the base and two adapters,
chat, streams (one in five dropped by the client after two chunks), hostile requests from the
serving issue (empty stop string, top_p 1e-46, temperature 1e-40, a lone surrogate, a NaN
adapter load: each must get a 4xx or a correct answer), a runtime adapter loaded and
unloaded every 20 s, load/unload races on one adapter (`hot`: two loaders, two unloaders and
requests for it, all at once: 200/400 for loads, 200/404/409 for unloads, 200/404 for its
requests), and vLLM's sampling extras (top_k, min_p, repetition/presence/frequency penalties,
min_tokens, n) mixed into the completions.

The server is `moeflow serve` (its own process group, HAProxy by default), stopped with SIGTERM
at the end: the run then also checks that the command exited, that no process of it is left
(HAProxy, Ray's session) and that nothing listens on its port.

Pass criteria, printed and checked:
- zero 5xx (and zero connection errors);
- replica RSS growth <= 10% from the end of warm-up (the first 10% of the run, at least 30 s)
  to the end;
- replica CPU < 5% when idle afterwards, and the running gauge back to 0;
- after SIGTERM: exit within 60 s, no HAProxy, no Ray session process, the port free.
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
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

EXTRAS = [{"top_k": 5}, {"min_p": 0.1}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.5},
          {"frequency_penalty": -0.5}, {"min_tokens": 3}, {"n": 2}, {"top_k": 20, "min_p": 0.05, "top_p": 0.9},
          {"repetition_penalty": 0.8, "frequency_penalty": 1.0, "n": 3}]
HOSTILE = [({"stop": [""]}, {400}), ({"top_p": 1e-46, "temperature": 1}, {200}),
           ({"temperature": 1e-40}, {200}), ({"seed": 2 ** 64}, {400})]


def _deploy(work: Path, port: int, ingress: str, stream_interval: int) -> dict:
    """`moeflow serve` of the tiny demo model and its adapters, in its own process group."""
    import os
    import subprocess

    import torch
    import yaml

    from moeflow_testing.serving import make_lora_adapter, poison_adapter
    from moeflow_testing.tiny import build_debug_model

    torch.set_num_threads(1)
    base = build_debug_model("qwen3_moe", work / "demo")
    adapters = work / "adapters"
    for i, name in enumerate(("a1", "a2", "rt", "hot")):
        make_lora_adapter(base, adapters / name, seed=i + 1)
    poison_adapter(adapters / "a1", adapters / "nan")
    config = work / "serve.yaml"
    config.write_text(yaml.safe_dump({"name": "soak", "model": {"path": str(base)}, "deploy": {
        "port": port, "num_replicas": 1, "stream_interval": stream_interval, "served_model_name": "demo",
        "adapters": {"a1": str(adapters / "a1"), "a2": str(adapters / "a2")}}}))
    ray_tmp = tempfile.mkdtemp(prefix="/tmp/mfr")
    hap_tmp = tempfile.mkdtemp(prefix="/tmp/mfh-")  # this server's HAProxy dir, not another's on the host
    env = dict(os.environ, PYTHONPATH=str(REPO), MOEFLOW_RAY_TEMP_DIR=ray_tmp, MOEFLOW_HAPROXY_DIR=hap_tmp)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "workflows.cli", "serve", str(config), "--ingress", ingress,
                             "--adapter-root", str(adapters)], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "serving in the foreground" in line:
            break
    else:
        raise SystemExit("moeflow serve did not start:\n" + "".join(lines[-40:]))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    url = f"http://127.0.0.1:{port}"
    (replica,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if "ServeReplica:moeflow" in " ".join(p.cmdline())]
    return {"url": url, "replica": replica, "proc": proc, "port": port, "ray_tmp": ray_tmp,
            "hap": str(Path(hap_tmp) / "hap")}


def _stop(server: dict) -> dict:
    """SIGTERM `moeflow serve` as systemd or a pod stop would; what is left afterwards."""
    import os
    import signal
    import socket

    from moeflow.serving.ingress import haproxy_pids
    from workflows.reaper import session_pids

    proc = server["proc"]
    haproxies = haproxy_pids(server["hap"]) if server["hap"] else []
    sessions = list(Path(server["ray_tmp"]).glob("session_2*"))
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess_timeout():
        os.killpg(proc.pid, signal.SIGKILL)
        code = "killed after 60 s"
    took = time.monotonic() - t0
    with socket.socket() as sock:
        bound = sock.connect_ex(("127.0.0.1", server["port"])) == 0
    left = [p for p in haproxies if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    left += [p for s in sessions for p in session_pids(str(s))]
    shutil.rmtree(server["ray_tmp"], ignore_errors=True)
    return {"exit": code, "seconds": round(took, 2), "haproxy_seen": len(haproxies), "left": left,
            "port_bound": bound, "clean": code in (0, 130, 143) and not left and not bound}


def subprocess_timeout():
    import subprocess

    return subprocess.TimeoutExpired


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
        body = {"model": model, "prompt": f"count {self.rng.randint(0, 999)}",
                "max_tokens": self.rng.randint(1, 24), "temperature": 0.7, "seed": self.rng.randint(0, 2 ** 32)}
        kind = "completion"
        if self.rng.random() < 0.5:  # vLLM's sampling extras, as clients send them through extra_body
            kind = "completion-extras"
            body.update(self.rng.choice(EXTRAS))
            body["min_tokens"] = min(body.get("min_tokens", 0), body["max_tokens"])
        r = await http.post("/v1/completions", json=body)
        self._note(kind, r.status_code, {200})

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

    async def race(self, http: httpx.AsyncClient, role: str) -> None:
        """Load, unload and requests on one adapter (`hot`) at once: no 5xx, each its own 4xx."""
        while time.monotonic() < self.until:
            if role == "load":
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": "hot"})
                self._note("race-load", r.status_code, {200, 400})
            elif role == "unload":
                r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})
                self._note("race-unload", r.status_code, {200, 404, 409})
            else:
                r = await http.post("/v1/completions", json={"model": self.rng.choice(["hot", "demo:hot"]),
                                                             "prompt": "race", "max_tokens": 4})
                self._note("race-generate", r.status_code, {200, 404})
            await asyncio.sleep(self.rng.uniform(0.0, 0.3))

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
        racers = [soak.race(http, role) for role in ("load", "load", "unload", "unload", "generate", "generate")]
        await asyncio.gather(sample(), soak.adapters(http), *racers, *[soak.client(http) for _ in range(clients)])
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
    from moeflow.serving.app import free_port

    work = Path(tempfile.mkdtemp(prefix="moeflow-soak-"))
    server = None
    try:
        server = _deploy(work, args.port or free_port(), args.ingress, args.stream_interval)
        url, proc = server["url"], server["replica"]
        soak, rss = asyncio.run(_traffic(url, args.minutes, args.clients, proc))
        time.sleep(3)
        idle_cpu = proc.cpu_percent(interval=5.0)
        running = re.findall(r"moeflow_num_requests_running\{[^}]*\} (\S+)", httpx.get(f"{url}/metrics").text)
        stop = _stop(server)
        report = _report(args, soak, rss, idle_cpu, running, stop)
        print(json.dumps(report, indent=1))
        sys.exit(0 if report["pass"] else 1)
    finally:
        if server is not None and server["proc"].poll() is None:
            import os
            import signal

            os.killpg(server["proc"].pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


def _report(args, soak: Soak, rss: list, idle_cpu: float, running: list[str], stop: dict) -> dict:
    warm = max(30.0, args.minutes * 6)  # the first 10% of the run (at least 30 s)
    after = [m for t, m in rss if t >= warm] or [rss[-1][1]]
    growth = (after[-1] - after[0]) / after[0]
    fivexx = sum(n for c, n in soak.codes.items() if isinstance(c, str) or c >= 500)
    checks = {"zero_5xx_or_transport_errors": fivexx == 0, "unexpected_statuses": not soak.errors,
              "rss_growth_le_10pct": growth <= 0.10, "idle_cpu_lt_5pct": idle_cpu < 5.0,
              "running_gauge_zero": all(float(v) == 0 for v in running), "sigterm_leaves_nothing": stop["clean"]}
    return {"minutes": args.minutes, "clients": args.clients, "requests": sum(soak.kinds.values()),
            "requests_per_s": round(sum(soak.kinds.values()) / (args.minutes * 60), 1),
            "by_kind": dict(soak.kinds), "statuses": {str(k): v for k, v in soak.codes.items()},
            "unexpected": soak.errors, "rss_mb_after_warmup": round(after[0], 1), "rss_mb_end": round(after[-1], 1),
            "rss_growth_pct": round(100 * growth, 2), "idle_cpu_pct": idle_cpu, "running_gauge": running,
            "stop": stop, "checks": checks, "pass": all(checks.values())}


if __name__ == "__main__":
    main()
