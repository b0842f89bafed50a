"""The engine core: continuous batching over a transformers model + PEFT LoRA, token ids out.

Why hand-written: vLLM/SGLang (what Ray Serve LLM wraps) do not install on
CPU-only machines, and transformers' own continuous batching has no per-row
LoRA. This core keeps vLLM V1's serving model on plain transformers, one
concern per module:

- request.py: a request inside the core (`Sequence`) and what a step reports
  (`CoreOutput`, `StepOutputs`);
- scheduler.py: continuous batching, chunked prefill (vLLM's knobs and
  policy, `EngineConfig`), and the queue limits its front end counts;
- kv_manager.py (block_pool.py, paged.py; the steps in paged_step.py): the
  paged KV cache of models whose layers are all plain full attention --
  blocks with reference counts and prefix caching, admission from free
  blocks, recompute preemption, every step's rows in one packed forward;
- kv_cache.py, kv_plan.py (the steps in padded_step.py): for the other models,
  the KV cache as persistent left-padded batches over transformers' own cache
  (caches that cannot be batched -- hybrid / state-space layers, a model's own
  cache class -- stay with their one sequence) and which rows decode and
  prefill together this step, re-laying a batch only when rows join or leave;
- runner.py: the model side (`ModelRunner`, which the core holds): adapters
  in PEFT, LoRA modes (lora_batch.py: Punica-style per-row LoRA for
  mixed-adapter batches; PEFT cannot mix expert LoRA, so then rows are
  grouped per adapter) and the forwards;
- sampling.py: validation (`check_request`) and the sampler; step_sample.py:
  each step's logits sampled, the stop checks the core can make (EOS,
  max_tokens, the context length);
- this file: the core loop, one step (schedule, plan, forward, sample) and
  fault isolation. It returns token ids and logprobs, one `StepOutputs` per
  loop iteration through `emit`; text, stop strings and the request metrics
  are the front end's (outputs.py), whether the core runs on a thread of the
  replica (engine.py) or in its own process (core.py). Errors it raises are
  the library's (errors.py), never HTTP.

Fault isolation: a forward or sampling failure fails only the requests it
belongs to (a failed decode batch is re-run row by row to find them); rows
with non-finite logits fail alone. Finished sequences leave the running set
on every path. A core that keeps failing turns `dead`: every queued request
is answered with an error and `health` fails so Ray Serve replaces the
replica.

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

from moeflow.core.errors import UserError
from moeflow.model.multimodal import ImagePrompt
from moeflow.serving import padded_step, paged_step
from moeflow.serving.adapter_tiers import AdapterTiers
from moeflow.serving.adapters import AdapterRegistry, AdapterSpec, module_shapes
from moeflow.serving.errors import STOPPED, UNLOADED, EngineDead
from moeflow.serving.request import CoreOutput, CoreStats, Sequence, StepOutputs
from moeflow.serving.runner import ModelRunner
from moeflow.serving.sampling import SamplingParams, make_generator
from moeflow.serving.scheduler import EngineConfig, Scheduler
from moeflow.serving.step_log import StepLog

if TYPE_CHECKING:
    from moeflow.serving.kv_manager import KVCacheManager
    from moeflow.serving.metrics import ExpertLoad

__all__ = ["EngineCore"]

log = logging.getLogger("moeflow.serving")


class EngineCore:
    """Schedules and runs generation over the model (through its runner), on one thread.

    Args:
        model: a transformers causal LM (eval mode), shared by all adapters.
        config: EngineConfig.
        registry: servable adapters (None: base only).
        experts: optional ExpertLoad tracker hooked into the model.
        emit: where each loop iteration's StepOutputs go: the front end's output processor
            (in process, engine.py) or the socket to the replica (core.py).
    """

    def __init__(self, model: Any, config: EngineConfig | None = None, registry: AdapterRegistry | None = None,
                 experts: "ExpertLoad | None" = None, emit: Callable[[StepOutputs], None] | None = None):
        self.config = config or EngineConfig()
        self._wake = threading.Event()
        self.runner = ModelRunner(model, experts, compile=self.config.compile)
        self.registry = registry or AdapterRegistry()
        self.experts = experts
        text = model.config.get_text_config()
        self.max_model_len: int = self.config.max_model_len or text.max_position_embeddings
        self.vocab_size: int = text.vocab_size
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # adapters on the device (max_loras), in host memory (max_cpu_loras), read off the step
        self.tiers = AdapterTiers(self.config.max_loras, self.config.max_cpu_loras, module_shapes(model),
                                  self.runner.load_adapter, self.runner.unload_adapter, self._wake.set,
                                  self.config.pinned_adapters)
        self.slots = self.tiers.device
        self.sched = Scheduler(self.config)
        self.kv: KVCacheManager | None = None
        self.kv = paged_step.build(self, model)  # None: padded batches (kv_cache.py, kv_plan.py)
        self.emit: Callable[[StepOutputs], None] = emit or (lambda step: None)
        self._step_out = StepOutputs()
        self._last_stats: CoreStats | None = None
        self._dead_told = False
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self._step_log = StepLog.from_env()  # MOEFLOW_STEP_LOG: each step's timing (step_log.py)
        self.preemptions = 0  # sequences whose KV blocks were taken back (the pool ran dry)
        self.last_scheduled: dict[str, int] = {}
        self.dead: str | None = None  # why the core stopped serving
        self._fail_streak = 0  # requests failed since the last token produced
        self._step_errors = 0  # consecutive steps that raised outside per-request isolation
        pinned = [self.registry.get(n) for n in self.config.pinned_adapters]
        if None in pinned:
            missing = self.config.pinned_adapters[pinned.index(None)]
            raise UserError(f"pinned_adapters: {missing!r} is not a served adapter")
        self.tiers.pin(s for s in pinned if s is not None)

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

    # ------------------------------------------------------------ requests (any thread)

    def add_request(self, req_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None,
                    model_name: str = "base", image: ImagePrompt | None = None) -> None:
        """Queue a request the front end checked (check_request) and counted; thread-safe.

        `image`: the prompt's images (moeflow.model.multimodal.prepare).
        """
        seq = Sequence(req_id, model_name, adapter, list(prompt_ids), len(prompt_ids), params, image=image,
                       generator=make_generator(params.seed, self.runner.device))
        self._inbox.put(("seq", seq))
        self._wake.set()

    def abort(self, req_id: str) -> None:
        """Stop a request (client went away, a stop string); thread-safe."""
        self._inbox.put(("abort", req_id))
        self._wake.set()

    def health(self) -> None:
        """Raise EngineDead when the core cannot serve (Ray Serve's check_health)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise EngineDead("the engine thread died")

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the core's thread between steps (adapter load/unload)."""
        fut: Future = Future()
        self._inbox.put(("call", (fn, fut)))
        self._wake.set()
        if self._thread is None:  # no loop thread (unit tests, a core process between steps): run inline
            self._drain_inbox()
        return fut

    def warm_up(self) -> None:
        """Compile the forwards before the first request (EngineConfig.compile): synthetic
        requests through the whole core, one round for each kind of forward the runner
        compiles -- a lone prompt and its decode steps; prompts of two lengths together (a padded
        batch, whose one-time mask check runs both masks) until one is left alone in it; prompts
        arriving while a row decodes (a mixed forward, checked once). Their outputs go nowhere
        and the expert load does not count them. Without compile: nothing. Call before `start`
        (it steps the core on the caller's thread)."""
        if self.runner.compiled is None:
            return
        t0 = time.monotonic()
        # per round: (prompt tokens, new tokens, the core steps run before it arrives)
        rounds = [[(4, 3, 0)], [(4, 5, 0), (8, 3, 0)], [(6, 4, 0), (5, 2, 1), (7, 2, 1), (7, 2, 1)]]
        emit, failed = self.emit, list[str | None]()
        self.emit = lambda step: failed.extend(o.error for o in step.outputs if o.error)
        try:
            with self.experts.uncounted() if self.experts is not None else contextlib.nullcontext():
                for i, reqs in enumerate(rounds):
                    last = max(after for _, _, after in reqs)
                    for step in range(last + 1):
                        for j, (n, new, after) in enumerate(reqs):
                            if after == step:
                                self.add_request(f"warm-up-{i}-{j}", [(3 + k) % self.vocab_size for k in range(n)],
                                                 SamplingParams(max_tokens=new, ignore_eos=True))
                        self._drain_inbox()
                        if step < last:
                            self.step()
                    self.run_until_idle()
        finally:
            self._step_out, self._last_stats = StepOutputs(), None
            self.emit = emit
        state = "compiled" if self.runner.compiled is not None else "eager (compiling failed)"
        log.info("warm-up in %.1f s: forwards %s%s", time.monotonic() - t0, state, f"; {failed[0]}" if failed else "")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moeflow-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.tiers.close()
        if self._thread:
            self._thread.join(timeout=10)

    def run_until_idle(self, max_steps: int = 100000) -> None:
        """Step until nothing is waiting or running (tests, benchmarks without a thread);
        each step's outputs are emitted."""
        self._drain_inbox()
        self._flush()
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                return
            if not self.step():  # only sequences whose adapters are being read: wait for one
                self._wake.wait(0.05)
                self._wake.clear()
            self._drain_inbox()
            self._flush()

    # ------------------------------------------------------------ loop

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            if not self.iterate():  # nothing runnable: sleep until a submit/abort/call (or a slot frees up)
                self._wake.wait(0.5)
                self._wake.clear()

    def iterate(self) -> bool:
        """One pass of the core loop: take what was queued, run a step if anything can run,
        emit what it produced. The core's own thread runs this in a loop; a core process
        (core.py) calls it from its one thread between reads of its socket.

        Returns:
            whether a step ran (False: nothing was runnable).
        """
        try:
            log, t0, c0 = self._step_log, time.perf_counter(), time.thread_time()
            self._drain_inbox()
            ran = self.dead is None and bool(self.waiting or self.running) and self._guarded_step()
            t1, c1 = time.perf_counter(), time.thread_time()
            self._flush()
            if log is not None and ran:
                log.write(t0, len(self.last_scheduled), sum(self.last_scheduled.values()), t1 - t0, c1 - c0,
                          time.perf_counter() - t1)
            return ran
        except BaseException as exc:  # the loop is ending: nobody may wait forever
            self._die(f"engine thread crashed: {exc!r}")
            self._flush()
            raise

    def _flush(self) -> None:
        """Emit this iteration's outputs, admissions, the load if it changed, and death once."""
        step, self._step_out = self._step_out, StepOutputs()
        stats = self._stats()
        if stats != self._last_stats:
            step.stats = self._last_stats = stats
        if self.dead is not None and not self._dead_told:
            step.dead, self._dead_told = self.dead, True
        if step.outputs or step.admitted or step.stats is not None or step.dead is not None:
            self.emit(step)

    def _stats(self) -> CoreStats:
        run: dict[str, int] = {}
        wait: dict[str, int] = {}
        cached = 0
        for s in self.running:
            if not s.finished:
                run[s.model_name] = run.get(s.model_name, 0) + 1
                cached += s.num_cached
        for s in self.waiting:
            if not s.finished:
                wait[s.model_name] = wait.get(s.model_name, 0) + 1
        p = self.kv.pool if self.kv is not None else None
        return CoreStats(run, wait, cached, len(self.slots.resident()), p.queried_tokens if p else 0,
                         p.hit_tokens if p else 0, self.tiers.stats(),
                         self.kv.usage if self.kv is not None else None)

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

    # adapter changes, run on the core's thread between steps
    OPS = ("load_or_check", "remove_adapter", "add_adapter")
    # questions about the expert load, answered at once on the asking thread
    QUESTIONS = ("expert_metrics", "expert_load", "logical_totals")

    def run(self, op: str, *args: Any) -> Future:
        """One of OPS or QUESTIONS by name, a Future of its answer: the front ends ask by name
        (a core process's replica included: no function crosses the process boundary)."""
        if op in self.QUESTIONS:
            fut: Future = Future()
            try:
                fut.set_result(self._answer(op))
            except BaseException as exc:
                fut.set_exception(exc)
            return fut
        if op not in self.OPS:
            raise ValueError(f"unknown engine operation {op!r}")
        return self.call(lambda: getattr(self, op)(*args))

    def _answer(self, op: str) -> Any:
        x = self.experts
        if x is None:
            raise RuntimeError("this engine does not count the expert load")
        if op == "expert_metrics":
            from prometheus_client import generate_latest  # heavy: only at a scrape

            return generate_latest(x.registry)
        if op == "expert_load":
            x.flush()
            return x.snapshot()
        return x.logical_totals()

    def add_adapter(self, spec: AdapterSpec) -> None:
        """Make an adapter servable (it loads into a slot on first use)."""
        self.registry.add(spec)

    def load_or_check(self, spec: AdapterSpec) -> bool:
        """A runtime adapter read into host memory and checked now (a NaN or mismatched adapter
        must be refused now), and resident if a slot is free or idle (True; False: it is made
        resident on first use)."""
        return self.tiers.load_now(spec, self.busy_adapters())  # read and checked now, on this call

    def busy_adapters(self) -> set[str]:
        return {s.adapter for s in self.running if s.adapter}

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter (engine thread); refuses while requests use it."""
        if self.registry.get(name) is None:
            raise KeyError(name)  # unloaded meanwhile: the caller reports it not found
        if any(s.adapter == name for s in self.running + self.waiting):
            raise UserError(f"adapter {name!r} is in use by running requests; retry when they finish")
        self.registry.remove(name)
        self.tiers.forget(name)

    def _ensure_adapter(self, seq: Sequence) -> bool:
        spec = self.registry.get(seq.adapter) if seq.adapter else None
        if spec is None:
            self._finish(seq, "error", error=f"{UNLOADED}: The model `{seq.adapter}` does not exist "
                                            "(its adapter was unloaded)")
            return True  # finished; the scheduler drops it
        try:
            return self.tiers.ensure(spec, self.busy_adapters())  # False: being read off the step
        except Exception as exc:  # a broken adapter fails its request, not the engine
            self._finish(seq, "error", error=f"cannot load adapter {seq.adapter!r}: {exc}")
            return True

    def _prefetch(self) -> None:
        """Read ahead the adapters the waiting queue names (adapter_tiers.py); the waiting
        requests of an adapter whose read failed fail with its reason."""
        waiting = [s for s in self.waiting if s.adapter and not s.finished]
        if not waiting:
            return
        names = dict.fromkeys(s.adapter for s in waiting if s.adapter)  # distinct, in queue order
        specs = [spec for n in names if (spec := self.registry.get(n)) is not None]
        failed = self.tiers.prefetch(specs, self.busy_adapters())
        for seq in waiting:
            if seq.adapter in failed:
                self._finish(seq, "error", error=f"cannot load adapter {seq.adapter!r}: {failed[seq.adapter]}")

    def _admitted(self, seq: Sequence) -> None:
        if not seq.preempted:  # the front end counts a request's admission once
            self._step_out.admitted.append(seq.req_id)

    # ------------------------------------------------------------ one step

    def step(self) -> bool:
        """One engine iteration: admit, schedule, plan the KV batches, run forwards, sample, emit.

        Returns:
            False when nothing was runnable (the loop then sleeps).
        """
        with torch.no_grad():  # not inference_mode: PEFT toggles requires_grad on adapter switches
            self._prefetch()
            fits = (lambda seq: paged_step.fits(self, seq)) if self.kv is not None else None
            self.sched.admit(self._ensure_adapter, self._admitted, fits)
            self.sched.prune()
            decodes, chunks = self.sched.schedule()
            if not (decodes or chunks):
                return False
            # req_id -> tokens computed this step (introspection for tests and logs)
            self.last_scheduled = {s.req_id: 1 for s in decodes} | {s.req_id: n for s, n in chunks}
            if self.kv is not None:
                paged_step.step(self, [(s, 1) for s in decodes] + chunks)
            else:
                padded_step.step(self, decodes, chunks)  # the padded batches' (kv_cache.py, kv_plan.py)
            return self._stepped()

    def _stepped(self) -> bool:
        self.sched.prune()
        self.steps += 1
        if self.experts is not None:
            self.experts.step_done()
        return True

    # ------------------------------------------------------------ failures (step_sample.py: sampling)

    def _fail(self, seq: Sequence, where: str, exc: Exception) -> None:
        """Fail one request (its own fault or an isolated one); many in a row: the engine is unwell."""
        log.warning("request %s failed in %s: %s", seq.req_id, where, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        self._finish(seq, "error", error=f"{where} failed: {exc}")
        self._fail_streak += 1
        if self._fail_streak >= self.config.failures_before_unhealthy:
            self._die(f"{self._fail_streak} requests failed in a row, last in {where}: {exc}")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a sequence that did not end on a token (abort, failure): its last output says why."""
        if not seq.finished:
            self._step_out.outputs.append(CoreOutput(seq.req_id, [], finish_reason=reason, error=error))
            self._end(seq)

    def _end(self, seq: Sequence) -> None:
        seq.finished = True
        seq.kv = None  # its rows leave the batch at the next re-lay; a lone cache is freed now
        if self.kv is not None:
            self.kv.free(seq)  # its blocks go back to the pool (named ones stay findable)
