"""Continuous-batching generation engine over a transformers model + PEFT LoRA.

Why hand-written: vLLM/SGLang (what Ray Serve LLM wraps) do not install on
CPU-only machines, and transformers' own continuous batching has no per-row
LoRA. This engine keeps the vLLM scheduling model on plain transformers:

- Continuous batching: every step, waiting requests join the running set
  (up to `max_num_seqs`) and finished ones leave; nothing waits for a batch.
- Chunked prefill: one step processes at most `max_num_batched_tokens`
  tokens; decodes are scheduled first (1 token each), prompts fill the rest in
  chunks (each at most `long_prefill_token_threshold`, and at most
  `max_long_partial_prefills` long prompts per step, so long prompts cannot
  take the whole step from short ones). Without chunking a prompt is prefilled
  whole in one step.
- KV cache per sequence ([1, kv_heads, L, head_dim] per layer). A decode step
  left-pads the running sequences' caches into one batch (pads masked out),
  runs one forward, and splits the grown cache back. Queries are never padded,
  so no token is computed twice and expert-load counts are exact.
- Mixed-adapter batches: one forward, each row adding its own adapter's LoRA delta
  (lora_batch.py, Punica-style gather + bmm) when
  every resident adapter is module LoRA; PEFT cannot mix expert LoRA
  (`target_parameters`), so then the batch runs one forward per adapter.
- Fault isolation: sampling fields are checked before queueing
  (sampling.py); a forward or sampling failure fails only the requests it
  belongs to (a failed decode batch is re-run row by row to find them); rows
  with non-finite logits fail alone. Finished sequences leave the running set
  on every path. An engine that keeps failing (or whose thread died) turns
  `dead`: every queued request is answered with an error, new ones are
  refused (EngineDead -> 503) and `check_health` fails so Ray Serve replaces
  the replica.
- No busy waiting: the loop sleeps on an event whenever nothing ran.

Axis legend: B rows, L cached tokens, C new tokens, V vocab.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moeflow.devices import model_device
from moeflow.errors import UserError
from moeflow.serving.adapters import BASE, AdapterRegistry, LoraSlots
from moeflow.serving.multimodal import ImagePrompt
from moeflow.serving.runner import ModelRunner, _length_buckets
from moeflow.serving.sampling import SamplingParams, find_stop, make_generator, sample, topk

__all__ = ["Delta", "Engine", "EngineConfig", "EngineDead", "SamplingParams"]

log = logging.getLogger("moeflow.serving")


@dataclass
class EngineConfig:
    """Engine knobs (vLLM names)."""

    max_num_seqs: int = 16  # running sequences per step
    max_num_batched_tokens: int = 512  # token budget per step (decodes + prefill chunks)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # per-prompt chunk cap; None: budget // 2
    max_long_partial_prefills: int = 1  # long prompts prefilled per step; shorter ones jump ahead
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_loras: int = 4  # resident adapters; least recently used evicted
    max_queued_tokens: int = 262144  # prompt tokens waiting for a slot; beyond: refused (429)
    max_waiting_seqs: int = 1024  # requests waiting for a slot; beyond: refused (429)
    failures_before_unhealthy: int = 8  # requests failed in a row with no success in between


class EngineDead(RuntimeError):
    """The engine cannot serve any more (the replica must be replaced)."""


class EngineBusy(UserError):
    """The queue is full: retry later (HTTP 429)."""


@dataclass
class Delta:
    """What one step produced for one request (sent to the request's sink)."""

    token_ids: list[int]
    text: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list | None = None  # [(token_id, logprob|None, top)] on the first delta
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Sequence:
    req_id: str
    model_name: str  # served name (metrics label)
    adapter: str | None
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    sink: Callable[[Delta], None]
    arrival: float = field(default_factory=time.monotonic)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, H, L, D]
    num_cached: int = 0
    generator: torch.Generator | None = None
    text: str = ""
    emitted: int = 0  # chars of text already sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_lp: list = field(default_factory=list)
    finished: bool = False
    image: ImagePrompt | None = None  # images in the prompt (multimodal models)
    queued: bool = False  # counted in the engine's queued tokens until admitted or finished

    @property
    def out_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def is_prefill(self) -> bool:
        return self.num_cached < self.num_prompt


class Engine(ModelRunner):
    """Schedules and runs generation; owns the model on its own thread.

    Args:
        model: a transformers causal LM (eval mode), shared by all adapters.
        tokenizer: its tokenizer (decoding, stop strings).
        config: EngineConfig.
        registry: servable adapters (None: base only).
        metrics: optional ServingMetrics (moeflow.serving.metrics).
        experts: optional ExpertLoad tracker hooked into the model.
    """

    def __init__(self, model, tokenizer, config: EngineConfig | None = None,
                 registry: AdapterRegistry | None = None, metrics=None, experts=None):
        self.base = model.eval()
        self.device = model_device(model)  # inputs are built on CPU and moved here in _run
        self.peft = None  # PeftModel once an adapter is loaded
        self._batched = None  # BatchedLora while only module LoRA is resident
        self._lora_dirty = True
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.registry = registry or AdapterRegistry()
        self.metrics, self.experts = metrics, experts
        self.max_model_len = self.config.max_model_len or model.config.get_text_config().max_position_embeddings
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.slots = LoraSlots(self.config.max_loras, self._load_adapter, self._unload_adapter)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._inbox: queue.Queue = queue.Queue()
        self._aborted: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.last_scheduled: dict[str, int] = {}
        self.dead: str | None = None  # why the engine stopped serving
        self._queue_lock = threading.Lock()
        self._queued_tokens = 0
        self._queued_seqs = 0
        self._fail_streak = 0  # requests failed since the last token produced
        self._step_errors = 0  # consecutive steps that raised outside per-request isolation

    # ------------------------------------------------------------ public API

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise UserError for a request that can never run (checked before queueing)."""
        if not prompt_ids:
            raise UserError("prompt: must not be empty")
        params.check()
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise UserError(f"This model's maximum context length is {self.max_model_len} tokens; "
                            f"the prompt has {len(prompt_ids)} and max_tokens is {params.max_tokens}")
        vocab = self.base.config.get_text_config().vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise UserError(f"prompt: token ids must be in [0, {vocab})")

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[Delta], None], adapter: str | None = None,
               model_name: str = "base", image: ImagePrompt | None = None) -> None:
        """Queue a request (thread-safe); deltas arrive on `sink` from the engine thread.

        `image`: the prompt's images (moeflow.serving.multimodal.prepare).
        """
        self.validate(prompt_ids, params)
        seq = Sequence(req_id, model_name, adapter, list(prompt_ids), len(prompt_ids), params, sink,
                       image=image, generator=make_generator(params.seed, self.device))
        self.reserve([len(prompt_ids)])
        seq.queued = True
        self._inbox.put(("seq", seq))
        self._wake.set()

    def reserve(self, lengths: list[int], dry_run: bool = False) -> None:
        """Count prompts against the queue limits (all or none); EngineBusy/EngineDead if refused.

        Args:
            lengths: prompt lengths in tokens.
            dry_run: only check (a multi-prompt request checks all before submitting any).
        """
        if self.dead is not None:
            raise EngineDead(f"the engine stopped serving: {self.dead}")
        cfg = self.config
        with self._queue_lock:
            tokens, seqs = self._queued_tokens + sum(lengths), self._queued_seqs + len(lengths)
            if seqs > cfg.max_waiting_seqs or (tokens > cfg.max_queued_tokens and self._queued_seqs):
                raise EngineBusy(f"server busy: {self._queued_seqs} requests ({self._queued_tokens} "
                                 f"prompt tokens) are waiting; retry later")
            if not dry_run:
                self._queued_tokens, self._queued_seqs = tokens, seqs

    def _dequeue(self, seq: Sequence) -> None:
        if seq.queued:
            seq.queued = False
            with self._queue_lock:
                self._queued_tokens -= seq.num_prompt
                self._queued_seqs -= 1

    def health(self) -> None:
        """Raise EngineDead when the engine cannot serve (Ray Serve's check_health)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise EngineDead("the engine thread died")

    def abort(self, req_id: str) -> None:
        """Stop a request (client went away); thread-safe."""
        self._inbox.put(("abort", req_id))
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread between steps (adapter load/unload)."""
        fut: Future = Future()
        self._inbox.put(("call", (fn, fut)))
        self._wake.set()
        if self._thread is None:  # no loop thread (unit tests): run inline
            self._drain_inbox()
        return fut

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moeflow-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    def run_until_idle(self, max_steps: int = 100000) -> None:
        """Step until nothing is waiting or running (tests, benchmarks without a thread)."""
        self._drain_inbox()
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                return
            self.step()
            self._drain_inbox()

    # ------------------------------------------------------------ loop

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                ran = self.dead is None and bool(self.waiting or self.running) and self._guarded_step()
                self._report_queue()
                if not ran:  # nothing runnable: sleep until a submit/abort/call (or a slot frees up)
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as exc:  # the thread is ending: nobody may wait forever
            self._die(f"engine thread crashed: {exc!r}")
            raise

    def _guarded_step(self) -> bool:
        """step(), containing a failure outside per-request isolation (a bug): fail the step's requests."""
        try:
            ran = self.step()
            self._step_errors = 0
            return ran
        except Exception as exc:
            log.exception("engine step failed")
            self._step_errors += 1
            for seq in self.running:
                self._finish(seq, "error", error=f"engine error: {exc}")
            self._prune()
            if self._step_errors >= 3:
                self._die(f"3 engine steps in a row failed, last: {exc}")
            return True

    def _die(self, reason: str) -> None:
        """Stop serving: answer every queued request with an error; health checks fail from now on."""
        if self.dead is None:
            log.error("engine unhealthy: %s", reason)
            self.dead = reason
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "seq":
                self.waiting.append(item)
            elif kind == "call":
                item[1].set_exception(EngineDead(reason))
        for seq in self.waiting + self.running:
            self._finish(seq, "error", error=f"the engine stopped serving: {reason}")
        self._prune()
        self._report_queue()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "seq" and self.dead is not None:
                self._finish(item, "error", error=f"the engine stopped serving: {self.dead}")
            elif kind == "seq":
                self.waiting.append(item)
            elif kind == "abort":
                for seq in self.waiting + self.running:
                    if seq.req_id == item:
                        self._finish(seq, "abort")
            else:
                fn, fut = item
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)
        self._prune()

    # ------------------------------------------------------------ adapters

    def busy_adapters(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter}

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (engine thread); refuses while requests use it."""
        if any(s.adapter == name for s in self.running + self.waiting):
            raise UserError(f"adapter {name!r} is in use by running requests; retry when they finish")
        self.registry.remove(name)
        self.slots.drop(name)

    # ------------------------------------------------------------ scheduling

    def _admit(self) -> None:
        """Move waiting sequences into the running set (FCFS, adapter slots permitting)."""
        still: list[Sequence] = []
        for seq in self.waiting:
            if seq.finished:
                continue
            if len(self.running) >= self.config.max_num_seqs:
                still.append(seq)
                continue
            if seq.adapter and not self._ensure_adapter(seq):
                still.append(seq)
                continue
            if seq.finished:  # its adapter could not be loaded
                continue
            if self.metrics:
                self.metrics.queue_time(seq.model_name, time.monotonic() - seq.arrival)
            self._dequeue(seq)
            self.running.append(seq)
        self.waiting = still

    def _prune(self) -> None:
        """Finished sequences leave the running and waiting sets (every path calls this)."""
        self.running = [s for s in self.running if not s.finished]
        self.waiting = [s for s in self.waiting if not s.finished]

    def _ensure_adapter(self, seq: Sequence) -> bool:
        spec = self.registry.get(seq.adapter)
        if spec is None:
            self._finish(seq, "error", error=f"adapter {seq.adapter!r} was unloaded")
            return True  # finished; the caller drops it
        try:
            return self.slots.acquire(spec, self.busy_adapters())
        except Exception as exc:  # a broken adapter fails its request, not the engine
            self._finish(seq, "error", error=f"cannot load adapter {seq.adapter!r}: {exc}")
            return True

    def _schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Pick this step's decodes and prefill chunks within the token budget."""
        budget = self.config.max_num_batched_tokens
        running = [s for s in self.running if not s.finished]
        decodes = [s for s in running if not s.is_prefill][:budget]
        budget -= len(decodes)
        cap = self.config.long_prefill_token_threshold or max(1, self.config.max_num_batched_tokens // 2)
        chunks: list[tuple[Sequence, int]] = []
        longs = 0
        for seq in (s for s in running if s.is_prefill):
            left = seq.num_prompt - seq.num_cached
            if not self.config.enable_chunked_prefill:
                if chunks and left > budget:
                    break  # whole prompts only; a first one always runs so nothing starves
                n = left
            else:
                if budget <= 0:
                    break
                if left > cap:  # a long prompt: only max_long_partial_prefills of them per step,
                    if longs >= self.config.max_long_partial_prefills:
                        continue  # so shorter prompts behind it jump ahead (vLLM's policy)
                    longs += 1
                n = min(left, budget, cap)
                if seq.image is not None:  # never split an image (its encoder runs on whole images)
                    n = seq.image.chunk_end(seq.num_cached, seq.num_cached + n) - seq.num_cached
            chunks.append((seq, n))
            budget -= n
        return decodes, chunks

    def step(self) -> bool:
        """One engine iteration: admit, schedule, run forwards, sample, emit.

        Returns:
            False when nothing was runnable (the loop then sleeps).
        """
        with torch.no_grad():  # not inference_mode: PEFT toggles requires_grad on adapter switches
            self._admit()
            self._prune()
            decodes, chunks = self._schedule()
            if not (decodes or chunks):
                return False
            # req_id -> tokens computed this step (introspection for tests and logs)
            self.last_scheduled = {s.req_id: 1 for s in decodes} | {s.req_id: n for s, n in chunks}
            if decodes:
                rows = self._forward_decode(decodes)  # [V] per sequence, None where it failed
                for seq, row in zip(decodes, rows):
                    if row is not None:
                        self._append_checked(seq, row)
            for seq, n in chunks:
                try:
                    last = self._forward_prefill(seq, n)  # [V] or None mid-prompt
                except Exception as exc:  # this prompt (its adapter, its images) failed: only it
                    self._fail(seq, "prefill", exc)
                    continue
                if last is not None:
                    self._append_checked(seq, last)
            self._prune()
            self.steps += 1
            if self.experts is not None:
                self.experts.step_done()
            return True

    def _append_checked(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample and emit for one row; a failure or non-finite logits fail this request only."""
        if not bool(torch.isfinite(logits).all()):
            adapter = f" with adapter {seq.adapter!r}" if seq.adapter else ""
            self._fail(seq, "sampling", RuntimeError(f"the model{adapter} produced non-finite logits"))
            return
        try:
            self._append_token(seq, logits)
        except Exception as exc:
            self._fail(seq, "sampling", exc)
            return
        self._fail_streak = 0

    def _fail(self, seq: Sequence, where: str, exc: Exception) -> None:
        """Fail one request (its own fault or an isolated one); many in a row: the engine is unwell."""
        log.warning("request %s failed in %s: %s", seq.req_id, where, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        self._finish(seq, "error", error=f"{where} failed: {exc}")
        self._fail_streak += 1
        if self._fail_streak >= self.config.failures_before_unhealthy:
            self._die(f"{self._fail_streak} requests failed in a row, last in {where}: {exc}")

    def _report_queue(self) -> None:
        if self.metrics:
            self.metrics.queue_sizes(self.running, self.waiting)

    # ------------------------------------------------------------ forwards

    def _forward_decode(self, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        """One decode token for each sequence. Returns logits [V] per sequence (None: it failed)."""
        groups: dict[str | None, list[int]] = {}
        mixable = self._lora_mode() != "peft"
        for i, seq in enumerate(seqs):
            groups.setdefault(None if mixable else (seq.adapter or BASE), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for idx in groups.values():
            for bucket in _length_buckets(idx, [seqs[i].num_cached for i in idx]):
                for i, row in zip(bucket, self._decode_isolated([seqs[i] for i in bucket])):
                    out[i] = row
        return out

    def _decode_isolated(self, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        """_decode_batch; if the batch fails, each row alone, so only the rows at fault fail.

        _decode_batch changes no sequence before its forward succeeds, so a re-run is safe.
        """
        try:
            return list(self._decode_batch(seqs))
        except Exception as exc:
            if len(seqs) == 1:
                self._fail(seqs[0], "decode", exc)
                return [None]
            log.warning("decode batch of %d failed (%s); re-running row by row", len(seqs), exc)
            return [row for seq in seqs for row in self._decode_isolated([seq])]

    # ------------------------------------------------------------ sampling and output

    def _append_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample, record, detokenize, emit."""
        tok = sample(seq.params, logits, seq.generator)
        now = time.monotonic()
        seq.tokens.append(tok)
        lps = []
        if seq.params.logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)  # [V]
            lps.append((tok, lp[tok].item(), topk(lp, seq.params.logprobs)))
        if self.metrics:
            if seq.first_token_at is None:
                self.metrics.first_token(seq.model_name, now - seq.arrival)
            else:
                self.metrics.inter_token(seq.model_name, now - seq.last_token_at)
        seq.first_token_at = seq.first_token_at or now
        seq.last_token_at = now
        reason = None
        if tok in self.eos_ids and not seq.params.ignore_eos:
            reason = "stop"
        elif len(seq.out_ids) >= seq.params.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        text_ids = seq.out_ids[:-1] if reason == "stop" else seq.out_ids
        seq.text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        hit = find_stop(seq.text, seq.params.stop)
        if hit is not None:
            seq.text, reason = seq.text[:hit], "stop"
        self._emit(seq, [tok], lps, reason)

    def _emit(self, seq: Sequence, toks: list[int], lps: list, reason: str | None) -> None:
        end = len(seq.text)
        if reason is None:
            hold = max((len(s) for s in seq.params.stop), default=1) - 1
            end -= hold  # may be the start of a stop string
            while end > seq.emitted and seq.text[end - 1] == "\ufffd":
                end -= 1  # incomplete UTF-8 sequence: wait for the next token
        delta = Delta(toks, seq.text[seq.emitted:max(end, seq.emitted)], lps,
                      finish_reason=reason, prompt_tokens=seq.num_prompt,
                      completion_tokens=len(seq.out_ids))
        if len(seq.out_ids) == 1 and seq.params.prompt_logprobs is not None:
            delta.prompt_logprobs = seq.prompt_lp
        seq.emitted = max(end, seq.emitted)
        if reason:
            self._finish(seq, reason, delta=delta)
        else:
            seq.sink(delta)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                delta: Delta | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.kv = None  # free the cache now
        self._dequeue(seq)
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
