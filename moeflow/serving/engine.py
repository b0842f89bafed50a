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

from moeflow.devices import model_device, seeded_generator, to_device
from moeflow.errors import UserError
from moeflow.serving.adapters import BASE, AdapterRegistry, AdapterSpec, LoraSlots, check_compatible
from moeflow.serving.multimodal import ImagePrompt

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


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI fields)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top-k logprobs per generated token
    prompt_logprobs: int | None = None  # echo: logprobs of the prompt tokens
    ignore_eos: bool = False


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

    @property
    def out_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def is_prefill(self) -> bool:
        return self.num_cached < self.num_prompt


class Engine:
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

    # ------------------------------------------------------------ public API

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise UserError for a request that can never run (checked before queueing)."""
        if not prompt_ids:
            raise UserError("prompt: must not be empty")
        if params.max_tokens < 1:
            raise UserError(f"max_tokens: must be >= 1 (got {params.max_tokens})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise UserError(f"This model's maximum context length is {self.max_model_len} tokens; "
                            f"the prompt has {len(prompt_ids)} and max_tokens is {params.max_tokens}")
        vocab = self.base.config.get_text_config().vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise UserError(f"prompt: token ids must be in [0, {vocab})")

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[Delta], None], adapter: str | None = None,
               model_name: str = "base", image: ImagePrompt | None = None) -> None:
        """Queue a request (thread-safe); deltas arrive on `sink` from the engine thread.

        `image`: the prompt's images (moeflow.serving.multimodal.prepare).
        """
        self.validate(prompt_ids, params)
        seq = Sequence(req_id, model_name, adapter, list(prompt_ids), len(prompt_ids), params, sink,
                       image=image)
        if params.seed is not None:
            seq.generator = seeded_generator(params.seed, self.device)  # sampling runs on the model's device
        self._inbox.put(("seq", seq))
        self._wake.set()

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
        while not self._stop.is_set():
            self._drain_inbox()
            if not (self.waiting or self.running):
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # a bug must not kill the replica: fail this step's requests
                log.exception("engine step failed")
                for seq in list(self.running):
                    self._finish(seq, "error", error=f"engine error: {exc}")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "seq":
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
        self._report_queue()

    # ------------------------------------------------------------ adapters

    def _load_adapter(self, spec: AdapterSpec) -> None:
        from peft import PeftModel

        check_compatible(spec.path, self.base)
        self._release_batched()
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, spec.path, adapter_name=spec.name)
        else:
            self.peft.load_adapter(spec.path, adapter_name=spec.name)
        self.peft.eval()
        log.info("loaded adapter %s from %s", spec.name, spec.path)

    def _unload_adapter(self, name: str) -> None:
        self._release_batched()
        if list(self.peft.peft_config) == [name]:
            # PEFT cannot hold zero adapters cleanly: strip the LoRA layers (no merge)
            self.base = self.peft.unload()
            self.peft = None
        else:
            self.peft.delete_adapter(name)
        log.info("evicted adapter %s", name)

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
            self.running.append(seq)
        self.waiting = still

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

    def step(self) -> None:
        """One engine iteration: admit, schedule, run forwards, sample, emit."""
        with torch.no_grad():  # not inference_mode: PEFT toggles requires_grad on adapter switches
            self._admit()
            decodes, chunks = self._schedule()
            if not (decodes or chunks):
                return
            # req_id -> tokens computed this step (introspection for tests and logs)
            self.last_scheduled = {s.req_id: 1 for s in decodes} | {s.req_id: n for s, n in chunks}
            if decodes:
                logits = self._forward_decode(decodes)  # [B, V]
                greedy = logits.argmax(dim=-1).tolist()  # one op for the whole batch
                for seq, row, tok in zip(decodes, logits, greedy):
                    self._append_token(seq, row, tok if seq.params.temperature <= 0 else None)
            for seq, n in chunks:
                last = self._forward_prefill(seq, n)  # [V] or None mid-prompt
                if last is not None:
                    self._append_token(seq, last)
            self.running = [s for s in self.running if not s.finished]
            self.steps += 1
            if self.experts is not None:
                self.experts.step_done()
            self._report_queue()

    def _report_queue(self) -> None:
        if self.metrics:
            self.metrics.queue_sizes(self.running, self.waiting)

    # ------------------------------------------------------------ forwards

    def _release_batched(self) -> None:
        """Give LoRA layers back to PEFT before the adapter set changes."""
        if self._batched is not None:
            self._batched.close(self.peft)
            self._batched = None
        self._lora_dirty = True

    def _lora_mode(self) -> str:
        """none (no PEFT), batched (per-row gather LoRA) or peft (per-adapter forwards)."""
        if self.peft is None:
            return "none"
        if self._lora_dirty:
            from moeflow.serving.lora_batch import BatchedLora, supported

            mixable = all(not getattr(c, "target_parameters", None) for c in self.peft.peft_config.values())
            if mixable and supported(self.peft):
                self._batched = BatchedLora(self.peft, list(self.peft.peft_config))
            self._lora_dirty = False
        return "batched" if self._batched is not None else "peft"

    def _run(self, adapters: list[str | None], **inputs) -> Any:
        """Forward rows that may use different adapters; returns (logits [B, C, V], cache)."""
        mode = self._lora_mode()
        inputs = to_device(inputs, self.device)
        if mode == "none":
            out = self.base(**inputs, use_cache=True)
        elif mode == "batched":
            self._batched.rows = torch.tensor([self._batched.slot[a] if a else 0 for a in adapters],
                                              device=self.device)  # [B]
            try:
                out = self.peft.base_model.model(**inputs, use_cache=True)
            finally:
                self._batched.rows = None
        else:  # expert LoRA resident: PEFT cannot mix, the caller groups rows by adapter
            names = {a or BASE for a in adapters}
            assert len(names) == 1, "per-adapter forwards take one adapter at a time"
            out = self._run_single(names.pop(), inputs)
        return out.logits, out.cache

    def _run_single(self, name: str, inputs: dict) -> Any:
        if name == BASE:
            with self.peft.disable_adapter():
                return self.peft(**inputs, use_cache=True)
        self.peft.set_adapter(name)
        return self.peft(**inputs, use_cache=True)

    def _forward_decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode token for each sequence. Returns logits [B, V] in `seqs` order."""
        groups: dict[str | None, list[int]] = {}
        mixable = self._lora_mode() != "peft"
        for i, seq in enumerate(seqs):
            groups.setdefault(None if mixable else (seq.adapter or BASE), []).append(i)
        out = [None] * len(seqs)
        for idx in groups.values():
            for bucket in _length_buckets(idx, [seqs[i].num_cached for i in idx]):
                for i, row in zip(bucket, self._decode_batch([seqs[i] for i in bucket])):
                    out[i] = row
        return torch.stack(out)

    def _decode_batch(self, seqs: list[Sequence]) -> torch.Tensor:
        lengths = [s.num_cached for s in seqs]
        width = max(lengths)
        layers = []
        for layer in range(len(seqs[0].kv)):
            ks, vs = [], []
            for seq in seqs:
                k, v = seq.kv[layer]  # [1, H, L, D]
                pad = width - k.shape[2]
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))  # left pad: [1, H, W, D]
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layers.append((torch.cat(ks), torch.cat(vs)))  # [B, H, W, D]
        mask = torch.zeros(len(seqs), width + 1, dtype=torch.long)  # [B, W+1]
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        ids = torch.tensor([[s.tokens[s.num_cached]] for s in seqs])  # [B, 1]
        pos = torch.tensor([[n] for n in lengths])  # [B, 1]
        deltas = [s.image.rope_delta if s.image is not None else 0 for s in seqs]
        if any(deltas):  # M-RoPE: generated tokens continue after the image's positions
            pos = (pos + torch.tensor(deltas)[:, None]).unsqueeze(0).expand(3, -1, -1)  # [3, B, 1]
        cache = self._cache(layers)
        logits, cache = self._run([s.adapter for s in seqs], input_ids=ids, attention_mask=mask,
                                  position_ids=pos, cache=cache)
        new = [(layer.keys, layer.values) for layer in cache.layers]  # [B, H, W+1 or window, D]
        for i, seq in enumerate(seqs):
            # keep the row's own tokens; a sliding-window layer holds at most its window
            seq.kv = [(k[i:i + 1, :, -min(lengths[i] + 1, k.shape[2]):],
                       v[i:i + 1, :, -min(lengths[i] + 1, v.shape[2]):]) for k, v in new]
            seq.num_cached += 1
        return logits[:, -1].float()  # [B, V]

    def _cache(self, layers):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=layers, config=self.base.config)

    def _forward_prefill(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """Prefill `n` more prompt tokens of one sequence; last-position logits [V] when done."""
        start = seq.num_cached
        ids = torch.tensor([seq.tokens[start:start + n]])  # [1, C]
        pos = torch.arange(start, start + n).unsqueeze(0)  # [1, C]
        mask = torch.ones(1, start + n, dtype=torch.long)  # [1, L+C]
        cache = self._cache(seq.kv) if seq.kv else self._cache(None)
        extra = {}
        if seq.image is not None:  # pixels of the images in this chunk, M-RoPE positions
            extra = seq.image.inputs(start, start + n)
            if seq.image.positions is not None:
                pos = seq.image.positions[:, start:start + n].unsqueeze(1)  # [3, 1, C]
        logits, cache = self._run([seq.adapter], input_ids=ids, attention_mask=mask,
                                  position_ids=pos, cache=cache, **extra)
        seq.kv = [(layer.keys, layer.values) for layer in cache.layers]  # [1, H, L+C, D]
        seq.num_cached += n
        if seq.params.prompt_logprobs is not None:
            self._record_prompt_logprobs(seq, logits[0].float(), start, n)
        return logits[0, -1].float() if seq.num_cached == seq.num_prompt else None

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int, n: int) -> None:
        """Logprob of each prompt token given its prefix (echo=True); first token has none."""
        if start == 0:
            seq.prompt_lp.append((seq.tokens[0], None, []))
        lp = torch.log_softmax(logits, dim=-1)  # [C, V]
        k = seq.params.prompt_logprobs or 0
        for j in range(n):
            pos = start + j + 1  # logits at j predict token start+j+1
            if pos >= seq.num_prompt:
                break
            tok = seq.tokens[pos]
            seq.prompt_lp.append((tok, lp[j, tok].item(), _topk(lp[j], k)))

    # ------------------------------------------------------------ sampling and output

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)  # [V]
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _append_token(self, seq: Sequence, logits: torch.Tensor, tok: int | None = None) -> None:
        """Sample (unless `tok`, the greedy choice, is given), record, detokenize, emit."""
        if tok is None:
            tok = self._sample(seq, logits)
        now = time.monotonic()
        seq.tokens.append(tok)
        lps = []
        if seq.params.logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)  # [V]
            lps.append((tok, lp[tok].item(), _topk(lp, seq.params.logprobs)))
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
        hit = _find_stop(seq.text, seq.params.stop)
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


def _length_buckets(idx: list[int], lengths: list[int]) -> list[list[int]]:
    """Split decode rows so no row is left-padded to more than ~2x its own cache.

    Without this one long-context sequence would pad every short one in the
    batch to its length (copies and attention over padding each step).
    """
    order = sorted(range(len(idx)), key=lambda j: -lengths[j])
    buckets: list[list[int]] = []
    top = None
    for j in order:
        if top is None or top > 2 * lengths[j] + 64:
            buckets.append([])
            top = lengths[j]
        buckets[-1].append(idx[j])
    return buckets


def _topk(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    vals, idx = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return list(zip(idx.tolist(), vals.tolist()))


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
