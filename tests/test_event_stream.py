"""EventStream (moeflow/serving/event_stream.py): the streamed completion's response, driven as
an ASGI server drives it -- what it sends, and what a client's disconnect or a server's
cancellation does to the stream."""

from __future__ import annotations

import asyncio
import sys

import pytest

from moeflow.serving.event_stream import EventStream, Last

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


def _run(stream: EventStream, receive) -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        await asyncio.wait_for(stream(SCOPE, receive, send), 10)  # a stream that never stops fails here
        task = asyncio.current_task()
        if sys.version_info >= (3, 11):
            assert task.cancelling() == 0  # no cancel request of ours left behind on the server's task
        await asyncio.sleep(0)  # the task is still usable: a left-over cancel would raise here
    asyncio.run(main())
    return sent


async def _never_disconnects():
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_the_last_chunk_carries_the_end_of_the_body():
    async def chunks():
        yield "data: 1\n\n"
        yield Last("data: 2\n\ndata: [DONE]\n\n")
    sent = _run(EventStream(chunks()), _never_disconnects)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\n", True), (b"data: 2\n\ndata: [DONE]\n\n", False)]  # no empty message after it


def test_a_stream_without_last_ends_with_an_empty_body_message():
    async def chunks():
        yield "a"
        yield b"b"
    sent = _run(EventStream(chunks()), _never_disconnects)
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"a", True), (b"b", True), (b"", False)]


def test_the_generator_is_finished_after_its_last_chunk():
    closed = []

    async def chunks():
        try:
            yield Last("x")
        finally:
            closed.append(True)  # the API's abort of the request's sequences
    _run(EventStream(chunks()), _never_disconnects)
    assert closed == [True]


def test_a_chunk_after_last_is_refused():
    async def chunks():
        yield Last("x")
        yield "y"
    with pytest.raises(RuntimeError, match="after its Last"):
        _run(EventStream(chunks()), _never_disconnects)


def test_a_client_disconnect_stops_the_stream_where_it_waits():
    closed = []

    async def chunks():
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()  # the engine's next token never comes
            yield "unreachable"
        finally:
            closed.append(True)

    async def receive():
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}
    sent = _run(EventStream(chunks()), receive)
    assert closed == [True]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]  # nothing more is sent to a gone client


def test_a_disconnect_after_the_end_is_not_a_cancel():
    cleaned = []

    async def chunks():
        try:
            yield Last("x")
        finally:  # clean-up that waits: the client's disconnect (below) arrives meanwhile
            await asyncio.sleep(0.01)
            cleaned.append(True)

    async def receive():  # uvicorn answers http.disconnect at once once the response is complete
        return {"type": "http.disconnect"}
    sent = _run(EventStream(chunks()), receive)
    assert sent[-1] == {"type": "http.response.body", "body": b"x", "more_body": False}
    assert cleaned == [True]  # not cut short by a cancel meant for a client gone mid-stream


def test_a_cancel_from_outside_propagates():
    async def chunks():
        yield "a"
        await asyncio.Event().wait()
        yield "b"

    async def send(message):
        pass

    async def main():
        task = asyncio.ensure_future(EventStream(chunks())(SCOPE, _never_disconnects, send))
        await asyncio.sleep(0.01)
        task.cancel()  # the server stopping: not a disconnect, so not swallowed
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_a_failing_receive_stops_the_stream_and_raises():
    closed = []

    async def chunks():
        try:
            yield "a"
            await asyncio.Event().wait()
            yield "b"
        finally:
            closed.append(True)

    async def receive():  # the server's receive breaking while the stream waits for a token
        await asyncio.sleep(0.01)
        raise ConnectionError("receive broke")
    with pytest.raises(ConnectionError, match="receive broke"):
        _run(EventStream(chunks()), receive)
    assert closed == [True]
