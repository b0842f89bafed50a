"""The most a served round can reach behind the default ingress on this host, whatever the engine.

    .venv/bin/python benchmarks/bench_ingress_ceiling.py [--rounds 15] [--output-len 32]

bench_engine.py's HTTP row asks 16 streamed completions through Ray Serve (HAProxy in front, the
replica serving HTTP itself) for >= 0.8x the tokens/s of `generate` on the same prompts as one
batch. This benchmark measures how much of that the serving stack leaves to any engine. Beside
the real app (`served`: the demo model, the engine core in its own process, as bench_engine's
row) it deploys, in the same Serve, `ideal`: the same ingress, the same Gate middleware, the same
request schema (pydantic's `CompletionRequest`) and the same streamed response (`EventStream`,
first token alone, then chunks of `--stream-interval` tokens, the finish with usage and [DONE]
as one write), over an engine that costs exactly `generate`'s time per token and nothing else:

- a child process of the replica spins one CPU for the step time per step, back to back while
  any stream runs, as an engine core would, and tells the replica each step's end (on a pipe);
  the step time is `generate`'s wall per token in the round just before (set through `/step`),
  so each `ideal` round is paced by the `generate` round it is compared with;
- a request takes its first token from the first step that starts after it arrived (a core
  admits requests when a step starts), and one more from each step after;
- the replica's work per step is only to count tokens and to write the chunks that are due: no
  detokenising, no metrics, no request bookkeeping, no messages to and from a core.

Rounds alternate `generate` (in this process, one thread), `served` and `ideal`, with one
kept-alive aiohttp client (engine_rates.Client, as bench_engine's row). It prints the median
round of each and its tokens/s as a ratio to `generate`'s. `ideal` is a ceiling: the part of the
0.8 the HTTP stack (client, HAProxy, uvicorn, Ray Serve's request path, Starlette, FastAPI,
the JSON of the chunks) takes on this host is what `ideal` misses; what `served` misses beyond
it is the engine's and its front end's.
"""

# no `from __future__ import annotations`: FastAPI must see the endpoint's body type itself
# (a string annotation would be looked up in the globals the replica unpickles, without it)
import asyncio
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_rates import Client, deploy_demo, eager_anchor, http_tps, local_serve, served_round_parser  # noqa: E402

# the child that stands for the engine core: spins one CPU a step, writes each step's start time
# (8 bytes, the host's monotonic clock) when the step ends. Control on stdin, 9 bytes a message:
# b"r" run (steps back to back), b"w" wait (no CPU), b"s" + the step time (double); EOF: exit
_SPINNER = r"""
import os, select, struct, sys, time
control, out = sys.stdin.fileno(), sys.stdout.fileno()
step, running = float(sys.argv[1]), False
while True:
    ready, _, _ = select.select([control], [], [], 0 if running else None)
    if ready:
        msg = b""
        while len(msg) < 9:
            part = os.read(control, 9 - len(msg))
            if not part:
                sys.exit(0)
            msg += part
        if msg[:1] == b"s":
            step = struct.unpack("d", msg[1:])[0]
        else:
            running = msg[:1] == b"r"
        continue
    start = time.perf_counter()
    while time.perf_counter() - start < step:
        pass
    os.write(out, struct.pack("d", start))
"""


class IdealEngine:
    """Streams of `max_tokens` tokens paced by the spinner's steps (module docstring)."""

    def __init__(self, step_s: float, interval: int):
        self.interval = interval  # step_s: until the first set_step
        self.proc = subprocess.Popen([sys.executable, "-c", _SPINNER, str(step_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.streams: dict[object, list] = {}  # key -> [joined at, tokens, max, queue]
        self.loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while (data := out.read(8)) and len(data) == 8:
            start = struct.unpack("d", data)[0]
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._step, start)

    def _control(self, kind: bytes, value: float = 0.0) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(kind + struct.pack("d", value))

    def set_step(self, seconds: float) -> None:
        self._control(b"s", seconds)

    def join(self, max_tokens: int) -> asyncio.Queue:
        self.loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if not self.streams:
            self._control(b"r")
        self.streams[object()] = [time.perf_counter(), 0, max_tokens, q]
        return q

    def _step(self, start: float) -> None:
        for key, s in list(self.streams.items()):
            joined, n, most, q = s
            if joined > start:
                continue  # arrived after this step began: the next one admits it
            s[1] = n = n + 1
            if n == 1 or n == most or (n - 1) % self.interval == 0:
                q.put_nowait(n)
            if n == most:
                del self.streams[key]
        if not self.streams:
            self._control(b"w")


def ideal_app(interval: int):
    """The FastAPI app of `ideal`: /v1/completions (streamed only) and /v1/models."""
    from fastapi import FastAPI

    from moeflow.serving.api_errors import install_handlers
    from moeflow.serving.event_stream import EventStream, Last
    from moeflow.serving.middleware import Gate
    from moeflow.serving.schemas import CompletionRequest

    app = FastAPI()
    install_handlers(app)
    engine: list[IdealEngine] = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "demo", "object": "model"}]}

    @app.post("/step")
    async def step(seconds: float):  # the benchmark sets it to its last `generate` round's per token
        if not engine:
            engine.append(IdealEngine(seconds, interval))
        engine[0].set_step(seconds)
        return {"step_s": seconds}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if not engine:
            engine.append(IdealEngine(0.0025, interval))  # until the benchmark sets it
        most = body.max_tokens or 16
        q = engine[0].join(most)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> str:
            return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                          "model": body.model, "choices": [{"index": 0, "text": text,
                                          "logprobs": None, "finish_reason": finish}]}) + "\n\n"

        async def events():
            sent = 0
            while sent < most:
                n = await q.get()
                if n < most:
                    yield chunk("x" * (n - sent), None)
                else:
                    usage = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                             "choices": [], "usage": {"prompt_tokens": len(body.prompt),
                                                      "completion_tokens": most, "total_tokens":
                                                      len(body.prompt) + most}}
                    yield Last(chunk("x" * (n - sent), "length") + f"data: {json.dumps(usage)}\n\n"
                               "data: [DONE]\n\n")
                sent = n
        return EventStream(events())

    app.add_middleware(Gate, limit=1 << 20, api_key=None)
    return app


def ideal_deployment(interval: int):
    from ray import serve

    @serve.deployment
    @serve.ingress()
    class Ideal:
        def __serve_build_asgi_app__(self):  # built in the replica, as moeflow's own app is
            return ideal_app(interval)
    return Ideal


def main() -> None:
    args = served_round_parser(__doc__, rounds=15).parse_args()

    import httpx
    from bench_engine import generate_tps
    from ray import serve

    anchor, batch = eager_anchor(args)
    new = args.output_len
    client = Client(len(batch) + 4)
    with local_serve(tempfile.mkdtemp(prefix="/tmp/mfceil")) as port:
        try:
            deploy_demo(args, "served")
            serve.run(ideal_deployment(args.stream_interval).options(max_ongoing_requests=4 * args.num_prompts,
                                                                     ray_actor_options={"num_cpus": 0}).bind(),
                      name="ideal", route_prefix="/ideal", blocking=False)
            urls = {name: f"http://127.0.0.1:{port}/{name}" for name in ("served", "ideal")}
            for url in urls.values():
                deadline = time.monotonic() + 600
                while True:  # the second app may still be starting when the first answers
                    try:
                        httpx.get(f"{url}/v1/models", timeout=60).raise_for_status()
                        break
                    except httpx.HTTPError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
            for _ in range(2):  # warm every side
                for url in urls.values():
                    http_tps(client, url, batch, new)
                generate_tps(anchor, batch, new)
            rates: dict[str, list[float]] = {"generate": [], "served": [], "ideal": []}
            steps = []
            for _ in range(args.rounds):
                rates["generate"].append(generate_tps(anchor, batch, new))
                steps.append(len(batch) / rates["generate"][-1])  # this round's wall per token
                httpx.post(f"{urls['ideal']}/step", params={"seconds": steps[-1]}, timeout=60).raise_for_status()
                for name, url in urls.items():
                    rates[name].append(http_tps(client, url, batch, new))
            gen = statistics.median(rates["generate"])
            print(f"{args.rounds} alternated rounds, {args.num_prompts} streams x {args.input_len} in / {new} out, "
                  f"interval {args.stream_interval}; ideal's step: the round's generate wall per token, median "
                  f"{1e3 * statistics.median(steps):.2f} ms")
            for name in ("generate", "served", "ideal"):
                tps = statistics.median(rates[name])
                ratios = sorted(r / g for r, g in zip(rates[name], rates["generate"]))
                print(f"  {name:9s} {tps:7.0f} tok/s  round {1e3 * args.num_prompts * new / tps:6.1f} ms  "
                      f"ratio {tps / gen:4.2f} (pairwise quartiles {ratios[len(ratios) // 4]:.2f}-"
                      f"{ratios[3 * len(ratios) // 4]:.2f})")
        finally:
            client.close()


if __name__ == "__main__":
    main()
