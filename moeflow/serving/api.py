"""OpenAI-compatible HTTP API (FastAPI) over the engine: the Ray Serve ingress.

Routes (vLLM's names): GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (`stream: true` -> server-sent events),
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /v1/expert_load,
GET /metrics (Prometheus), GET /health. With an API key set, every /v1 route
needs `Authorization: Bearer <key>`; /metrics and /health stay open for
scrapers and probes, as in vLLM.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`
everywhere (unknown routes and undecodable bodies included): 400 bad field
values (naming the field; request schemas in schemas.py), 401 missing/wrong
key, 404 unknown model (listing the available ones), 413 body too large, 429
queue full, 503 engine stopped (api_errors.py: the statuses and handlers).
Back-pressure: the body limit (middleware.py's Gate, with the API key), at most
MAX_PROMPTS prompts per request, the engine's queue limits, and tokenisation in
a worker thread so big prompts never block the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response

from moeflow import __version__
from moeflow.core.errors import UserError
from moeflow.serving.adapter_sync import AdapterGate
from moeflow.serving.api_errors import APIError, error_status, install_handlers, stream_error
from moeflow.serving.event_stream import EventStream, Last
from moeflow.serving.middleware import Gate
from moeflow.serving.request import Delta, PromptLogprob
from moeflow.serving.sampling import SamplingParams
from moeflow.serving.schemas import (
    MAX_PROMPTS,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
    errors,
    true_openapi,
)
from moeflow.serving.service import Service

_V1 = errors(400, 401, 404, 413, 429, 503)  # what every generation route may answer besides 200
_GEN_OK = {200: {"description": "a completion object, or server-sent events with `stream: true`",
                 "content": {"application/json": {"schema": {"type": "object"}},
                             "text/event-stream": {"schema": {"type": "string"}}}}}


# ------------------------------------------------------------------ app


def create_app(service: Service) -> FastAPI:
    """FastAPI app over a `moeflow.serving.app.Service` (engine, tokenizer, names)."""
    app = FastAPI(title="moeflow", docs_url=None, redoc_url=None)
    install_handlers(app)

    @app.get("/health", response_class=PlainTextResponse, responses=errors(503),
             description="`ok` while the engine serves; 503 once it stopped (the replica is replaced)")
    async def health():
        service.engine.health()  # EngineDead: 503
        return PlainTextResponse("ok")

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics():
        return Response(service.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=errors(401))
    async def models():
        return {"object": "list", "data": service.model_cards()}

    @app.get("/v1/models/{model_id:path}", responses=errors(401, 404))
    async def model(model_id: str):
        card = next((c for c in service.model_cards() if c["id"] == model_id), None)
        if card is None:
            available = ", ".join(c["id"] for c in service.model_cards())
            raise APIError(404, f"The model `{model_id}` does not exist. Available models: {available}", "model")
        return card

    @app.get("/version", description="the server's version (vLLM's /version)")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize", responses=errors(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest):
        return await _tokenize(service, body)

    @app.post("/detokenize", responses=errors(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        await service.resolve(body.model)  # an unknown model is a 404, as on every model route
        service.check_ids(body.tokens)
        return {"prompt": await asyncio.to_thread(service.detokenize, body.tokens)}

    @app.get("/v1/expert_load", responses=errors(401))
    async def expert_load():
        return service.expert_load()

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses=errors(400, 401, 403, 409, 413, 503))
    async def load_lora(body: LoadLoraRequest):
        await service.load_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses=errors(400, 401, 404, 409, 413, 503))
    async def unload_lora(body: UnloadLoraRequest):
        await service.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions", responses=_GEN_OK | _V1)
    async def completions(body: CompletionRequest):
        return await _completions(service, body)

    @app.post("/v1/chat/completions", responses=_GEN_OK | _V1)
    async def chat(body: ChatRequest):
        return await _chat(service, body)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = true_openapi(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's way to replace the schema
    app.add_middleware(Gate, limit=service.settings.max_request_bytes, api_key=service.api_key)
    return app


async def _tokenize(service: Service, body: "TokenizeRequest") -> dict:
    """vLLM's /tokenize: a prompt (or chat messages through the chat template) to token ids."""
    await service.resolve(body.model)
    if body.messages is not None:
        ids, _ = await asyncio.to_thread(service.chat_prompt, [m.model_dump() for m in body.messages])
    else:
        text = body.prompt
        ids = await asyncio.to_thread(
            lambda: service.tokenizer(text, add_special_tokens=body.add_special_tokens).input_ids)
    limit = service.engine.max_model_len
    return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None}


def _params(service: Service, body: CompletionRequest | ChatRequest, prompt_len: int, max_tokens: int | None,
            logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    limit = service.engine.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, "
                            f"but the prompt has {prompt_len} tokens", "messages" if
                       isinstance(body, ChatRequest) else "prompt")
    if max_tokens is None:
        max_tokens = limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for "
                            f"the completion)", "max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            seed=body.seed, stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                            ignore_eos=body.ignore_eos, top_k=body.top_k or 0, min_p=body.min_p,
                            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                            presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0)
    try:
        params.check()  # the schema bounds them already; this is the engine's own word
    except UserError as exc:
        raise APIError(400, str(exc), str(exc).split(":")[0]) from None
    return params


async def _prompts(service: Service, prompt: Any) -> list[list[int]]:
    """Normalise the four OpenAI prompt forms to token-id lists (tokenising in a worker thread)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        ids = await asyncio.to_thread(service.tokenize, p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt: must not be empty", "prompt")
        service.check_ids(ids)
        out.append(ids)
    return out


async def _completions(service: Service, body: CompletionRequest) -> Any:
    async with service.gate.use(AdapterGate.key(body.model)):  # an unload comes wholly before or after
        served, adapter = await service.resolve(body.model)
        prompts = await _prompts(service, body.prompt)
        if len(prompts) * body.n > MAX_PROMPTS:
            raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} choices is more than {MAX_PROMPTS}", "n")
        expanded = [p for p in prompts for _ in range(body.n)]  # choice index = prompt * n + j (OpenAI)
        params = [_params(service, body, len(ids), body.max_tokens if body.max_tokens is not None else 16,
                          body.logprobs, body.logprobs if body.echo and body.logprobs is not None else None)
                  for ids in prompts]
        params = _choices(params, body.n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [f"{rid}-{i}" for i in range(len(expanded))]
        streams = service.generate_many(ids, expanded, params, adapter, served, stream=body.stream)
    if body.stream:
        return _sse(_completion_chunks(service, body, rid, served, prompts, streams), service, ids)
    try:  # all prompts at once; the first failure aborts its siblings (finally)
        results = await asyncio.gather(*[_collect(s) for s in streams])
    finally:
        service.abort(ids)
    choices = [_completion_choice(service, body, i, ids_i, deltas)
               for i, (ids_i, deltas) in enumerate(zip(expanded, results))]
    usage = {"prompt_tokens": sum(len(p) for p in prompts),  # each prompt counted once, as vLLM does
             "completion_tokens": sum(deltas[-1].completion_tokens for deltas in results)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served,
            "choices": choices, "usage": usage}


def _choices(params: list[SamplingParams], n: int) -> list[SamplingParams]:
    """Each prompt's params n times; with a seed s, choice j draws from seed s + j (as vLLM's
    parallel sampling), so the n choices differ yet repeat run to run."""

    return [p if p.seed is None else dataclasses.replace(p, seed=p.seed + j)
            for p in params for j in range(n)]


async def _collect(stream) -> list[Delta]:
    deltas = [d async for d in stream]
    _raise_engine_error(deltas)
    return deltas


def _raise_engine_error(deltas: list[Delta]) -> None:
    if deltas and deltas[-1].finish_reason == "error":
        raise APIError(error_status(deltas[-1].error), deltas[-1].error or "engine error")


def _completion_choice(service: Service, body: CompletionRequest, index: int, ids: list[int],
                       deltas: list[Delta]) -> dict:
    text = "".join(d.text for d in deltas)
    logprobs = None
    if body.logprobs is not None:
        entries: list[PromptLogprob] = [e for d in deltas for e in d.logprobs]
        if body.echo:
            entries = list(deltas[0].prompt_logprobs or []) + entries
        logprobs = _completion_logprobs(service, entries)
    if body.echo:
        text = service.detokenize(ids) + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason}


def _completion_logprobs(service: Service, entries: list) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets, pos = [], [], [], [], 0
    for tok, lp, top in entries:
        piece = service.detokenize([tok])
        tokens.append(piece)
        token_lps.append(lp)
        tops.append({service.detokenize([t]): v for t, v in top} if lp is not None else None)
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _interleaved(streams: list) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) of several prompts' streams in the order the deltas arrive, as
    vLLM streams the choices of a multi-prompt request (prompt 2 does not wait for prompt 1)."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for d in stream:
                q.put_nowait((i, d))
        finally:
            q.put_nowait((i, None))  # this prompt is done, however its stream ended
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, d = await q.get()
            if d is None:
                live -= 1
            else:
                yield i, d
    finally:  # the client went away or a prompt failed: the other prompts' streams end (abort)
        for task in tasks:
            task.cancel()


async def _completion_chunks(service: Service, body: CompletionRequest, rid: str, served: str,
                             prompts: list[list[int]], streams: list) -> AsyncIterator[dict]:
    created, completion = int(time.time()), 0
    async for i, d in _interleaved(streams):
        if d.finish_reason == "error":
            yield stream_error(d.error)
            return
        lp = _completion_logprobs(service, d.logprobs) if body.logprobs is not None else None
        yield {"id": rid, "object": "text_completion", "created": created, "model": served,
               "choices": [{"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}]}
        if d.finish_reason:
            completion += d.completion_tokens
    if body.stream_options is not None and body.stream_options.include_usage:
        prompt = sum(len(p) for p in prompts)
        yield {"id": rid, "object": "text_completion", "created": created, "model": served, "choices": [],
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}}


async def _chat(service: Service, body: ChatRequest) -> Any:
    async with service.gate.use(AdapterGate.key(body.model)):  # an unload comes wholly before or after
        served, adapter = await service.resolve(body.model)
        messages = [m.model_dump() for m in body.messages]
        ids, image = await asyncio.to_thread(service.chat_prompt, messages)  # templating, images: off the loop
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _choices([_params(service, body, len(ids), max_tokens, top, None)], body.n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        rids = [rid] if body.n == 1 else [f"{rid}-{j}" for j in range(body.n)]
        streams = service.generate_many(rids, [ids] * body.n, params, adapter, served, image, stream=body.stream)
    if body.stream:
        return _sse(_chat_chunks(service, body, rid, served, len(ids), streams), service, rids)
    try:
        results = await asyncio.gather(*[_collect(s) for s in streams])
    finally:
        service.abort(rids)
    choices = []
    for j, deltas in enumerate(results):
        logprobs = {"content": _chat_logprobs(service, [e for d in deltas for e in d.logprobs])} \
            if body.logprobs else None
        choices.append({"index": j, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                        "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason})
    completion = sum(deltas[-1].completion_tokens for deltas in results)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served,
            "choices": choices, "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                                          "total_tokens": len(ids) + completion}}


def _chat_logprobs(service: Service, entries: list) -> list[dict]:
    def item(tok, lp):
        piece = service.detokenize([tok])
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
    return [dict(item(tok, lp), top_logprobs=[item(t, v) for t, v in top]) for tok, lp, top in entries]


async def _chat_chunks(service: Service, body: ChatRequest, rid: str, served: str, prompt_len: int,
                       streams: list) -> AsyncIterator[dict]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": served}
    for j in range(len(streams)):
        yield dict(base, choices=[{"index": j, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}])
    completion = 0
    async for j, d in _interleaved(streams):
        if d.finish_reason == "error":
            yield stream_error(d.error)
            return
        lp = {"content": _chat_logprobs(service, d.logprobs)} if body.logprobs else None
        yield dict(base, choices=[{"index": j, "delta": {"content": d.text} if d.text else {},
                                   "logprobs": lp, "finish_reason": d.finish_reason}])
        if d.finish_reason:
            completion += d.completion_tokens
    if body.stream_options is not None and body.stream_options.include_usage:
        yield dict(base, choices=[], usage={"prompt_tokens": prompt_len, "completion_tokens": completion,
                                            "total_tokens": prompt_len + completion})


def _sse(chunks: AsyncIterator[dict], service: Service, req_ids: list[str]) -> EventStream:
    """Server-sent events; when the client goes away (or a sibling fails) every prompt is aborted.

    Once every choice has finished, the rest (the chunk that finished the last one, the usage
    chunk, `[DONE]`) follows without waiting on the engine, so it goes as one write: each write is
    a send to the ingress and a wake-up of it and of the client (issue 51: about 1 in 3 of a short
    completion's writes); marked `Last`, it also carries the end of the body (event_stream.py)."""
    async def body():
        finished, tail = 0, []
        try:
            async for chunk in chunks:
                event = f"data: {json.dumps(chunk)}\n\n"
                finished += sum(1 for c in chunk.get("choices", ()) if c.get("finish_reason"))
                if finished >= len(req_ids):
                    tail.append(event)
                else:
                    yield event
            yield Last("".join(tail) + "data: [DONE]\n\n")
        finally:
            service.abort(req_ids)
    return EventStream(body())
