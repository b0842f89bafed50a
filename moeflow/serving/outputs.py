"""The output side of the engine: a sampled token becomes text, a finish reason and a `Delta`.

As vLLM's output processor: incremental detokenisation (detokenize.py) with
stop strings, the stop checks (EOS unless ignored, max_tokens, the context
length), logprobs of the raw logits, per-token latency metrics, and finishing
a request on every path (done, aborted, failed), after which its sink has
had its last delta and the scheduler no longer counts it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from moeflow.serving.detokenize import Detokenizer
from moeflow.serving.request import Delta, Sequence, TokenLogprob
from moeflow.serving.sampling import topk
from moeflow.serving.scheduler import Scheduler

if TYPE_CHECKING:
    from moeflow.serving.metrics import ServingMetrics

log = logging.getLogger("moeflow.serving")


class OutputProcessor:
    """Turns sampled tokens into deltas and finishes requests (the engine thread only).

    Args:
        tokenizer: the served tokenizer (transformers).
        scheduler: the engine's scheduler (a finished request leaves its queue counts).
        eos_ids: tokens that end a sequence unless its params ignore EOS.
        max_model_len: context length; a sequence that reaches it ends with `length`.
        metrics: optional ServingMetrics (moeflow.serving.metrics).
    """

    def __init__(self, tokenizer: Any, scheduler: Scheduler, eos_ids: set[int], max_model_len: int,
                 metrics: "ServingMetrics | None" = None):
        self.tokenizer, self.scheduler, self.metrics = tokenizer, scheduler, metrics
        self.eos_ids, self.max_model_len = eos_ids, max_model_len

    def detokenizer(self, stops: list[str]) -> Detokenizer:
        """A new request's detokenizer (its stop strings held back until they cannot match)."""
        return Detokenizer(self.tokenizer, stops)

    def token(self, seq: Sequence, tok: int, logits: torch.Tensor) -> None:
        """Record a sampled token, detokenize, emit; finish the request when it stops.

        Args:
            logits: the row's raw logits [V] (logprobs are of these, as vLLM's default).
        """
        now = time.monotonic()
        seq.tokens.append(tok)
        lps: list[TokenLogprob] = []
        if seq.params.logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)  # [V]
            lps.append((tok, lp[tok].item(), topk(lp, seq.params.logprobs)))
        if self.metrics:
            if seq.first_token_at is None or seq.last_token_at is None:
                self.metrics.first_token(seq.model_name, now - seq.arrival)
            else:
                self.metrics.inter_token(seq.model_name, now - seq.last_token_at)
        seq.first_token_at = seq.first_token_at or now
        seq.last_token_at = now
        reason = self._stop_reason(seq, tok)
        if seq.detok.add(None if reason == "stop" else tok, final=reason is not None):
            reason = "stop"  # a stop string
        delta = Delta([tok], seq.detok.take(final=reason is not None), lps, finish_reason=reason,
                      prompt_tokens=seq.num_prompt, completion_tokens=len(seq.out_ids))
        if len(seq.out_ids) == 1 and seq.params.prompt_logprobs is not None:
            delta.prompt_logprobs = seq.prompt_lp
        if reason:
            self.finish(seq, reason, delta=delta)
        else:
            seq.sink(delta)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        """stop (EOS), length (max_tokens or the context full) or None; stop strings: see token()."""
        if tok in self.eos_ids and not seq.params.ignore_eos:
            return "stop"
        if len(seq.out_ids) >= seq.params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str, error: str | None = None,
               delta: Delta | None = None) -> None:
        """End a request (once): its rows leave their batch, its sink gets the last delta."""
        if seq.finished:
            return
        seq.finished = True
        seq.kv = None  # its rows leave the batch at the next re-lay; a lone cache is freed now
        self.scheduler.dequeue(seq)
        if delta is None:
            delta = Delta([], "", finish_reason=reason, error=error, prompt_tokens=seq.num_prompt,
                          completion_tokens=len(seq.out_ids))
        if self.metrics:
            self.metrics.finished(seq.model_name, reason, time.monotonic() - seq.arrival,
                                  seq.num_prompt, len(seq.out_ids))
        try:
            seq.sink(delta)
        except Exception:  # a sink whose client went away must not break the step
            log.debug("sink for %s failed", seq.req_id, exc_info=True)
