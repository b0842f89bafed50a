"""The engine core's steps over the paged KV cache (kv_manager.py), functions of `EngineCore`.

Kept apart from engine_core.py (the core loop, failures), padded_step.py (the
padded batches' steps) and step_sample.py (sampling) so each file stays about
one concern: here the KV cache manager is built or refused (one log line says
why a model keeps the padded batches), a sequence is admitted from free
blocks, every row's blocks are reserved before its forward with recompute
preemption when the pool runs dry (vLLM's policy: the most recently admitted
running sequence goes back to the head of the queue), and the rows of one
group key run in one packed forward, re-run row by row when it fails so only
the rows at fault fail.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Hashable

import torch

from moeflow.serving.block_pool import NoFreeBlocks
from moeflow.serving.kv_manager import KVCacheManager
from moeflow.serving.paged import pageable
from moeflow.serving.request import Sequence
from moeflow.serving.step_sample import emit_rows

log = logging.getLogger("moeflow.serving")

# `core` below is the EngineCore (engine_core.py), which imports this module: typed Any here so
# that the import graph keeps no cycle


def build(core: Any, model: Any) -> KVCacheManager | None:
    """The paged cache (kv_manager.py) where the model's cache can be paged, else None and
    one line in the log saying why."""
    cfg = core.config
    why = ("paged_kv is off" if not cfg.paged_kv else
           "deploy.compile: packed forwards are not compiled; compiled forwards take padded batches"
           if cfg.compile else pageable(model))
    if why is not None:
        log.info("KV cache: padded batches per row group, not paged: %s%s", why,
                 "; prefix caching off" if cfg.enable_prefix_caching else "")
        return None
    blocks = cfg.num_kv_blocks or cfg.max_num_seqs * -(-core.max_model_len // cfg.block_size)
    kv = KVCacheManager(model, blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.decode_view_bytes)
    try:
        check = KVCacheManager(model, 2, 8, False, cfg.decode_view_bytes)  # a pool of its own
        same = _pages_like_the_model(core, check)
        differs = "a packed forward's logits differ from the model's own"
    except Exception as exc:  # the model's attention does not take a packed forward at all
        same, differs = False, f"a packed forward fails ({type(exc).__name__}: {exc})"
    if not same:
        log.info("KV cache: padded batches per row group, not paged: %s%s", differs,
                 "; prefix caching off" if cfg.enable_prefix_caching else "")
        return None
    log.info("KV cache: %d blocks of %d tokens, paged%s", blocks, cfg.block_size,
             ", prefix caching on" if cfg.enable_prefix_caching else "")
    return kv


def _pages_like_the_model(core: Any, kv: KVCacheManager) -> bool:
    """Two synthetic prompts prefilled in one packed forward, then one decode step each,
    against the model's own forward of each row alone: a model whose attention does more
    than `paged` applies (a position bias, say) answers differently and keeps the padded
    batches. Nothing is counted as expert load; `kv` is a small pool of the check's own."""
    from moeflow.serving.sampling import SamplingParams  # the synthetic rows' (unused) params

    vocab = core.vocab_size
    seqs = [Sequence(f"check-{i}", "base", None, [(3 + 5 * i + k) % vocab for k in range(n)], n, SamplingParams())
            for i, n in enumerate((7, 4))]
    counted = core.experts.uncounted() if core.experts is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), counted:
            for s in seqs:
                kv.pool.admit(id(s), s.tokens, None, [])
                kv.pool.grow(id(s), s.num_prompt + 1)
            tables = [kv.pool.table(id(s)) for s in seqs]
            logits, at = core.runner.packed([(s, s.num_prompt) for s in seqs], tables, kv.block_size, kv.cache)
            got = [None if j is None else logits[j] for j in at]
            for s in seqs:
                s.num_cached = s.num_prompt
                s.tokens.append(11 % vocab)
            logits, at = core.runner.packed([(s, 1) for s in seqs], tables, kv.block_size, kv.cache)
            got += [None if j is None else logits[j] for j in at]
            want = []
            for s in seqs:
                n = len(s.tokens)
                logits, _ = core.runner.run([None], input_ids=torch.tensor([s.tokens]),
                                            attention_mask=torch.ones(1, n, dtype=torch.long),
                                            position_ids=torch.arange(n)[None])
                want.append(logits[0, -2].float())
                want.append(logits[0, -1].float())
    finally:
        for s in seqs:
            kv.free(s)
    got = [got[0], got[2], got[1], got[3]]  # row by row, as `want`
    low = next(core.base.parameters()).dtype != torch.float32
    tol = 2e-2 if low else 1e-4
    return all(g is not None and torch.allclose(g, w, rtol=tol, atol=tol) for g, w in zip(got, want))


def step(core: Any, rows: list[tuple[Sequence, int]]) -> None:
    """This step's rows (decodes, then prompt chunks) in one packed forward, whatever their
    adapters while LoRA is batched (lora_batch.py: a slot per token); one per adapter where
    PEFT's own forwards apply them (expert LoRA, DoRA: `ModelRunner.group_key`)."""
    groups: dict[Hashable, list[tuple[Sequence, int]]] = {}
    for seq, n in _reserve(core, rows):
        groups.setdefault(core.runner.group_key(seq), []).append((seq, n))
    for group in groups.values():
        _packed_isolated(core, group)


def _reserve(core: Any, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """Blocks for every row's new tokens, in schedule order; when the pool is dry the most
    recently admitted running sequence is preempted (its row leaves this step)."""
    assert core.kv is not None
    kept: list[tuple[Sequence, int]] = []
    gone: set[int] = set()
    for seq, n in rows:
        while id(seq) not in gone:
            try:
                core.kv.grow(seq, n)
                kept.append((seq, n))
                break
            except NoFreeBlocks:
                others = [s for s in core.running if not s.finished and id(s) not in gone]
                victim = others[-1] if others else None  # the most recently admitted: vLLM's choice
                if victim is None or others == [seq]:  # alone and still too long for the whole pool
                    core._finish(seq, "error", error=f"the KV cache ({core.kv.pool.num_blocks} blocks of "
                                                     f"{core.kv.block_size} tokens) cannot hold "
                                                     f"{seq.num_cached + n} tokens")
                    break
                _preempt(core, victim)
                gone.add(id(victim))
    return [(s, n) for s, n in kept if id(s) not in gone and not s.finished]


def fits(core: Any, seq: Sequence) -> bool:
    """The KV cache manager's admission word; a sequence the whole pool cannot hold fails."""
    assert core.kv is not None
    if core.kv.pool.blocks_for(len(seq.tokens) + 1) > core.kv.pool.num_blocks:
        core._finish(seq, "error", error=f"the KV cache ({core.kv.pool.num_blocks} blocks of "
                                         f"{core.kv.block_size} tokens) cannot hold a prompt of {len(seq.tokens)}")
        return False
    return core.kv.fits(seq)


def _preempt(core: Any, seq: Sequence) -> None:
    """vLLM's recompute preemption: free the blocks, wait again at the head of the queue."""
    assert core.kv is not None
    log.debug("preempting %s (KV cache full)", seq.req_id)
    core.kv.free(seq)
    seq.num_cached, seq.preempted = 0, seq.preempted + 1
    core.preemptions += 1
    core.sched.running.remove(seq)
    core.sched.waiting.insert(0, seq)


def _packed_isolated(core: Any, group: list[tuple[Sequence, int]]) -> None:
    """The runner's packed forward; if it fails, each row alone, so only the rows at fault
    fail (a failed forward advanced nothing: a re-run writes the same slots)."""
    assert core.kv is not None
    try:
        logits, at = core.runner.packed(group, [core.kv.pool.table(id(s)) for s, _ in group], core.kv.block_size,
                                        core.kv.cache)
    except Exception as exc:
        if len(group) == 1:
            core._fail(group[0][0], "prefill" if group[0][1] > 1 else "decode", exc)
            return
        log.warning("packed forward of %d rows failed (%s); re-running row by row", len(group), exc)
        for row in group:
            _packed_isolated(core, [row])
        return
    for seq, n in group:
        seq.num_cached += n
        core.kv.computed(seq)
    done = [(s, j) for (s, _), j in zip(group, at) if j is not None]
    if not done:
        return
    rows = [j for _, j in done]
    # the kept logits as they came when they are the sampled rows in order (a decode step): no copy
    emit_rows(core, [s for s, _ in done], logits if rows == list(range(len(logits))) else logits[torch.tensor(rows)])
