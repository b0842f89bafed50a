"""The engine's scheduler: which requests run, and how many tokens each computes this step.

vLLM's scheduling model on one replica:
- Continuous batching: every step, waiting requests join the running set (up
  to `max_num_seqs`, first come first served, adapter slots permitting) and
  finished ones leave; nothing waits for a batch to drain.
- Chunked prefill: a step computes at most `max_num_batched_tokens` tokens;
  decodes go first (1 token each), prompts fill the rest in chunks of at most
  `long_prefill_token_threshold`, and at most `max_long_partial_prefills` long
  prompts per step, so shorter prompts behind a long one jump ahead. Without
  chunking a prompt is prefilled whole in one step.
- The budget counts attention (not vLLM's: `prefill_keys_per_token`): a chunk
  is charged a token for each of its tokens (their projections and experts)
  plus one per `prefill_keys_per_token` query-key pairs it computes (its tokens
  attend to all of the prompt before them, and it gathers those keys once,
  `GATHER_ROWS`), and one chunk's charge is capped at
  `long_prefill_token_threshold` (None: `LONG_PREFILL_CHARGE`, at most half
  the budget). So a long prompt's chunks shrink as its context grows (59
  tokens at first, 15 at a 1,024-token context with the defaults; never below
  `max_num_batched_tokens // 64`, 8, which they reach at 2,048), and a step
  carrying one costs ~1.1-1.5x a decode-only step of 16 streams on the demo
  model by benchmarks/bench_long_prompt.py --step-costs (past ~2,000 tokens of
  context the floor's 8 tokens cost more than the charge allows: the gather
  and attention over the whole context; docs/serving.md). Why: on a CPU host a decode
  step is mostly fixed overheads; a 256-token chunk at a 4,096-token context
  costs several decode steps, and the decodes beside it wait that long
  (issue 51; docs/serving.md, "Chunked prefill"). A step with no decodes has
  no stream to stall: there a prompt is counted as vLLM counts it (tokens
  only) and a chunk may take the whole budget (a deployment's own
  `long_prefill_token_threshold` still caps it).
- Queue limits (`QueueLimits`): prompts waiting for a slot are counted
  (requests and tokens) so an overloaded replica refuses new work (429)
  instead of queueing forever. The front end counts them (client.py: a refusal
  must be answered at once, before anything reaches the core) and releases a
  prompt when the core reports it admitted or finished.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

from moeflow.serving.errors import EngineBusy, EngineDead
from moeflow.serving.request import Sequence

__all__ = ["EngineBusy", "EngineConfig", "EngineDead", "QueueLimits", "Scheduler", "Sequence"]


@dataclass
class EngineConfig:
    """Engine knobs (vLLM names): the scheduler's budget and queue limits, the adapter slots,
    and when a failing engine gives up."""

    max_num_seqs: int = 16  # running sequences per step
    max_num_batched_tokens: int = 512  # token budget per step (decodes + prefill chunks)
    enable_chunked_prefill: bool = True
    # the most budget tokens one prompt's chunk may charge a step (vLLM's name; vLLM counts tokens);
    # None: LONG_PREFILL_CHARGE, at most half of max_num_batched_tokens
    long_prefill_token_threshold: int | None = None
    max_long_partial_prefills: int = 1  # long prompts prefilled per step; shorter ones jump ahead
    # a prompt chunk is charged a token per this many query-key pairs of its attention beside a token
    # each for its own work (module docstring; deploy.prefill_keys_per_token); None: vLLM's plain
    # count. 512: a token's own work costs about what 590-620 pairs do on the demo model
    # (benchmarks/bench_long_prompt.py --step-costs; 700-1,350 in an earlier fit on a loaded host),
    # rounded down so that no late chunk is undercharged
    prefill_keys_per_token: int | None = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_loras: int = 4  # resident adapters; least recently used evicted
    max_cpu_loras: int | None = None  # adapters held in host memory (adapter_tiers.py); None: 4 x max_loras
    pinned_adapters: tuple[str, ...] = ()  # never evicted; resident from the start
    max_queued_tokens: int = 262144  # prompt tokens waiting for a slot; beyond: refused (429)
    max_waiting_seqs: int = 1024  # requests waiting for a slot; beyond: refused (429)
    failures_before_unhealthy: int = 8  # requests failed in a row with no success in between
    # decode steps of the base through torch.compile, compiled by Engine.warm_up before serving
    # (deploy.compile; vLLM compiles unless enforce_eager)
    compile: bool = False
    # the paged KV cache (kv_manager.py) where the model's cache can be paged: blocks of block_size
    # tokens; num_kv_blocks None: max_num_seqs sequences of max_model_len tokens
    paged_kv: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    # prefix caching on the blocks (vLLM's enable_prefix_caching; block_pool.py): a prompt whose
    # leading full blocks were computed before starts from their keys and values
    enable_prefix_caching: bool = False
    # the decoding rows' keys and values kept side by side across decode steps (paged.DecodeView),
    # up to this many bytes over all layers; beyond, or 0, each decode step gathers them from the
    # blocks. It is a copy of the decoding rows' blocks: 64 MiB holds 16 rows of 1,024 tokens of a
    # model with 64 KiB of keys and values per token, and saves a gather per layer per step
    decode_view_bytes: int = 64 * 2**20


class QueueLimits:
    """Prompts waiting for a slot (requests and tokens) against the configured limits; any thread.

    Args:
        config: the engine's knobs (EngineConfig: max_waiting_seqs, max_queued_tokens).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self._lock = threading.Lock()
        self.queued_tokens = 0
        self.queued_seqs = 0

    def reserve(self, lengths: list[int], dry_run: bool = False) -> None:
        """Count prompts against the queue limits (all or none); EngineBusy if refused."""
        cfg = self.config
        with self._lock:
            tokens, seqs = self.queued_tokens + sum(lengths), self.queued_seqs + len(lengths)
            if seqs > cfg.max_waiting_seqs or (tokens > cfg.max_queued_tokens and self.queued_seqs):
                raise EngineBusy(f"server busy: {self.queued_seqs} requests ({self.queued_tokens} "
                                 f"prompt tokens) are waiting; retry later")
            if not dry_run:
                self.queued_tokens, self.queued_seqs = tokens, seqs

    def release(self, prompt_tokens: int) -> None:
        """One prompt of `prompt_tokens` no longer waits (admitted or finished)."""
        with self._lock:
            self.queued_tokens -= prompt_tokens
            self.queued_seqs -= 1


class Scheduler:
    """Waiting and running sequences and the per-step token budget (the core's thread only).

    Args:
        config: the engine's knobs (EngineConfig).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    # ------------------------------------------------------------ the engine thread

    def admit(self, ensure_adapter: Callable[[Sequence], bool], on_admit: Callable[[Sequence], None],
              fits: Callable[[Sequence], bool] | None = None) -> None:
        """Move waiting sequences into the running set (FCFS, adapter slots and KV blocks permitting).

        Args:
            ensure_adapter: makes a sequence's adapter resident; False: not ready (being read
                off the step, or no slot free yet): the sequence stays waiting and those behind
                it are admitted meanwhile. It may finish the sequence (adapter gone or broken).
            on_admit: called for each admitted sequence (the front end's queue time and limits).
            fits: the KV cache manager's word (kv_manager.py): False while the free blocks cannot
                hold the sequence; then it and every one behind it wait (first come first served).
        """
        still: list[Sequence] = []
        full = False
        for seq in self.waiting:
            if seq.finished:
                continue
            if full or len(self.running) >= self.config.max_num_seqs:
                still.append(seq)
                continue
            if seq.adapter and not ensure_adapter(seq):
                still.append(seq)
                continue
            if seq.finished:  # its adapter could not be loaded
                continue
            if fits is not None and not fits(seq):
                if seq.finished:  # it can never fit
                    continue
                full = True
                still.append(seq)
                continue
            on_admit(seq)
            self.running.append(seq)
        self.waiting = still

    def prune(self) -> None:
        """Finished sequences leave the running and waiting sets (every path calls this)."""
        self.running = [s for s in self.running if not s.finished]
        self.waiting = [s for s in self.waiting if not s.finished]

    def schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """This step's decodes and prefill chunks (sequence, tokens) within the token budget."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        running = [s for s in self.running if not s.finished]
        decodes = [s for s in running if not s.is_prefill][:budget]
        budget -= len(decodes)
        # the attention charge and the default cap keep a chunk step near a decode step for the
        # decodes beside it; a step with none has no stream to stall: vLLM's plain count, chunks
        # up to the budget (a lone long prompt was otherwise prefilled in 8-token steps)
        alone = not decodes
        cap = cfg.long_prefill_token_threshold or (
            cfg.max_num_batched_tokens if alone else max(1, min(cfg.max_num_batched_tokens // 2, LONG_PREFILL_CHARGE)))
        per = None if alone else cfg.prefill_keys_per_token
        floor = max(1, cfg.max_num_batched_tokens // 64)  # a long context's chunk, at least
        chunks: list[tuple[Sequence, int]] = []
        longs = 0
        for seq in (s for s in running if s.is_prefill):
            left = len(seq.tokens) - seq.num_cached  # a preempted sequence computes its output again too
            if not cfg.enable_chunked_prefill:
                if chunks and left > budget:
                    break  # whole prompts only; a first one always runs so nothing starves
                n = cost = left
            else:
                if budget <= 0:
                    break
                if left > cap:  # a long prompt: only max_long_partial_prefills of them per step,
                    if longs >= cfg.max_long_partial_prefills:
                        continue  # so shorter prompts behind it jump ahead (vLLM's policy)
                    longs += 1
                n = min(left, budget, cap)
                if per:  # the chunk's charge, attention included, within the cap and what is left
                    n = min(n, max(attention_fit(seq.num_cached, min(budget, cap), per), min(floor, left)))
                if seq.image is not None:  # never split an image (its encoder runs on whole images)
                    n = seq.image.chunk_end(seq.num_cached, seq.num_cached + n) - seq.num_cached
                cost = charge(seq.num_cached, n, per)
            chunks.append((seq, n))
            budget -= cost
        return decodes, chunks


# A chunk's charge by default (budget tokens): on the demo model a decode-only step of 16 streams
# costs about what 300-530 prompt tokens' own work does, so a chunk charging 64 adds ~0.2-0.3 of a
# decode step (`bench_long_prompt.py --step-costs`). 128 (~0.4-0.6) left the streams' p99 ITL too
# little room under 2x on a noisy host (docs/serving.md, "session 8")
LONG_PREFILL_CHARGE = 64

# A chunk gathers its context's keys and values from the block pool once per layer (paged.py):
# measured to cost about as much as this many more query rows' attention over them
# (`bench_long_prompt.py --step-costs`, the demo model; docs/serving.md, "Chunked prefill")
GATHER_ROWS = 8


def charge(cached: int, n: int, per: int | None) -> int:
    """The budget tokens a chunk of `n` prompt tokens after `cached` ones costs: a token each for
    its own work (projections, experts, norms) plus its attention -- the query-key pairs it
    computes (each token attends to the cached ones and the chunk's own up to it) and the keys it
    gathers (`GATHER_ROWS` rows' worth) -- one token per `per` pairs, rounded up. `per` None:
    vLLM's plain count, n."""
    if not per or n <= 0:
        return max(n, 0)
    pairs = n * cached + n * (n + 1) // 2 + GATHER_ROWS * (cached + n)
    return n + -(-pairs // per)


def attention_fit(cached: int, budget: int, per: int) -> int:
    """The most prompt tokens after `cached` ones that `budget` tokens pay for (`charge`); 0 if none."""
    # charge(n) <= budget  <=>  n^2 + (2 per + 2 cached + 2 GATHER_ROWS + 1) n <= 2 (per budget - GATHER_ROWS
    # cached), before the rounding up
    room = per * budget - GATHER_ROWS * cached
    if budget <= 0 or room <= 0:
        return 0
    b = 2 * per + 2 * cached + 2 * GATHER_ROWS + 1
    n = min(budget, (math.isqrt(b * b + 8 * room) - b) // 2 + 1)
    while n > 0 and charge(cached, n, per) > budget:  # the rounding up: a step or two back at most
        n -= 1
    return n
