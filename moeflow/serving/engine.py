"""Continuous-batching generation engine over a transformers model + PEFT LoRA.

Why hand-written: vLLM/SGLang (what Ray Serve LLM wraps) do not install on
CPU-only machines, and transformers' own continuous batching has no per-row
LoRA. This engine keeps vLLM's serving model on plain transformers, one
concern per module:

- scheduler.py: continuous batching, chunked prefill, queue limits (vLLM's
  knobs and policy);
- kv_cache.py: the KV cache as persistent left-padded batches over
  transformers' own cache, re-laid only when rows join or leave; caches that
  cannot be batched (hybrid / state-space layers, a model's own cache class)
  stay with their one sequence;
- runner.py: the model side, adapters in PEFT, LoRA modes (lora_batch.py:
  Punica-style per-row LoRA for mixed-adapter batches; PEFT cannot mix
  expert LoRA, so then rows are grouped per adapter) and the forwards;
- sampling.py: validation and the sampler; detokenize.py: incremental
  detokenisation (`tokenizers`' DecodeStream) with stop strings;
- this file: the engine thread, fault isolation and the output path.

Fault isolation: sampling fields are checked before queueing; a forward or
sampling failure fails only the requests it belongs to (a failed decode batch
is re-run row by row to find them); rows with non-finite logits fail alone.
Finished sequences leave the running set on every path. An engine that keeps
failing (or whose thread died) turns `dead`: every queued request is answered
with an error, new ones are refused (EngineDead -> 503) and `check_health`
fails so Ray Serve replaces the replica. No busy waiting: the loop sleeps on
an event whenever nothing ran.

Axis legend: B rows, V vocab.
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
from moeflow.serving.detokenize import Detokenizer
from moeflow.serving.kv_cache import KVBatch, compatible_widths
from moeflow.multimodal import ImagePrompt
from moeflow.serving.runner import ModelRunner
from moeflow.serving.sampling import SamplingParams, greedy_and_finite, make_generator, penalise, sample, topk
from moeflow.serving.scheduler import EngineBusy, EngineDead, Scheduler, Sequence

__all__ = ["Delta", "Engine", "EngineBusy", "EngineConfig", "EngineDead", "SamplingParams"]

log = logging.getLogger("moeflow.serving")
UNLOADED = "adapter unloaded"  # the error of a sequence whose adapter went away: a 404, not a 500


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
        self.kv_batchable: bool | None = None  # can this model's cache be batched (learnt at first prefill)
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.registry = registry or AdapterRegistry()
        self.metrics, self.experts = metrics, experts
        self.max_model_len = self.config.max_model_len or model.config.get_text_config().max_position_embeddings
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.slots = LoraSlots(self.config.max_loras, self._load_adapter, self._unload_adapter)
        self.sched = Scheduler(self.config)
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.last_scheduled: dict[str, int] = {}
        self.dead: str | None = None  # why the engine stopped serving
        self._fail_streak = 0  # requests failed since the last token produced
        self._step_errors = 0  # consecutive steps that raised outside per-request isolation

    @property
    def running(self) -> list[Sequence]:
        return self.sched.running

    @property
    def waiting(self) -> list[Sequence]:
        return self.sched.waiting

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

        `image`: the prompt's images (moeflow.multimodal.prepare).
        """
        self.validate(prompt_ids, params)
        seq = Sequence(req_id, model_name, adapter, list(prompt_ids), len(prompt_ids), params, sink,
                       Detokenizer(self.tokenizer, params.stop), image=image,
                       generator=make_generator(params.seed, self.device))
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
        self.sched.reserve(lengths, dry_run)

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
            self.sched.prune()
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
        self.sched.prune()
        self._report_queue()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
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
        self.sched.prune()

    # ------------------------------------------------------------ adapters

    def busy_adapters(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter}

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (engine thread); refuses while requests use it."""
        if self.registry.get(name) is None:
            raise KeyError(name)  # unloaded meanwhile: the caller answers 404
        if any(s.adapter == name for s in self.running + self.waiting):
            raise UserError(f"adapter {name!r} is in use by running requests; retry when they finish")
        self.registry.remove(name)
        self.slots.drop(name)

    def _ensure_adapter(self, seq: Sequence) -> bool:
        spec = self.registry.get(seq.adapter)
        if spec is None:
            self._finish(seq, "error", error=f"{UNLOADED}: The model `{seq.adapter}` does not exist "
                                            "(its adapter was unloaded)")
            return True  # finished; the scheduler drops it
        try:
            return self.slots.acquire(spec, self.busy_adapters())
        except Exception as exc:  # a broken adapter fails its request, not the engine
            self._finish(seq, "error", error=f"cannot load adapter {seq.adapter!r}: {exc}")
            return True

    def _admitted(self, seq: Sequence) -> None:
        if self.metrics:
            self.metrics.queue_time(seq.model_name, time.monotonic() - seq.arrival)

    # ------------------------------------------------------------ one step

    def step(self) -> bool:
        """One engine iteration: admit, schedule, run forwards, sample, emit.

        Returns:
            False when nothing was runnable (the loop then sleeps).
        """
        with torch.no_grad():  # not inference_mode: PEFT toggles requires_grad on adapter switches
            self.sched.admit(self._ensure_adapter, self._admitted)
            self.sched.prune()
            decodes, chunks = self.sched.schedule()
            if not (decodes or chunks):
                return False
            # req_id -> tokens computed this step (introspection for tests and logs)
            self.last_scheduled = {s.req_id: 1 for s in decodes} | {s.req_id: n for s, n in chunks}
            if decodes:
                for kv in self._decode_batches(decodes):
                    self._emit_rows(kv.seqs, self._decode_isolated(kv))
            self._prefill(chunks)
            self.sched.prune()
            self.steps += 1
            if self.experts is not None:
                self.experts.step_done()
            return True

    def _group_key(self, seq: Sequence) -> str | None:
        """Rows with the same key may share a forward: all of them while LoRA can be mixed per
        row, else those of one adapter (PEFT cannot mix expert LoRA in a batch)."""
        return None if self._lora_mode() != "peft" else (seq.adapter or BASE)

    def _decode_batches(self, decodes: list[Sequence]) -> list[KVBatch]:
        """This step's decode batches: each row scheduled, one group key, widths compatible.

        A batch keeps its cache across steps; it is re-laid only when rows left it (finished,
        not scheduled, another group) or when batches can be joined into one.
        """
        wanted = {id(s) for s in decodes}
        seen: dict[int, KVBatch] = {}
        for seq in decodes:
            seen.setdefault(id(seq.kv), seq.kv)
        pieces: list[KVBatch] = []
        for kv in seen.values():
            if not kv.mergeable:
                pieces.append(kv)
                continue
            groups: dict[Any, list[int]] = {}
            for i, s in enumerate(kv.seqs):
                if not s.finished:
                    groups.setdefault((id(s) in wanted, self._group_key(s)), []).append(i)
            if len(groups) == 1 and len(next(iter(groups.values()))) == len(kv):
                parts = [kv]
            else:
                parts = [kv.select(rows) for rows in groups.values()]
            for part in parts:
                for s in part.seqs:
                    s.kv = part
                if id(part.seqs[0]) in wanted:
                    pieces.append(part)
        return self._join(pieces)

    def _join(self, pieces: list[KVBatch]) -> list[KVBatch]:
        """Merge mergeable batches of one group key whose widths are compatible."""
        out: list[KVBatch] = [kv for kv in pieces if not kv.mergeable]
        by_key: dict[Any, list[KVBatch]] = {}
        for kv in pieces:
            if kv.mergeable:
                by_key.setdefault(self._group_key(kv.seqs[0]), []).append(kv)
        for group in by_key.values():
            group.sort(key=lambda kv: kv.width)
            run: list[KVBatch] = []
            for kv in group + [None]:
                if kv is not None and (not run or compatible_widths(run[0].width, kv.width)):
                    run.append(kv)
                    continue
                merged = KVBatch.merge(run)
                for s in merged.seqs:
                    s.kv = merged
                out.append(merged)
                run = [kv] if kv is not None else []
        return out

    def _decode_isolated(self, kv: KVBatch) -> torch.Tensor | list[torch.Tensor | None]:
        """_decode_batch; if the batch fails, each row alone, so only the rows at fault fail.

        A failed _decode_batch leaves the cache as it was, so a re-run is safe.
        """
        try:
            return self._decode_batch(kv)  # [B, V]
        except Exception as exc:
            if len(kv) == 1:
                self._fail(kv.seqs[0], "decode", exc)
                return [None]
            log.warning("decode batch of %d failed (%s); re-running row by row", len(kv), exc)
            out = []
            for i in range(len(kv)):
                single = kv.select([i])
                single.seqs[0].kv = single
                out += list(self._decode_isolated(single))  # rows [V] (None where failed)
            return out

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Run this step's prompt chunks: fresh whole prompts together (per group key and
        compatible length), every other chunk on its own sequence's cache."""
        groups: dict[Any, list[Sequence]] = {}
        for seq, n in chunks:
            if (self.kv_batchable and seq.num_cached == 0 and n == seq.num_prompt and seq.image is None
                    and seq.params.prompt_logprobs is None):
                groups.setdefault(self._group_key(seq), []).append(seq)
                continue
            try:
                last = self._forward_prefill(seq, n)  # [V] or None mid-prompt
            except Exception as exc:  # this prompt (its adapter, its images) failed: only it
                self._fail(seq, "prefill", exc)
                continue
            if last is not None:
                self._emit_rows([seq], [last])
        for group in groups.values():
            group.sort(key=lambda s: s.num_prompt)
            while group:
                take = [s for s in group if compatible_widths(group[0].num_prompt, s.num_prompt)]
                group = group[len(take):]
                self._prefill_isolated(take)

    def _prefill_isolated(self, seqs: list[Sequence]) -> None:
        if len(seqs) == 1:
            try:
                last = self._forward_prefill(seqs[0], seqs[0].num_prompt)
            except Exception as exc:
                self._fail(seqs[0], "prefill", exc)
                return
            self._emit_rows(seqs, [last])
            return
        try:
            logits = self._prefill_group(seqs)  # [B, V]
        except Exception as exc:
            log.warning("prefill of %d prompts failed (%s); re-running one by one", len(seqs), exc)
            for seq in seqs:
                self._prefill_isolated([seq])
            return
        self._emit_rows(seqs, logits)

    # ------------------------------------------------------------ sampling and output

    def _emit_rows(self, seqs: list[Sequence], rows: torch.Tensor | list[torch.Tensor | None]) -> None:
        """Sample one token per row and emit it; a failure or non-finite logits fail that row only.

        Args:
            rows: one batch's logits [B, V], or a row [V] (None: that row failed) per sequence.
        """
        if isinstance(rows, torch.Tensor) and not any(s.finished for s in seqs):
            live, logits = list(zip(seqs, rows)), rows  # the batch as it came: no [B, V] copy
        else:
            live = [(s, r) for s, r in zip(seqs, rows) if r is not None and not s.finished]
            if not live:
                return
            logits = torch.stack([r for _, r in live])  # [B, V]
        greedy, finite = greedy_and_finite(logits)
        for i, (seq, row) in enumerate(live):
            if not finite[i]:
                adapter = f" with adapter {seq.adapter!r}" if seq.adapter else ""
                self._fail(seq, "sampling", RuntimeError(f"the model{adapter} produced non-finite logits"))
                continue
            try:
                p = seq.params
                chosen = penalise(p, row, seq.tokens, seq.num_prompt,
                                  self.eos_ids if not p.ignore_eos else frozenset()) if p.penalised else row
                if p.greedy:
                    tok = greedy[i] if chosen is row else int(torch.argmax(chosen))
                else:
                    tok = sample(p, chosen, seq.generator)
                self._append_token(seq, tok, row)  # logprobs of the raw logits, as vLLM's default
            except Exception as exc:
                self._fail(seq, "sampling", exc)
                continue
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

    def _append_token(self, seq: Sequence, tok: int, logits: torch.Tensor) -> None:
        """Record a sampled token, detokenize, emit."""
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
        if seq.detok.add(None if reason == "stop" else tok, final=reason is not None):
            reason = "stop"  # a stop string
        delta = Delta([tok], seq.detok.take(final=reason is not None), lps, finish_reason=reason,
                      prompt_tokens=seq.num_prompt, completion_tokens=len(seq.out_ids))
        if len(seq.out_ids) == 1 and seq.params.prompt_logprobs is not None:
            delta.prompt_logprobs = seq.prompt_lp
        if reason:
            self._finish(seq, reason, delta=delta)
        else:
            seq.sink(delta)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                delta: Delta | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.kv = None  # its rows leave the batch at the next re-lay; a lone cache is freed now
        self.sched.dequeue(seq)
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
