"""The streamed completion's HTTP response: server-sent events, aborted when the client goes away.

Starlette's `StreamingResponse` does two things per response that a busy replica pays for
(issue 51, py-spy of a served burst: the task group below, about a tenth of the replica's CPU
per request; and one write per response):

- Under a server that speaks ASGI 2.3 (uvicorn, as Ray Serve runs it) it watches for the
  client's disconnect in an anyio task group: a cancel scope, a task spawned through anyio's
  naming and bookkeeping, and a cancellation delivered through the scope when either side ends.
  `EventStream` watches with one plain asyncio task instead, and cancels the streaming task
  itself when the client has gone (what the task group's scope did).
- It ends every response with an empty body message, and uvicorn writes each body message as
  a send of its own: the chunked encoding's terminator cost one more write per response to
  the ingress (and a wake-up of it and of the client). A stream whose last chunk is marked
  (`Last`) sends it with `more_body: False`, so the terminator goes in the same write.

Behaviour is otherwise Starlette's: headers when the response starts, one body message per
chunk, the client's disconnect stops the stream (its generator's `finally` runs), and an
exception in the generator, or in `receive` while watching, propagates to the app's error
handling (the stream stopped first).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class Last(str):
    """A stream's final chunk: sent with the end of the body in one message."""


class EventStream(StreamingResponse):
    """`text/event-stream` over an async iterator of str chunks (the last may be `Last`)."""

    def __init__(self, chunks: AsyncIterator[str]):
        super().__init__(chunks, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None  # an ASGI app runs in a task
        state: dict = {"streaming": True, "gone": False, "error": None}

        async def watch() -> None:
            try:
                await self.listen_for_disconnect(receive)
            except Exception as exc:  # noqa: BLE001 - the server's receive failed: raised by the stream below
                state["error"] = exc
            if state["streaming"]:  # the client left mid-stream: stop it where it waits
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._stream(send, state)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise  # cancelled from outside (the server stopping): not ours to swallow
            uncancel = getattr(task, "uncancel", None)  # 3.11+: clear the request we made
            if uncancel is not None:
                uncancel()
            if state["error"] is not None:
                raise state["error"] from None  # the stream stopped for it; the cancel is ours
        finally:
            state["streaming"] = False
            watcher.cancel()

    async def _stream(self, send: Send, state: dict) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:  # to its end, after `Last` too: its `finally` runs here
            if ended:
                raise RuntimeError("an event stream yielded a chunk after its Last")
            ended = isinstance(chunk, Last)
            body = chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
            if ended:  # the response is complete: a disconnect from now on is the normal end
                state["streaming"] = False
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
