"""Async load generator for an OpenAI-compatible endpoint, as `vllm bench serve` measures.

    from moeflow.serving.loadgen import replay, summarize, format_result
    results, wall = asyncio.run(replay(url, requests, max_concurrency=64))
    print(format_result(summarize(results, wall, goodput={"ttft": 500, "tpot": 50})))

Requests are sent open-loop at their arrival offsets (at most `max_concurrency`
in flight), streamed, with `ignore_eos` so outputs have their drawn length.
The client is aiohttp, as in vllm: its C HTTP parser keeps the client's own
CPU small next to the server's on a shared machine. Metric names and
definitions are vllm's: TTFT (time to first token), TPOT (time per output
token after the first: (E2EL - TTFT) / (output tokens - 1)), ITL (gaps
between streamed chunks), E2EL (end-to-end latency), request goodput
(requests/s meeting every SLO, DistServe's definition).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeflow.serving.traffic import Request, arrival_times


@dataclass
class Result:
    """What one request measured (seconds)."""

    req: Request
    ok: bool = False
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    sent: float | None = None  # time.perf_counter() when the request was sent (None: never sent)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def meets(self, limits_ms: dict[str, float]) -> bool:
        """True when the request finished within every SLO ({ttft|tpot|e2el: ms})."""
        if not self.ok:
            return False
        got = {"ttft": self.ttft, "tpot": self.tpot or 0.0, "e2el": self.e2el}
        return all(1000 * got[k] <= v for k, v in limits_ms.items())


def _body(req: Request) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request."""
    common = {"model": req.model, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
              "ignore_eos": True, "stream_options": {"include_usage": True}}
    if req.image is None:
        return "/v1/completions", dict(common, prompt=req.prompt)
    text = req.prompt if isinstance(req.prompt, str) else " ".join("x" for _ in req.prompt)
    content = [{"type": "image_url", "image_url": {"url": req.image}}, {"type": "text", "text": text}]
    return "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": content}])


async def _one(session, url: str, req: Request) -> Result:
    # lazy: aiohttp: heavy, loaded only when this runs
    import aiohttp

    res = Result(req)
    path, body = _body(req)
    start = last = res.sent = time.perf_counter()
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices"):
                    continue
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2el = time.perf_counter() - start
    res.ok = res.output_tokens > 0 and res.ttft > 0
    if not res.ok and not res.error:
        res.error = "no tokens streamed"
    return res


def client_session(api_key: str | None = None, max_concurrency: int | None = None) -> Any:
    """An aiohttp session for `replay` (use as `async with`, inside the loop that replays)."""
    # lazy: aiohttp: heavy, loaded only when this runs
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_concurrency + 8 if max_concurrency else 0)
    return aiohttp.ClientSession(headers=headers, connector=connector, timeout=aiohttp.ClientTimeout(total=600))


async def replay(url: str, requests: list[Request], *, max_concurrency: int | None = None,
                 api_key: str | None = None, time_limit_s: float | None = None,
                 route: str = "", session: Any = None) -> tuple[list[Result], float]:
    """Send `requests` at their arrival offsets; returns (results in request order, wall s).

    Args:
        url: base URL (http://host:port[/prefix]).
        max_concurrency: at most this many in flight (None: unbounded, open loop).
        time_limit_s: cancel what is still running this long after the start; those
            requests count as failed (an overloaded server must not stall a search).
        session: an open `client_session()` to send through (its connections kept alive from
            one call to the next, as a client's pool keeps them); None: a new one for this call.
    """
    if session is None:
        async with client_session(api_key, max_concurrency) as own:
            return await replay(url, requests, max_concurrency=max_concurrency, time_limit_s=time_limit_s,
                                route=route, session=own)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [Result(r, error="not finished within the time limit") for r in requests]

    async def fire(i: int, req: Request) -> None:
        if sem is None:
            results[i] = await _one(session, url + route, req)
            return
        async with sem:
            results[i] = await _one(session, url + route, req)

    start = time.perf_counter()
    tasks = []

    async def schedule() -> None:
        for i, req in enumerate(requests):
            delay = req.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i, req)))
        await asyncio.gather(*tasks)

    try:
        await asyncio.wait_for(schedule(), time_limit_s)
    except asyncio.TimeoutError:  # tasks were cancelled: their requests stay "not finished"
        pass
    return results, time.perf_counter() - start


def random_requests(n: int, models: list[str], *, input_len: int, output_len: int, range_ratio: float = 0.0,
                    vocab: int = 500, rate: float = float("inf"), burstiness: float = 1.0, seed: int = 0,
                    klass: str = "random") -> list[Request]:
    """vllm's random dataset: uniform lengths within range_ratio of the means, random token
    ids, gamma arrivals at `rate` (inf: all at once), models picked at random."""


    rng = random.Random(seed)
    times = [0.0] * n if rate == float("inf") else arrival_times(n, rate, burstiness, rng)

    def draw(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))
    return [Request(t, rng.choice(models), [rng.randrange(10, vocab) for _ in range(draw(input_len))],
                    draw(output_len), klass) for t in times]


# ------------------------------------------------------------------ metrics


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` in ms, under vllm's key names (mean_ttft_ms, ...)."""
    arr = np.asarray(values_s or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(results: list[Result], wall_s: float, *, goodput: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (99,), max_concurrency: int | None = None) -> dict:
    """vllm bench serve's result dict (its key names), plus `slo_attainment` with goodput.

    Args:
        goodput: SLOs {ttft|tpot|e2el: ms}; a request is good when it meets all of them.
    """
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    wall_s = max(wall_s, 1e-9)
    out: dict[str, Any] = {"completed": len(ok), "failed": len(results) - len(ok), "num_prompts": len(results),
           "max_concurrency": max_concurrency, "duration": wall_s, "total_input_tokens": in_tokens,
           "total_output_tokens": out_tokens, "request_throughput": len(ok) / wall_s,
           "output_throughput": out_tokens / wall_s,
           "total_token_throughput": (in_tokens + out_tokens) / wall_s}
    if goodput:
        good = sum(r.meets(goodput) for r in results)
        out.update(request_goodput=good / wall_s, slo_attainment=good / max(1, len(results)))
    out.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    out.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles))
    out.update(_stats("itl", [x for r in ok for x in r.itl], percentiles))
    out.update(_stats("e2el", [r.e2el for r in ok], percentiles))
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


_SECTIONS = (("ttft", "Time to First Token", "TTFT"),
             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def format_result(m: dict, percentiles: tuple[float, ...] = (99,)) -> str:
    """The block `vllm bench serve` prints, with the same labels."""
    rows = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
            f"{'Successful requests:':<40}{m['completed']:<10}",
            f"{'Failed requests:':<40}{m['failed']:<10}"]
    if m.get("max_concurrency"):
        rows.append(f"{'Maximum request concurrency:':<40}{m['max_concurrency']:<10}")
    rows += [f"{'Benchmark duration (s):':<40}{m['duration']:<10.2f}",
             f"{'Total input tokens:':<40}{m['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{m['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{m['request_throughput']:<10.2f}"]
    if "request_goodput" in m:
        rows.append(f"{'Request goodput (req/s):':<40}{m['request_goodput']:<10.2f}")
    rows += [f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:<10.2f}",
             f"{'Total Token throughput (tok/s):':<40}{m['total_token_throughput']:<10.2f}"]
    for key, title, short in _SECTIONS:
        rows.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        rows.append(f"{f'Mean {short} (ms):':<40}{m[f'mean_{key}_ms']:<10.2f}")
        rows.append(f"{f'Median {short} (ms):':<40}{m[f'median_{key}_ms']:<10.2f}")
        for p in percentiles:
            rows.append(f"{f'P{p:g} {short} (ms):':<40}{m[f'p{p:g}_{key}_ms']:<10.2f}")
    rows.append("=" * 50)
    return "\n".join(rows)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """vllm's `--goodput ttft:MS tpot:MS e2el:MS` -> {name: ms}; ValueError naming a bad item."""
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if out[name] <= 0:
            raise ValueError(f"--goodput {item!r}: must be > 0 ms")
    return out
