"""Peer measurement for bench_engine.py: `transformers serve --continuous-batching`, same model, same prompts.

    .venv/bin/python benchmarks/peer_tf_serve.py            # demo model, float32, CPU, 1 thread

bench_engine.py's HTTP rows compare our server against `model.generate`; this
measures the nearest off-the-shelf server instead: transformers' own OpenAI
API with continuous batching (paged attention), fed the same prompts
(`bench_engine.prompts`) as concurrent streamed completions, each asked for
exactly `new` greedy tokens. The number is output tokens / wall seconds of the
whole round, as `bench_engine.http_tps` computes it for our server (client
side, streaming, all requests at once), so the two can be set side by side.

Endpoint: /v1/completions (transformers serve has it; /v1/chat/completions
would add a chat template around the prompt). It only takes a text prompt, so
the token ids are turned into text that re-tokenises to exactly as many tokens
(`as_text`: random ids are often lone UTF-8 bytes that do not survive a
decode/encode round trip; where one does not, a letter stands in). The peer
thus prefills the same number of tokens, though not the same ids.

Exactly `new` tokens: `max_tokens=new`, and a per-request `generation_config`
(a JSON string the server turns into the request's GenerationConfig) with
`eos_token_id=-1`: serve hands CB only the request's `max_new_tokens` and
`eos_token_id` (`CBGenerateManager.generate_streaming` -> `add_request`), and
the scheduler ignores negative EOS ids, so a request stops only at
`max_new_tokens` (serve has no `ignore_eos`: an unknown field is a 422). Output
tokens are counted from the `usage` of the last chunk (the server's count of
generated token ids; sent whether or not `stream_options` asks for it), not
from chunks: the server decodes incrementally, holds back partial UTF-8 bytes
and merges queued pieces into one SSE write, so chunks undercount tokens.

The server runs with OMP_NUM_THREADS=`threads` (bench_engine's `--threads`,
1 by default, as our replica) and a KV cache sized for the workload
(`num_blocks`; see TransformersServe). Client and server share the machine, as
in bench_engine's HTTP rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
_FILL = "abcdefghijklmnopqrstuvwxyz"


class TransformersServe:
    """`transformers serve --continuous-batching MODEL` in its own process group, on 127.0.0.1."""

    def __init__(self, model_dir: str, threads: int = 1, device: str = "cpu", dtype: str = "float32",
                 num_blocks: int | None = 64, max_batch_tokens: int | None = 2048,
                 startup_timeout_s: float = 300.0) -> None:
        """num_blocks, max_batch_tokens: --cb-num-blocks (KV blocks of 256 tokens) and --cb-max-batch-tokens;
        None: serve's default, which on CPU sizes the cache to 60% of the machine's RAM (13 GB and 30 s of
        page faults at the first request on a 23 GB machine, no faster than 64 blocks here)."""
        self.model_id = model_dir  # the served (forced) model; requests must name it or nothing
        self.threads, self.device, self.dtype = threads, device, dtype
        self.cb_args = [*(["--cb-num-blocks", str(num_blocks)] if num_blocks else []),
                        *(["--cb-max-batch-tokens", str(max_batch_tokens)] if max_batch_tokens else [])]
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.command: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tf-serve-", suffix=".log", delete=False)

    def __enter__(self) -> TransformersServe:
        from moeflow.serving.app import free_port

        for attempt in range(3):  # the free port may be taken before the server binds it
            try:
                self._start(free_port())
                break
            except RuntimeError:
                self._stop()
                if attempt == 2 or "address already in use" not in self.log_tail().lower():
                    raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()
        self._log.close()
        if exc is None:  # kept for a look after a failure
            Path(self._log.name).unlink(missing_ok=True)

    def _start(self, port: int) -> None:
        cli = Path(sys.executable).with_name("transformers")
        self.command = [str(cli), "serve", self.model_id, "--continuous-batching", "--device", self.device,
                        "--dtype", self.dtype, "--host", "127.0.0.1", "--port", str(port),
                        "--log-level", "warning", *self.cb_args]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self._log.seek(0)
        self._log.truncate()
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.startup_timeout_s
        while True:  # the forced model is loaded before uvicorn listens: /health answering means ready
            if self._proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self._proc.returncode} while starting "
                                   f"(log {self._log.name}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"transformers serve not answering after {self.startup_timeout_s:.0f} s "
                                   f"(log {self._log.name}):\n{self.log_tail()}")
            time.sleep(0.5)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])


def as_text(tokenizer: Any, ids: list[int]) -> str:
    """Text that `tokenizer` encodes to exactly len(ids) tokens, made of ids' own pieces where they
    round-trip (a letter where a piece is a partial UTF-8 byte), topped up with letters."""
    n = len(ids)

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])  # as the server encodes the prompt
    text = ""
    for i in ids:
        piece = tokenizer.decode([i])
        if not piece or "\ufffd" in piece:
            piece = _FILL[i % len(_FILL)]
        if count(text + piece) <= n:
            text += piece
    for j in range(8 * n):
        if count(text) >= n:
            break
        c = _FILL[(ids[j % n] + j) % len(_FILL)]
        if count(text + c) <= n:
            text += c
    if count(text) != n:
        raise ValueError(f"no text of exactly {n} tokens found for prompt {ids[:4]}...")
    return text


@dataclass
class Stream:
    """One streamed completion, as the client saw it (seconds from sending the request)."""

    completion_tokens: int = 0  # the server's usage count
    prompt_tokens: int = 0
    chunks: int = 0  # SSE chunks with text
    ttft: float = 0.0  # to the first chunk with text
    e2el: float = 0.0
    finish_reason: str | None = None


def _body(model_id: str, text: str, new: int) -> dict[str, Any]:
    gen = {"max_new_tokens": new, "do_sample": False, "eos_token_id": -1}  # -1: CB never stops on EOS
    return {"model": model_id, "prompt": text, "max_tokens": new, "temperature": 0, "stream": True,
            "generation_config": json.dumps(gen)}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], tokenizer: Any) -> Stream:
    res, pieces = Stream(), []
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    pieces.append(choice["text"])
                    res.chunks += 1
                    if not res.ttft:
                        res.ttft = time.perf_counter() - t0
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if chunk.get("usage"):
                res.completion_tokens = chunk["usage"]["completion_tokens"]
                res.prompt_tokens = chunk["usage"]["prompt_tokens"]
    res.e2el = time.perf_counter() - t0
    if not res.completion_tokens:  # no usage: re-tokenise the text (approximate: merges differ)
        res.completion_tokens = len(tokenizer("".join(pieces), add_special_tokens=False)["input_ids"])
    return res


class PeerClient:
    """One HTTP client for every round, its connections kept alive between rounds (a client's
    pool), on an event loop of its own: as bench_engine's client to our server."""

    def __init__(self, connections: int = 20) -> None:
        self.loop = asyncio.new_event_loop()
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

        async def open_() -> httpx.AsyncClient:
            return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)
        self.client = self.loop.run_until_complete(open_())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


async def _round(client: httpx.AsyncClient, url: str, model_id: str, texts: list[str], new: int,
                 tokenizer: Any) -> tuple[list[Stream], float]:
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(_one(client, url, _body(model_id, t, new), tokenizer) for t in texts))
    return list(streams), time.perf_counter() - t0


def peer_round(url: str, model_id: str, prompts: list[list[int]], new: int, tokenizer: Any,
               client: PeerClient | None = None) -> tuple[list[Stream], float]:
    """All prompts at once as streamed completions; (per-request results, wall seconds).
    `client`: kept across rounds; None: a new one for this round."""
    texts = [as_text(tokenizer, p) for p in prompts]  # before the clock starts
    own = client is None
    peer = client or PeerClient(len(texts) + 4)
    try:
        return peer.loop.run_until_complete(_round(peer.client, url, model_id, texts, new, tokenizer))
    finally:
        if own:
            peer.close()


def peer_tps(url: str, model_id: str, prompts: list[list[int]], new: int, tokenizer: Any,
             client: PeerClient | None = None) -> float:
    """Output tokens/s of one round of all `prompts` sent at once (streamed), as bench_engine.http_tps."""
    streams, wall = peer_round(url, model_id, prompts, new, tokenizer, client)
    return sum(s.completion_tokens for s in streams) / wall


def peer_ttft(url: str, model_id: str, prompt: list[int], new: int, tokenizer: Any,
              client: PeerClient | None = None) -> float:
    """Seconds to the first streamed text of one request alone (a first token that is a partial UTF-8
    byte is held back by the server until it decodes: then this is one decode step late)."""
    (stream,), _ = peer_round(url, model_id, [prompt], new, tokenizer, client)
    return stream.ttft


def main() -> None:
    import argparse

    from transformers import AutoTokenizer

    sys.path.insert(0, str(BENCH))
    from engine_rates import prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "assets" / "demo-base"))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    batch, new = prompts(args.num_prompts, args.input_len, vocab, 0), args.output_len
    with TransformersServe(args.model, args.threads, args.device, args.dtype) as srv:
        print("server:", " ".join(srv.command), flush=True)
        peer_round(srv.url, srv.model_id, batch, new, tok)  # warm-up (also starts the CB manager)
        for r in range(args.repeat):
            streams, wall = peer_round(srv.url, srv.model_id, batch, new, tok)
            out = [s.completion_tokens for s in streams]
            prompt_lens = sorted({s.prompt_tokens for s in streams})
            finish = sorted({str(s.finish_reason) for s in streams})
            print(f"round {r}: {sum(out) / wall:8.1f} tok/s  wall {wall:.2f} s  output tokens/request min {min(out)} "
                  f"max {max(out)} (asked {new})  prompt tokens {prompt_lens}  finish {finish}  "
                  f"text chunks {sum(s.chunks for s in streams)}", flush=True)
        ttfts = [peer_ttft(srv.url, srv.model_id, batch[0], new, tok) for _ in range(2 * args.repeat)]
        print("TTFT ms (one request alone):", " ".join(f"{1000 * t:.1f}" for t in ttfts))


if __name__ == "__main__":
    main()
