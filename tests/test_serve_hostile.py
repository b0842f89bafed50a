"""Hostile input against the served API (in-process uvicorn, no Ray): every bad request gets a
4xx in OpenAI's error shape or a correct answer, and a normal request after it still succeeds;
the wedge requests of the serving issue share a batch with 15 healthy ones that all succeed;
disconnects free their slots, the idle replica sleeps, big prompts never block the event loop."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port
from moeflow_testing.serving import LocalServer, make_lora_adapter, poison_adapter
from moeflow_testing.tiny import build_debug_model

pytestmark = pytest.mark.integration
PROMPT = "reverse: abc\nanswer:"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hostile")
    base = build_debug_model("qwen3_moe", root / "tiny-moe")
    make_lora_adapter(base, root / "adapters" / "a1", seed=1)
    poison_adapter(root / "adapters" / "a1", root / "adapters" / "nan")
    settings = ServeSettings(base_dir=str(base), adapter_root=str(root / "adapters"),
                             max_request_bytes=8 * 2 ** 20, engine_process=False,  # tests patch its slots
                             engine={"max_num_seqs": 16, "max_waiting_seqs": 48})
    with LocalServer(settings, free_port()) as server:
        greedy = _post(server.url, "/v1/completions", _ok()).json()["choices"][0]["text"]
        yield {"url": server.url, "service": server.service, "greedy": greedy}


def _ok(**over) -> dict:
    return {"model": "tiny-moe", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **over}


def _post(url: str, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, content=content, timeout=60,
                      headers={"content-type": "application/json"})


def _still_serves(srv) -> None:
    r = _post(srv["url"], "/v1/completions", _ok())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == srv["greedy"]


def _openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err


async def _batch(url: str, hostile: tuple[str, dict]) -> tuple[httpx.Response, list[httpx.Response]]:
    """The hostile request and 15 healthy ones, all in flight together."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        healthy = [client.post("/v1/completions", json=_ok(max_tokens=12)) for _ in range(15)]
        results = await asyncio.gather(client.post(*hostile[:1], json=hostile[1]), *healthy)
    return results[0], list(results[1:])


WEDGES = {
    "top_p_underflow": (("/v1/completions", {"model": "tiny-moe", "prompt": ["hello"] * 16, "max_tokens": 4,
                                              "top_p": 1e-46, "temperature": 1}), 200),
    "empty_stop": (("/v1/completions", _ok(stop=[""])), 400),
    "temperature_underflow": (("/v1/completions", _ok(temperature=1e-40)), 200),
    "nan_adapter": (("/v1/load_lora_adapter", {"lora_name": "nan", "lora_path": "nan"}), 400),
}


@pytest.mark.parametrize("case", list(WEDGES))
def test_wedge_requests_fail_alone_and_the_engine_keeps_serving(srv, case):
    hostile, status = WEDGES[case]
    bad, healthy = asyncio.run(_batch(srv["url"], hostile))
    assert bad.status_code == status, bad.text
    if status == 200 and case == "temperature_underflow":  # below 1e-5 the temperature is greedy
        assert bad.json()["choices"][0]["text"] == srv["greedy"]
    if status == 200 and case == "top_p_underflow":  # only the most likely token survives: greedy
        hello = _post(srv["url"], "/v1/completions", {"model": "tiny-moe", "prompt": "hello", "max_tokens": 4,
                                                      "temperature": 0}).json()["choices"][0]["text"]
        assert {c["text"] for c in bad.json()["choices"]} == {hello}
    if status >= 400:
        _openai_error(bad, status)
    assert [r.status_code for r in healthy] == [200] * 15
    engine = srv["service"].engine
    assert engine.dead is None
    _still_serves(srv)
    deadline = time.monotonic() + 2
    while (engine.core.running or engine.core.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.core.running and not engine.core.waiting


HOSTILE = [  # (name, body or raw bytes, status, param)
    ("seed_above_64_bits", _ok(seed=2 ** 64), 400, "seed"),
    ("seed_below_int64", _ok(seed=-(2 ** 63) - 1), 400, "seed"),
    ("lone_surrogate", b'{"model": "tiny-moe", "prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),
    ("surrogate_in_chat", b'{"model": "tiny-moe", "messages": [{"role": "user", "content": "a\\udfff"}]}',
     400, "messages"),
    ("booleans_as_token_ids", _ok(prompt=[True, False]), 400, "prompt"),
    ("fractional_token_id", _ok(prompt=[5, 2.5]), 400, "prompt"),
    ("string_among_token_ids", _ok(prompt=[5, "6"]), 400, "prompt"),
    ("lone_surrogate_in_a_prompt_list", b'{"model": "tiny-moe", "prompt": ["a", "\\ud800"], "max_tokens": 2}',
     400, "prompt"),
    ("lone_surrogate_beside_token_ids", b'{"model": "tiny-moe", "prompt": [5, "\\ud800"], "max_tokens": 2}',
     400, "prompt"),
    ("boolean_max_tokens", _ok(max_tokens=True), 400, "max_tokens"),
    ("nan_temperature", b'{"model": "tiny-moe", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("infinite_top_p", b'{"model": "tiny-moe", "prompt": "x", "top_p": Infinity}', 400, "top_p"),
    ("top_p_zero", _ok(top_p=0), 400, "top_p"),
    ("temperature_above_2", _ok(temperature=2.5), 400, "temperature"),
    ("n_seventeen", _ok(n=17), 400, "n"),
    ("n_zero", _ok(n=0), 400, "n"),
    ("response_format_json", _ok(response_format={"type": "json_object"}), 400, "response_format"),
    ("frequency_penalty", _ok(frequency_penalty=2.5), 400, "frequency_penalty"),
    ("presence_penalty", _ok(presence_penalty=-3), 400, "presence_penalty"),
    ("unknown_field", _ok(use_beam_search=True), 400, "use_beam_search"),
    ("top_k_below_minus_one", _ok(top_k=-2), 400, "top_k"),
    ("logit_bias", _ok(logit_bias={"5": 100}), 400, "logit_bias"),
    ("best_of", _ok(best_of=3), 400, "best_of"),
    ("too_many_stops", _ok(stop=["a"] * 17), 400, "stop"),
    ("logprobs_21", _ok(logprobs=21), 400, "logprobs"),
    ("empty_prompt", _ok(prompt=""), 400, "prompt"),
    ("empty_prompt_list", _ok(prompt=[]), 400, "prompt"),
    ("empty_token_list", _ok(prompt=[[]]), 400, "prompt"),
    ("negative_token_id", _ok(prompt=[-1]), 400, "prompt"),
    ("token_id_beyond_vocab", _ok(prompt=[10 ** 9]), 400, "prompt"),
    ("too_many_prompts", _ok(prompt=["x"] * 65), 400, "prompt"),
    ("context_overflow", _ok(max_tokens=10 ** 6), 400, "max_tokens"),
    ("unknown_model", _ok(model="nope"), 404, "model"),
    ("undecodable_body", b"\xff\xfe\x00garbage", 400, "body"),
    ("truncated_json", b'{"model": "tiny-moe", "prompt": ', 400, "body"),
    ("array_body", b"[]", 400, "body"),
    ("tools", {"model": "tiny-moe", "messages": [{"role": "user", "content": "x"}],
               "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("tool_choice", {"model": "tiny-moe", "messages": [{"role": "user", "content": "x"}],
                     "tool_choice": "required"}, 400, "tool_choice"),
    ("unknown_role", {"model": "tiny-moe", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("no_messages", {"model": "tiny-moe", "messages": []}, 400, "messages"),
    ("content_part_type", {"model": "tiny-moe", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     400, "messages.0.content.0"),
    ("nul_in_lora_path", {"lora_name": "x", "lora_path": "a\x00b"}, 400, "lora_path"),
    ("lora_path_escape", {"lora_name": "x", "lora_path": "../../etc"}, 400, "lora_path"),
    ("bad_lora_name", {"lora_name": "../x", "lora_path": "a1"}, 400, "lora_name"),
]


@pytest.mark.parametrize("name,body,status,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_a_4xx_then_a_normal_one_succeeds(srv, name, body, status, param):
    path = "/v1/chat/completions" if b"messages" in (body if isinstance(body, bytes) else str(body).encode()) \
        else "/v1/load_lora_adapter" if "lora" in name else "/v1/completions"
    r = _post(srv["url"], path, content=body) if isinstance(body, bytes) else _post(srv["url"], path, body)
    _openai_error(r, status, param)
    _still_serves(srv)


def test_routes_and_limits_answer_in_openai_shape(srv):
    url = srv["url"]
    _openai_error(httpx.get(f"{url}/v1/nope"), 404)
    r = httpx.put(f"{url}/v1/completions")
    _openai_error(r, 405)
    assert r.headers["allow"] == "POST"
    _openai_error(_post(url, "/v1/completions", {"model": "tiny-moe", "prompt": "x" * (9 * 2 ** 20)}), 413)
    chunked = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": "' + b"x" * 2 ** 20] * 9),
                         headers={"content-type": "application/json"}, timeout=60)
    _openai_error(chunked, 413)
    _still_serves(srv)


def test_big_prompts_do_not_block_the_event_loop(srv):
    url, big = srv["url"], "y " * (5 * 2 ** 19)  # 5 MB each

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            posts = [asyncio.create_task(client.post("/v1/completions", json=_ok(prompt=big))) for _ in range(3)]
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            models = await client.get("/v1/models")
            waited = time.monotonic() - t0
            return models, waited, await asyncio.gather(*posts)

    models, waited, results = asyncio.run(main())
    assert models.status_code == 200 and waited < 0.5, waited
    for r in results:
        _openai_error(r, 400, "prompt")


def test_a_flood_is_refused_quickly_and_nothing_fails(srv):
    async def main():
        async with httpx.AsyncClient(base_url=srv["url"], timeout=120,
                                     limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=_ok(max_tokens=48, ignore_eos=True))
                                          for _ in range(120)])

    codes = [r.status_code for r in asyncio.run(main())]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 48, codes
    _still_serves(srv)


def test_disconnects_free_slots_and_the_idle_replica_sleeps(srv):
    service, url = srv["service"], srv["url"]

    def drop_after_two_chunks():
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json=_ok(max_tokens=400, ignore_eos=True, stream=True)) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    return  # closes the connection mid-stream

    threads = [threading.Thread(target=drop_after_two_chunks) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0 and 'num_requests_running{model_name="tiny-moe"} 0.0' not in \
            httpx.get(f"{url}/metrics").text:
        time.sleep(0.05)
    assert 'moeflow_num_requests_running{model_name="tiny-moe"} 0.0' in httpx.get(f"{url}/metrics").text
    assert not service.engine.core.running
    proc = psutil.Process()
    proc.cpu_percent(None)
    time.sleep(2.0)
    assert proc.cpu_percent(None) < 5.0
    _still_serves(srv)


def test_a_nan_adapter_is_refused_when_every_slot_is_busy(srv, monkeypatch):
    """With every adapter slot held by running requests a runtime load is only registered (it
    loads on first use); the NaN check must still refuse it then (the soak once got a 200)."""
    slots = srv["service"].engine.core.slots
    monkeypatch.setattr(slots, "acquire", lambda spec, busy: False)  # every slot busy
    r = _post(srv["url"], "/v1/load_lora_adapter", {"lora_name": "nan", "lora_path": "nan"})
    _openai_error(r, 400, "lora_path")
    assert "NaN" in r.json()["error"]["message"]
    models = httpx.get(srv["url"] + "/v1/models", timeout=30)
    assert "nan" not in {m["id"] for m in models.json()["data"]}
    monkeypatch.undo()
    _still_serves(srv)


def test_token_ids_written_as_whole_floats_are_ints_and_others_are_refused_at_their_index():
    """JSON Schema's integer allows 6.0: such token ids become ints (one pass over the list, not a
    validator per id); 2.5, true, -1 and "6" are refused naming their index; numbers alone are
    never walked for lone surrogates, strings beside them are."""
    from pydantic import ValidationError

    from moeflow.serving.schemas import CompletionRequest, DetokenizeRequest

    got = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6.0, 7]}).prompt
    assert got == [5, 6, 7] and all(type(t) is int for t in got)
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[5], [6.0]]}).prompt == [[5], [6]]
    assert DetokenizeRequest.model_validate({"model": "m", "tokens": [1, 2.0]}).tokens == [1, 2]
    for bad, msg in (([5, 2.5], "valid integer"), ([5, True], "valid integer"), ([5, -1], "greater than"),
                     ([5, "6"], "valid integer")):
        with pytest.raises(ValidationError) as err:
            CompletionRequest.model_validate({"model": "m", "prompt": bad})
        assert any(e["loc"][-1] == 1 and msg in e["msg"] for e in err.value.errors()), err.value.errors()
    for text in (["a", "\ud800"], [5, "\ud800"], [[5], ["\ud800"]]):
        with pytest.raises(ValidationError, match="not valid Unicode"):
            CompletionRequest.model_validate({"model": "m", "prompt": text})


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11's")
def test_a_body_already_arrived_passes_the_gate_without_yielding_to_the_event_loop():
    """The body's idle limit must not cost a request its turn: with the body already read off
    the socket, the gate hands it to the app in the same turn of the loop. (A task per body
    read, as `asyncio.wait_for` makes, sent every request of a burst to the back of the loop's
    queue: the first reached the engine only after all 16 had passed the gate.)"""
    from moeflow.serving.middleware import Gate

    got = []

    async def app(scope, receive, send):
        got.append(await receive())

    async def receive():  # the body is there: nothing to wait for
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def turn() -> list:
        others: list = []  # what the loop ran meanwhile: another request's turn
        asyncio.get_running_loop().call_soon(others.append, "another request")
        await Gate(app, limit=1024, api_key=None)({"type": "http", "path": "/v1/completions", "headers": []},
                                                  receive, None)
        return list(others)  # a copy: the loop runs the callback after this task ends

    assert asyncio.run(turn()) == []  # through the gate before the loop ran anything else
    assert got == [{"type": "http.request", "body": b"{}", "more_body": False}]


def test_a_body_shorter_than_its_content_length_is_a_408_not_a_held_connection(srv, monkeypatch):
    import socket

    from moeflow.serving import middleware

    monkeypatch.setattr(middleware, "BODY_IDLE_S", 1.0)
    host, port = srv["url"].removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # 10 of the 100 bytes, then nothing
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408") and "request body incomplete: 10 bytes" in answer, answer
    assert time.monotonic() - start < 10
    _still_serves(srv)
