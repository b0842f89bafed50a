"""Streaming over HTTP (in-process uvicorn, no Ray): `stream_interval` (vLLM's knob) sends the
first chunk at once and then chunks of at least that many tokens; the streamed text equals the
non-streamed completion; a client that goes away mid-stream frees its slot."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port
from moeflow.serving.delivery import Chunker
from moeflow.serving.engine import Delta
from moeflow_testing.serving import LocalServer
from moeflow_testing.tiny import build_debug_model

pytestmark = pytest.mark.integration
BODY = {"model": "m", "prompt": "reverse: abc\nanswer:", "max_tokens": 14, "temperature": 0,
        "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.set_num_threads(1)
    return build_debug_model("qwen3_moe", tmp_path_factory.mktemp("stream") / "m")


def _chunks(url: str) -> list[dict]:
    out = []
    with httpx.stream("POST", url + "/v1/completions", json=dict(BODY, stream=True), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return [c for c in out if c["choices"]]


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_groups_tokens_after_the_first(base, interval):
    settings = ServeSettings(base_dir=str(base), served_model_name="m", stream_interval=interval)
    with LocalServer(settings, free_port()) as server:
        whole = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]
        chunks = _chunks(server.url)
        sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
        # the first chunk is sent with what is there (never held for `interval` tokens: TTFT);
        # a busy host may have queued a few more by then
        assert sum(sizes) == 14 and len(chunks) >= 2
        assert all(n >= interval for n in sizes[1:-1]), sizes
        if interval > 1:
            assert len(chunks) <= 1 + -(-13 // interval)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_prompts_of_one_streamed_request_interleave(base):
    """A multi-prompt completion streams each prompt's chunks as they come (vLLM's order):
    prompt 1 does not wait for prompt 0 to finish; each prompt's text equals its own."""
    settings = ServeSettings(base_dir=str(base), served_model_name="m")
    body = dict(BODY, prompt=["reverse: abc\nanswer:", "reverse: xyz\nanswer:"], max_tokens=12, logprobs=None)
    with LocalServer(settings, free_port()) as server:
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
        order, texts = [], {0: "", 1: ""}
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    order.append((choice["index"], choice["finish_reason"]))
                    texts[choice["index"]] += choice["text"]
    finished_0 = order.index((0, "length"))
    assert any(i == 1 for i, _ in order[:finished_0]), order
    assert [texts[0], texts[1]] == [c["text"] for c in sorted(whole, key=lambda c: c["index"])]


def test_client_gone_mid_stream_frees_its_slot(base):
    settings = ServeSettings(base_dir=str(base), served_model_name="m", engine_process=False)
    with LocalServer(settings, free_port()) as server:
        body = dict(BODY, stream=True, max_tokens=400)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # the client goes away after a few chunks
        engine = server.service.engine
        deadline = time.monotonic() + 5
        while engine.core.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.core.running
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'moeflow_num_requests_running{model_name="m"} 0.0' in metrics


def _delta(tok: int, finish: str | None = None) -> Delta:
    return Delta([tok], f"t{tok}", finish_reason=finish, completion_tokens=tok + 1)


@pytest.mark.parametrize("interval, posts", [(1, 14), (4, 5), (None, 1)])
def test_deltas_cross_to_the_event_loop_once_per_chunk(interval, posts):
    """The engine thread joins a request's deltas into its chunks before waking the event loop:
    1 + ceil(13 / interval) wake-ups for 14 streamed tokens, one for a non-streamed request."""
    sent: list[Delta] = []
    sink = Chunker(sent.append, interval)
    for tok in range(14):
        sink(_delta(tok, "length" if tok == 13 else None))
    assert len(sent) == posts
    assert [t for d in sent for t in d.token_ids] == list(range(14))
    assert "".join(d.text for d in sent) == "".join(f"t{t}" for t in range(14))
    assert sent[-1].finish_reason == "length" and sent[-1].completion_tokens == 14
    if interval is not None:
        assert sent[0].token_ids == [0]  # the first token is not held back (TTFT)


def test_an_abort_carries_the_tokens_held_back():
    sent: list[Delta] = []
    sink = Chunker(sent.append, 8)
    for tok in range(3):
        sink(_delta(tok))
    sink(Delta([], "", finish_reason="abort", completion_tokens=3))
    assert [d.token_ids for d in sent] == [[0], [1, 2]] and sent[-1].finish_reason == "abort"


def _frames(url: str, body: dict) -> list[bytes]:
    """The response body's HTTP/1.1 chunks as sent (one per write of the server), read off a raw
    socket: httpx would join them."""
    u = urlsplit(url)
    payload = json.dumps(body).encode()
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert b" 200 " in head.split(b"\r\n", 1)[0] and b"transfer-encoding: chunked" in head.lower(), head
    frames = []
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return frames
        frames.append(rest[:size])
        rest = rest[size + 2:]


@pytest.mark.parametrize("prompts", [1, 2])
def test_what_follows_the_last_finish_goes_in_one_write(base, prompts):
    """Once every choice has finished, its chunk, the usage chunk and [DONE] go as one write;
    every chunk before it goes alone, when it is ready (streaming is not held back).

    A pause of the server's event loop (seen when this file ran beside another) can leave two
    of a choice's deltas queued, and those go as one event (delivery.join_deltas): so the
    tokens are counted, not the events."""
    settings = ServeSettings(base_dir=str(base), served_model_name="m", stream_interval=1)
    body = dict(BODY, prompt=[BODY["prompt"]] * prompts, stream=True, stream_options={"include_usage": True})
    with LocalServer(settings, free_port()) as server:
        frames = _frames(server.url, body)
    events = [[e for e in f.decode().split("\n\n") if e] for f in frames]
    assert all(len(e) == 1 for e in events[:-1]), events  # one event a write before the end
    *before, last = events
    assert last[-1] == "data: [DONE]" and len(last) == 3, last
    finish, usage = (json.loads(e[6:]) for e in last[:2])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 14 * prompts

    def tokens(chunk: dict) -> int:  # logprobs: 0 lists one entry per token of the chunk
        return len(chunk["choices"][0]["logprobs"]["token_logprobs"])
    early = [json.loads(e[0][6:]) for e in before]
    assert sum(map(tokens, early)) + tokens(finish) == 14 * prompts
    assert sum(map(tokens, early)) >= 7 * prompts, [tokens(c) for c in early]  # most went as they came
    finished = [c["choices"][0]["finish_reason"] for c in early]
    assert finished.count("length") == prompts - 1  # the other prompt's finish went when it came
