"""Continuous-batching generation engine over a transformers model + PEFT LoRA.

Why hand-written: vLLM/SGLang (what Ray Serve LLM wraps) do not install on
CPU-only machines, and transformers' own continuous batching has no per-row
LoRA. This engine keeps vLLM's serving model on plain transformers, one
concern per module:

- request.py: a request inside the engine (`Sequence`) and what a step
  produced for it (`Delta`);
- scheduler.py: continuous batching, chunked prefill, queue limits (vLLM's
  knobs and policy, `EngineConfig`);
- kv_cache.py: the KV cache as persistent left-padded batches over
  transformers' own cache; caches that cannot be batched (hybrid /
  state-space layers, a model's own cache class) stay with their one
  sequence; kv_plan.py: which rows decode and prefill together this step,
  re-laying a batch only when rows join or leave;
- runner.py: the model side (`ModelRunner`, which the engine holds): adapters
  in PEFT, LoRA modes (lora_batch.py: Punica-style per-row LoRA for
  mixed-adapter batches; PEFT cannot mix expert LoRA, so then rows are
  grouped per adapter) and the forwards;
- sampling.py: validation and the sampler; outputs.py: tokens to text and
  deltas (detokenize.py: incremental detokenisation with stop strings), stop
  checks and finishing requests;
- this file: the engine thread, one step (schedule, plan, forward, sample,
  emit) and fault isolation. As vLLM's engine core, it holds its components
  and runs them; errors it raises are the library's (errors.py), never HTTP.

Fault isolation: sampling fields are checked before queueing; a forward or
sampling failure fails only the requests it belongs to (a failed decode batch
is re-run row by row to find them); rows with non-finite logits fail alone.
Finished sequences leave the running set on every path. An engine that keeps
failing (or whose thread died) turns `dead`: every queued request is answered
with an error, new ones are refused (EngineDead) and `check_health`
fails so Ray Serve replaces the replica. No busy waiting: the loop sleeps on
an event whenever nothing ran.

Axis legend: B rows, V vocab.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import torch

from moeflow.errors import UserError
from moeflow.multimodal import ImagePrompt
from moeflow.serving import kv_plan
from moeflow.serving.adapters import AdapterRegistry, AdapterSpec, LoraSlots, check_compatible
from moeflow.serving.errors import STOPPED, UNLOADED, EngineBusy, EngineDead
from moeflow.serving.kv_cache import KVBatch
from moeflow.serving.outputs import OutputProcessor
from moeflow.serving.request import Delta, Sequence
from moeflow.serving.runner import ModelRunner
from moeflow.serving.sampling import SamplingParams, greedy_and_finite, make_generator, penalise, sample
from moeflow.serving.scheduler import EngineConfig, Scheduler

if TYPE_CHECKING:
    from moeflow.serving.metrics import ExpertLoad, ServingMetrics

__all__ = ["UNLOADED", "Delta", "Engine", "EngineBusy", "EngineConfig", "EngineDead", "SamplingParams",
           "check_request"]

log = logging.getLogger("moeflow.serving")


def check_request(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab: int) -> None:
    """Raise UserError for a request that can never run: an empty or too long prompt, token ids
    outside the vocabulary, invalid sampling fields (the engine and a core's client, core.py)."""
    if not prompt_ids:
        raise UserError("prompt: must not be empty")
    params.check()
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise UserError(f"This model's maximum context length is {max_model_len} tokens; "
                        f"the prompt has {len(prompt_ids)} and max_tokens is {params.max_tokens}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise UserError(f"prompt: token ids must be in [0, {vocab})")


class Engine:
    """Schedules and runs generation; owns the model (through its runner) on its own thread.

    Args:
        model: a transformers causal LM (eval mode), shared by all adapters.
        tokenizer: its tokenizer (decoding, stop strings).
        config: EngineConfig.
        registry: servable adapters (None: base only).
        metrics: optional ServingMetrics (moeflow.serving.metrics).
        experts: optional ExpertLoad tracker hooked into the model.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None,
                 registry: AdapterRegistry | None = None, metrics: "ServingMetrics | None" = None,
                 experts: "ExpertLoad | None" = None):
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, experts, compile=self.config.compile)
        self.tokenizer = tokenizer
        self.registry = registry or AdapterRegistry()
        self.metrics, self.experts = metrics, experts
        self.max_model_len: int = (self.config.max_model_len or
                                   model.config.get_text_config().max_position_embeddings)
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.slots = LoraSlots(self.config.max_loras, self.runner.load_adapter, self.runner.unload_adapter)
        self.sched = Scheduler(self.config)
        self.outputs = OutputProcessor(tokenizer, self.sched, self.eos_ids, self.max_model_len, metrics)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.last_scheduled: dict[str, int] = {}
        self.dead: str | None = None  # why the engine stopped serving
        self._fail_streak = 0  # requests failed since the last token produced
        self._step_errors = 0  # consecutive steps that raised outside per-request isolation
        # called on the engine thread after every loop iteration (a core process flushes the
        # deltas of the iteration to its replica in one message: core.py)
        self.after_step: Callable[[], None] | None = None

    @property
    def base(self) -> Any:
        """The served model (the base; adapters live in the runner's PEFT model)."""
        return self.runner.base

    @property
    def running(self) -> list[Sequence]:
        return self.sched.running

    @property
    def waiting(self) -> list[Sequence]:
        return self.sched.waiting

    # ------------------------------------------------------------ public API

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise UserError for a request that can never run (checked before queueing)."""
        check_request(prompt_ids, params, self.max_model_len, self.base.config.get_text_config().vocab_size)

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[Delta], None], adapter: str | None = None,
               model_name: str = "base", image: ImagePrompt | None = None) -> None:
        """Queue a request (thread-safe); deltas arrive on `sink` from the engine thread.

        `image`: the prompt's images (moeflow.multimodal.prepare).
        """
        self.validate(prompt_ids, params)
        seq = Sequence(req_id, model_name, adapter, list(prompt_ids), len(prompt_ids), params, sink,
                       self.outputs.detokenizer(params.stop), image=image,
                       generator=make_generator(params.seed, self.runner.device))
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
            raise EngineDead(f"{STOPPED}: {self.dead}")
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

    def warm_up(self) -> None:
        """Compile the forwards before the first request (EngineConfig.compile): synthetic
        requests through the whole engine, one round for each kind of forward the runner
        compiles -- a lone prompt and its decode steps; prompts of two lengths together (a padded
        batch, whose one-time mask check runs both masks) until one is left alone in it; prompts
        arriving while a row decodes (a mixed forward, checked once). Neither the metrics nor
        the expert load count them. Without compile: nothing. Call before `start` (it steps the
        engine on the caller's thread)."""
        if self.runner.compiled is None:
            return
        t0 = time.monotonic()
        vocab = self.base.config.get_text_config().vocab_size
        # per round: (prompt tokens, new tokens, the engine steps run before it arrives)
        rounds = [[(4, 3, 0)], [(4, 5, 0), (8, 3, 0)], [(6, 4, 0), (5, 2, 1), (7, 2, 1), (7, 2, 1)]]
        metrics, self.metrics, self.outputs.metrics = self.metrics, None, None
        failed: list[str] = []

        def sink(delta: Delta) -> None:
            if delta.error:
                failed.append(delta.error)
        try:
            with self.experts.uncounted() if self.experts is not None else contextlib.nullcontext():
                for i, reqs in enumerate(rounds):
                    last = max(after for _, _, after in reqs)
                    for step in range(last + 1):
                        for j, (n, new, after) in enumerate(reqs):
                            if after == step:
                                self.submit(f"warm-up-{i}-{j}", [(3 + k) % vocab for k in range(n)],
                                            SamplingParams(max_tokens=new, ignore_eos=True), sink)
                        self._drain_inbox()
                        if step < last:
                            self.step()
                    self.run_until_idle()
        finally:
            self.metrics = self.outputs.metrics = metrics
        state = "compiled" if self.runner.compiled is not None else "eager (compiling failed)"
        log.info("warm-up in %.1f s: forwards %s%s", time.monotonic() - t0, state, f"; {failed[0]}" if failed else "")

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
        while not self._stop.is_set():
            if not self.iterate():  # nothing runnable: sleep until a submit/abort/call (or a slot frees up)
                self._wake.wait(0.5)
                self._wake.clear()

    def iterate(self) -> bool:
        """One pass of the engine loop: take what was queued, run a step if anything can run,
        report. The engine's own thread runs this in a loop; a core process (core.py) calls it
        from its one thread between reads of its socket.

        Returns:
            whether a step ran (False: nothing was runnable).
        """
        try:
            self._drain_inbox()
            ran = self.dead is None and bool(self.waiting or self.running) and self._guarded_step()
            self._report_queue()
            if self.after_step is not None:
                self.after_step()
            return ran
        except BaseException as exc:  # the loop is ending: nobody may wait forever
            self._die(f"engine thread crashed: {exc!r}")
            if self.after_step is not None:
                self.after_step()
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
            self._finish(seq, "error", error=f"{STOPPED}: {reason}")
        self.sched.prune()
        self._report_queue()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "seq" and self.dead is not None:
                self._finish(item, "error", error=f"{STOPPED}: {self.dead}")
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

    def run(self, op: str, *args: Any) -> Future:
        """Run one of OPS (an adapter change) on the engine thread; a core process's replica
        asks for these by name (core.py), as no function crosses the process boundary."""
        if op not in self.OPS:
            raise ValueError(f"unknown engine operation {op!r}")
        return self.call(lambda: getattr(self, op)(*args))

    OPS = ("load_or_check", "remove_adapter")

    def load_or_check(self, spec: AdapterSpec) -> bool:
        """A runtime adapter resident now (True); or, every slot busy, checked as a load would
        (False: it loads on first use; a NaN or mismatched adapter must be refused now)."""
        if self.slots.acquire(spec, self.busy_adapters()):
            return True
        check_compatible(spec.path, self.base)
        return False

    def busy_adapters(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter}

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (engine thread); refuses while requests use it."""
        if self.registry.get(name) is None:
            raise KeyError(name)  # unloaded meanwhile: the caller reports it not found
        if any(s.adapter == name for s in self.running + self.waiting):
            raise UserError(f"adapter {name!r} is in use by running requests; retry when they finish")
        self.registry.remove(name)
        self.slots.drop(name)

    def _ensure_adapter(self, seq: Sequence) -> bool:
        spec = self.registry.get(seq.adapter) if seq.adapter else None
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
        """One engine iteration: admit, schedule, plan the KV batches, run forwards, sample, emit.

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
            batches = kv_plan.decode_batches(decodes, self.runner.group_key) if decodes else []
            fresh, chunks = self._fresh(chunks)
            pairs, batches, groups = kv_plan.mixes(
                batches, kv_plan.prefill_groups(fresh, self.runner.group_key), self.runner.group_key,
                self.config.max_num_batched_tokens, self.runner.can_mix)
            for kv in batches:
                self._emit_rows(kv.seqs, self._decode_isolated(kv))
            for kv, group in pairs:
                self._mixed_isolated(kv, group)
            self._prefill(chunks, groups)
            self.sched.prune()
            self.steps += 1
            if self.experts is not None:
                self.experts.step_done()
            return True

    def _decode_isolated(self, kv: KVBatch) -> torch.Tensor | list[torch.Tensor | None]:
        """The runner's decode_batch; if the batch fails, each row alone, so only the rows at
        fault fail. A failed decode_batch leaves the cache as it was, so a re-run is safe."""
        try:
            return self.runner.decode_batch(kv)  # [B, V]
        except Exception as exc:
            if len(kv) == 1:
                self._fail(kv.seqs[0], "decode", exc)
                return [None]
            log.warning("decode batch of %d failed (%s); re-running row by row", len(kv), exc)
            out: list[torch.Tensor | None] = []
            for i in range(len(kv)):
                out += list(self._decode_isolated(kv_plan.alone(kv, i)))  # rows [V] (None where failed)
            return out

    def _fresh(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """This step's fresh whole prompts that may share a padded forward (with each other, or
        with decoding rows), and the other chunks."""
        fresh, other = [], []
        for seq, n in chunks:
            if (self.runner.kv_batchable and seq.num_cached == 0 and n == seq.num_prompt and seq.image is None
                    and seq.params.prompt_logprobs is None):
                fresh.append(seq)
            else:
                other.append((seq, n))
        return fresh, other

    def _mixed_isolated(self, kv: KVBatch, group: list[Sequence]) -> None:
        """Decode `kv` and prefill `group` in one forward (the runner's `mixed`); apart when the
        model's mixed forward differs or the forward fails (then only the rows at fault fail)."""
        seqs = kv.seqs + group
        try:
            logits = self.runner.mixed(kv, group)  # [B, V], or None: run apart
        except Exception as exc:  # nothing was committed: both run again apart
            log.warning("mixed forward of %d decodes and %d prompts failed (%s); running them apart",
                        len(kv), len(group), exc)
            logits = None
        if logits is None:
            self._emit_rows(kv.seqs, self._decode_isolated(kv))
            self._prefill_isolated(group)
            return
        self._emit_rows(seqs, logits)

    def _prefill(self, chunks: list[tuple[Sequence, int]], groups: list[list[Sequence]]) -> None:
        """Run this step's prompt chunks on their own sequences' caches, then each group of fresh
        whole prompts in one forward (kv_plan.prefill_groups)."""
        for seq, n in chunks:
            try:
                last = self.runner.prefill_chunk(seq, n)  # [V] or None mid-prompt
            except Exception as exc:  # this prompt (its adapter, its images) failed: only it
                self._fail(seq, "prefill", exc)
                continue
            if last is not None:
                self._emit_rows([seq], [last])
        for group in groups:
            self._prefill_isolated(group)

    def _prefill_isolated(self, seqs: list[Sequence]) -> None:
        if len(seqs) == 1:
            try:
                last = self.runner.prefill_chunk(seqs[0], seqs[0].num_prompt)
            except Exception as exc:
                self._fail(seqs[0], "prefill", exc)
                return
            self._emit_rows(seqs, [last])
            return
        try:
            logits = self.runner.prefill_group(seqs)  # [B, V]
        except Exception as exc:
            log.warning("prefill of %d prompts failed (%s); re-running one by one", len(seqs), exc)
            for seq in seqs:
                self._prefill_isolated([seq])
            return
        self._emit_rows(seqs, logits)

    # ------------------------------------------------------------ sampling and failures

    def _emit_rows(self, seqs: list[Sequence], rows: torch.Tensor | list[torch.Tensor | None]) -> None:
        """Sample one token per row and hand it to the output processor; a failure or non-finite
        logits fail that row only.

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
                self.outputs.token(seq, tok, row)  # logprobs of the raw logits, as vLLM's default
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

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.outputs.finish(seq, reason, error=error)

    def _report_queue(self) -> None:
        if self.metrics:
            self.metrics.queue_sizes(self.running, self.waiting)
