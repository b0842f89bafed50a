"""Deltas from the engine thread to the request's event loop (used by `Service.generate`).

`Chunker` is a request's sink on the engine thread: it joins the request's deltas into
the chunks the client gets (deploy.stream_interval). `Mailbox` hands them to one event
loop with one wake-up for many. `join_deltas` merges what a slow reader left queued.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

from moeflow.serving.request import Delta


class Mailbox:
    """Deltas from the engine thread to one event loop, one wake-up for many.

    A step emits a delta per running request; waking the loop for each
    (`call_soon_threadsafe` per delta) costs a pipe write and a GIL hand-over
    each, which on a busy replica takes more CPU than the decode step itself.
    Deltas posted while a delivery is pending ride along with it.
    """

    _boxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
    _boxes_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # weak: the box is the value of a dict keyed weakly by the loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Delta]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "Mailbox":
        with cls._boxes_lock:
            box = cls._boxes.get(loop)
            if box is None:
                box = cls._boxes[loop] = cls(loop)
            return box

    def post(self, q: asyncio.Queue, delta: Delta) -> None:
        """Engine thread: queue a delta for `q`; wake the loop unless a delivery is pending."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            return  # nobody is listening any more
        with self.lock:
            self.pending.append((q, delta))
            wake = len(self.pending) == 1
        if wake:
            try:
                loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop closed meanwhile: drop what it will never read
                with self.lock:
                    self.pending.clear()

    def _deliver(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for q, delta in items:
            q.put_nowait(delta)


class Chunker:
    """A request's sink on the engine thread: joins its deltas into the chunks the client gets.

    Streamed: the first token goes at once (TTFT), then chunks of `interval` tokens (vLLM's
    --stream-interval), the last one whatever it holds. Not streamed (`interval` None): one
    delta at the end. Joining here, not in the event loop, wakes the loop once per chunk
    instead of once per token: the loop and the engine share one GIL, and every wake-up
    costs the engine's forward a hand-over. A chunk is gathered in lists (linear in its length).
    """

    def __init__(self, post, interval: int | None):
        self.post, self.interval = post, interval
        self.first: Delta | None = None  # the chunk's first delta; later ones are gathered below
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list = []
        self.sent = False

    def __call__(self, delta: Delta) -> None:
        if self.first is None:
            self.first = delta
            self.tokens, self.texts, self.logprobs = list(delta.token_ids), [delta.text], list(delta.logprobs)
        else:
            self.tokens += delta.token_ids
            self.texts.append(delta.text)
            self.logprobs += delta.logprobs
        if delta.finish_reason is None and (self.interval is None or
                                             (self.sent and len(self.tokens) < self.interval)):
            return
        first, self.first, self.sent = self.first, None, True
        self.post(Delta(self.tokens, "".join(self.texts), self.logprobs,
                        prompt_logprobs=first.prompt_logprobs, finish_reason=delta.finish_reason,
                        error=delta.error, prompt_tokens=delta.prompt_tokens,
                        completion_tokens=delta.completion_tokens))


def join_deltas(a: Delta, b: Delta) -> Delta:
    """Two consecutive deltas of one request as one (b is the later)."""
    return Delta(a.token_ids + b.token_ids, a.text + b.text, a.logprobs + b.logprobs,
                 prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                 finish_reason=b.finish_reason, error=b.error, prompt_tokens=b.prompt_tokens,
                 completion_tokens=b.completion_tokens)
