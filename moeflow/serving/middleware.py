"""The HTTP API's ASGI middleware (`Gate`): the API key on the /v1 routes, /tokenize and
/detokenize (401), and the request body's limit (413) and pace (408), before any parsing.
Added to the app by api.create_app.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys

from fastapi import HTTPException

BODY_IDLE_S = 15.0  # a request body that stops arriving for this long is a 408


class Gate:
    """Pure ASGI middleware (no task group, so errors raised while reading the body reach the
    handlers): the API key on /v1 routes (401), and the body limit (413 before parsing).

    With an API key set, /metrics and /health stay open for scrapers and probes, as in vLLM.
    """

    def __init__(self, app, limit: int, api_key: str | None):
        self.app, self.limit, self.key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key and scope["path"].startswith(("/v1", "/tokenize", "/detokenize")):
            # RFC 9110: the scheme is case-insensitive (`bearer KEY` is what some clients send)
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key.encode()):
                return await _send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                         "AuthenticationError")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, 413, f"request body larger than {self.limit} bytes", "BadRequestError")
        seen, whole = 0, False

        async def counted():  # a chunked body without content-length: count as it arrives
            nonlocal seen, whole
            if whole:  # after the body: Starlette waits here for the client's disconnect, unbounded
                return await receive()
            # a body that stops coming (Content-Length larger than sent) held its connection 90 s+.
            # asyncio.timeout, not wait_for: wait_for runs receive() as a task of its own, so every
            # request yielded its turn here even with its body already read, and a burst of 16
            # reached the engine only after all 16 had passed this gate (docs/serving.md, session 8)
            try:
                if sys.version_info >= (3, 11):
                    async with asyncio.timeout(BODY_IDLE_S):
                        message = await receive()
                else:  # Python 3.10 has no asyncio.timeout
                    message = await asyncio.wait_for(receive(), BODY_IDLE_S)
            except asyncio.TimeoutError:  # TimeoutError itself from 3.11
                raise HTTPException(408, f"request body incomplete: {seen} bytes arrived, then nothing "
                                         f"for {BODY_IDLE_S:.0f} s") from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI passes an HTTPException raised while reading the body through
                raise HTTPException(413, f"request body larger than {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


async def _send_error(send, status: int, message: str, kind: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
