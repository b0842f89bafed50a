"""The front end's output processor: the core's token ids become text, stop strings end
requests, and the request metrics are recorded -- once, for the in-process engine and for a
core in its own process alike (vLLM V1's `OutputProcessor`).

Per request it holds the detokenizer (detokenize.py: incremental, stop strings
held back until they cannot match, and checked only once `min_tokens` tokens
are out, as vLLM does), the sink, the timestamps for queue time / TTFT /
inter-token latency, and whether the prompt still counts against the queue
limits. A request ends here exactly once -- on the core's finish reason (EOS,
length, abort, error), on a stop string (the front end then asks the core to
abort it, as the core would go on), on a failure of its own output (its text,
its sink: it alone ends), or when the core dies.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moeflow.serving.detokenize import Detokenizer
from moeflow.serving.request import CoreOutput, Delta, Sink, StepOutputs

if TYPE_CHECKING:
    from moeflow.serving.metrics import ServingMetrics
    from moeflow.serving.scheduler import QueueLimits

log = logging.getLogger("moeflow.serving")


@dataclass(eq=False)
class RequestState:
    """A request in flight, as the front end tracks it."""

    model_name: str
    num_prompt: int
    sink: Sink
    detok: Detokenizer
    arrival: float
    queued: bool = True  # counted in the queue limits until admitted or finished
    generated: int = 0
    last_token_at: float | None = None


class OutputProcessor:
    """Turns the core's step outputs into deltas on the requests' sinks (one thread at a time:
    the in-process engine's thread, or the reader thread of a core process's client).

    Args:
        tokenizer: the served tokenizer (transformers).
        limits: the front end's queue limits (a prompt is released once admitted or finished).
        metrics: optional ServingMetrics (moeflow.serving.metrics).
    """

    def __init__(self, tokenizer: Any, limits: "QueueLimits", metrics: "ServingMetrics | None" = None):
        self.tokenizer, self.limits, self.metrics = tokenizer, limits, metrics
        self._lock = threading.Lock()  # the requests: added by submitters, ended by the processing thread
        self.requests: dict[str, RequestState] = {}

    def add(self, req_id: str, model_name: str, num_prompt: int, sink: Sink, stops: list[str],
            min_tokens: int) -> None:
        """Track a new request (before it reaches the core, so none of its outputs can be missed)."""
        state = RequestState(model_name, num_prompt, sink, Detokenizer(self.tokenizer, stops, min_tokens),
                             time.monotonic())
        with self._lock:
            self.requests[req_id] = state

    def drop(self, req_id: str) -> None:
        """Forget a request the core never got (its submit failed); its queue slot is freed."""
        with self._lock:
            state = self.requests.pop(req_id, None)
        if state is not None:
            self._dequeue(state)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def process(self, step: StepOutputs) -> list[str]:
        """Hand a core step's outputs to their requests.

        Returns:
            requests ended here that the core still runs (a stop string, a failed output):
            the caller aborts them in the core.
        """
        now = time.monotonic()
        for req_id in step.admitted:
            state = self.requests.get(req_id)
            if state is not None and state.queued:
                self._dequeue(state)
                if self.metrics:
                    self.metrics.queue_time(state.model_name, now - state.arrival)
        aborts = []
        for out in step.outputs:
            state = self.requests.get(out.req_id)
            if state is None:
                continue  # ended here already (a stop string): the core's last words about it
            try:
                if self._output(out.req_id, state, out, now):
                    aborts.append(out.req_id)
            except Exception as exc:  # this request's fault (its text, its sink): it alone ends
                log.warning("request %s failed in the output processor: %s", out.req_id, exc)
                self._end(out.req_id, state, Delta([], "", finish_reason="error", error=f"output failed: {exc}",
                                                   prompt_tokens=state.num_prompt,
                                                   completion_tokens=state.generated))
                aborts.append(out.req_id)
        return aborts

    def _output(self, req_id: str, state: RequestState, out: CoreOutput, now: float) -> bool:
        """One core output of one request; True when a stop string ended it (the core goes on)."""
        reason, ids, lps = out.finish_reason, out.token_ids, out.logprobs
        stopped = False
        if ids:
            self._dequeue(state)
            if self.metrics:
                if state.last_token_at is None:
                    self.metrics.first_token(state.model_name, now - state.arrival)
                else:
                    self.metrics.inter_token(state.model_name, now - state.last_token_at)
            state.last_token_at = now
            for i, tok in enumerate(ids):
                last = reason if i == len(ids) - 1 else None
                state.generated += 1
                # an EOS adds no text
                if state.detok.add(None if last == "stop" else tok, final=last is not None):
                    stopped = reason is None  # a stop string: the core would go on
                    reason, ids, lps = "stop", ids[:i + 1], lps[:i + 1]
                    break
        delta = Delta(ids, state.detok.take(final=reason is not None) if ids else "", lps,
                      prompt_logprobs=out.prompt_logprobs, finish_reason=reason, error=out.error,
                      prompt_tokens=state.num_prompt, completion_tokens=state.generated)
        if reason is None:
            state.sink(delta)
        else:
            self._end(req_id, state, delta)
        return stopped

    def _dequeue(self, state: RequestState) -> None:
        if state.queued:
            state.queued = False
            self.limits.release(state.num_prompt)

    def _end(self, req_id: str, state: RequestState, delta: Delta) -> None:
        """A request's last delta (once): metrics, the queue slot, the sink."""
        with self._lock:
            if self.requests.pop(req_id, None) is None:
                return
        self._dequeue(state)
        if self.metrics:
            self.metrics.finished(state.model_name, delta.finish_reason or "error", time.monotonic() - state.arrival,
                                  state.num_prompt, state.generated)
        try:
            state.sink(delta)
        except Exception:  # a sink whose client went away must not stop the others
            log.debug("sink for %s failed", req_id, exc_info=True)

    def fail_all(self, error: str) -> None:
        """The core is gone: every request in flight ends with `error`."""
        with self._lock:
            items = list(self.requests.items())
        for req_id, state in items:
            self._end(req_id, state, Delta([], "", finish_reason="error", error=error,
                                           prompt_tokens=state.num_prompt, completion_tokens=state.generated))
