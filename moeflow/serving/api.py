"""OpenAI-compatible HTTP API (FastAPI) over the engine: the Ray Serve ingress.

Routes (vLLM's names): GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (`stream: true` -> server-sent events),
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /v1/expert_load,
GET /metrics (Prometheus), GET /health. With an API key set, every /v1 route
needs `Authorization: Bearer <key>`; /metrics and /health stay open for
scrapers and probes, as in vLLM.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`:
400 bad field values (naming the field), 401 missing/wrong key, 404 unknown
model (listing the available ones).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from moeflow.errors import UserError
from moeflow.serving.engine import Delta, SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError",
                             404: "NotFoundError", 409: "ConflictError"}.get(status, "InternalServerError")


# ------------------------------------------------------------------ request schemas


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, n=1, ...)

    model: str
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM extension, used by benchmarks for fixed output lengths


class CompletionRequest(_Req):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Req):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = None


class LoadLoraRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    lora_name: str


# ------------------------------------------------------------------ app


def create_app(service) -> FastAPI:
    """FastAPI app over a `moeflow.serving.app.Service` (engine, tokenizer, names)."""
    app = FastAPI(title="moeflow", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(UserError)
    async def _user_error(_req: Request, exc: UserError):
        return _error(400, str(exc), None, "BadRequestError")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        return _error(400, f"{field}: {err['msg']}", field, "BadRequestError")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        key = service.api_key
        if key and request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {key}".encode()):
                return _error(401, "missing or invalid API key (Authorization: Bearer <key>)", None,
                              "AuthenticationError")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics():
        return Response(service.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": service.model_cards()}

    @app.get("/v1/expert_load")
    async def expert_load():
        return service.expert_load()

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLoraRequest):
        await service.load_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLoraRequest):
        await service.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _completions(service, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        return await _chat(service, body)

    return app


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _params(service, body: _Req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None) -> SamplingParams:
    if body.n != 1:
        raise APIError(400, "n: only n=1 is supported", "n")
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
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
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          seed=body.seed, stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          ignore_eos=body.ignore_eos)


def _prompts(service, prompt) -> list[list[int]]:
    """Normalise the four OpenAI prompt forms to token-id lists."""
    if isinstance(prompt, str):
        return [service.tokenize(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", "prompt")
    return [service.tokenize(p) if isinstance(p, str) else list(p) for p in prompt]


async def _completions(service, body: CompletionRequest):
    served, adapter = service.resolve_model(body.model)
    prompts = _prompts(service, body.prompt)
    for ids in prompts:
        if not ids:
            raise APIError(400, "prompt: must not be empty", "prompt")
        service.check_ids(ids)
    params = [_params(service, body, len(ids), body.max_tokens if body.max_tokens is not None else 16,
                      body.logprobs, body.logprobs if body.echo and body.logprobs is not None else None)
              for ids in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = [service.generate(f"{rid}-{i}", ids, p, adapter, served) for i, (ids, p) in
               enumerate(zip(prompts, params))]
    if body.stream:
        return _sse(_completion_chunks(service, body, rid, served, prompts, streams))
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
    for i, (ids, stream) in enumerate(zip(prompts, streams)):
        deltas = [d async for d in stream]
        _raise_engine_error(deltas)
        choices.append(_completion_choice(service, body, i, ids, deltas))
        usage["prompt_tokens"] += len(ids)
        usage["completion_tokens"] += deltas[-1].completion_tokens
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served,
            "choices": choices, "usage": usage}


def _raise_engine_error(deltas: list[Delta]) -> None:
    if deltas and deltas[-1].finish_reason == "error":
        raise APIError(500, deltas[-1].error or "engine error")


def _completion_choice(service, body: CompletionRequest, index: int, ids: list[int],
                       deltas: list[Delta]) -> dict:
    text = "".join(d.text for d in deltas)
    logprobs = None
    if body.logprobs is not None:
        entries = [e for d in deltas for e in d.logprobs]
        if body.echo:
            entries = list(deltas[0].prompt_logprobs or []) + entries
        logprobs = _completion_logprobs(service, entries)
    if body.echo:
        text = service.detokenize(ids) + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason}


def _completion_logprobs(service, entries: list) -> dict:
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


async def _completion_chunks(service, body, rid, served, prompts, streams) -> AsyncIterator[dict]:
    created, completion = int(time.time()), 0
    for i, stream in enumerate(streams):
        async for d in stream:
            if d.finish_reason == "error":
                yield {"error": {"message": d.error, "type": "InternalServerError", "code": 500}}
                return
            lp = _completion_logprobs(service, d.logprobs) if body.logprobs is not None else None
            yield {"id": rid, "object": "text_completion", "created": created, "model": served,
                   "choices": [{"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}]}
            if d.finish_reason:
                completion += d.completion_tokens
    if (body.stream_options or {}).get("include_usage"):
        prompt = sum(len(p) for p in prompts)
        yield {"id": rid, "object": "text_completion", "created": created, "model": served, "choices": [],
               "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}}


async def _chat(service, body: ChatRequest):
    served, adapter = service.resolve_model(body.model)
    messages = [m.model_dump() for m in body.messages]
    if any(isinstance(m["content"], list) for m in messages):  # image decoding is CPU work: off the loop
        ids, image = await asyncio.to_thread(service.chat_prompt, messages)
    else:
        ids, image = service.chat_prompt(messages)
    top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _params(service, body, len(ids), max_tokens, top, None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = service.generate(rid, ids, params, adapter, served, image)
    if body.stream:
        return _sse(_chat_chunks(service, body, rid, served, len(ids), stream))
    deltas = [d async for d in stream]
    _raise_engine_error(deltas)
    logprobs = {"content": _chat_logprobs(service, [e for d in deltas for e in d.logprobs])} \
        if body.logprobs else None
    done = deltas[-1]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                         "logprobs": logprobs, "finish_reason": done.finish_reason}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": done.completion_tokens,
                      "total_tokens": len(ids) + done.completion_tokens}}


def _chat_logprobs(service, entries: list) -> list[dict]:
    def item(tok, lp):
        piece = service.detokenize([tok])
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
    return [dict(item(tok, lp), top_logprobs=[item(t, v) for t, v in top]) for tok, lp, top in entries]


async def _chat_chunks(service, body, rid, served, prompt_len, stream) -> AsyncIterator[dict]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": served}
    yield dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])
    completion = 0
    async for d in stream:
        if d.finish_reason == "error":
            yield {"error": {"message": d.error, "type": "InternalServerError", "code": 500}}
            return
        lp = {"content": _chat_logprobs(service, d.logprobs)} if body.logprobs else None
        yield dict(base, choices=[{"index": 0, "delta": {"content": d.text} if d.text else {},
                                   "logprobs": lp, "finish_reason": d.finish_reason}])
        completion = d.completion_tokens
    if (body.stream_options or {}).get("include_usage"):
        yield dict(base, choices=[], usage={"prompt_tokens": prompt_len, "completion_tokens": completion,
                                            "total_tokens": prompt_len + completion})


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")
