"""The engine core's steps over padded batches (kv_cache.py, kv_plan.py), functions of `EngineCore`.

For models whose KV cache is not paged (paged_step.py): this step's decoding rows run in
their persistent left-padded batches, fresh whole prompts in padded groups of their own or
in one forward with a decode batch (the runner's `mixed`), and the other prompt chunks on
their own sequences' caches. Fault isolation as the core keeps it: a failed decode batch is
re-run row by row, a failed prefill group prompt by prompt, a failed mixed forward as its
two halves apart, so only the rows at fault fail. Each forward's logits are sampled by
step_sample.py.

Axis legend: B rows, V vocab.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moeflow.serving import kv_plan
from moeflow.serving.kv_cache import KVBatch
from moeflow.serving.request import Sequence
from moeflow.serving.step_sample import emit_rows

log = logging.getLogger("moeflow.serving")

# `core` below is the EngineCore (engine_core.py), which imports this module: typed Any here so
# that the import graph keeps no cycle


def step(core: Any, decodes: list[Sequence], chunks: list[tuple[Sequence, int]]) -> None:
    """This step's decodes and prompt chunks over padded batches (kv_plan.mixes pairs a decode
    batch with a group of fresh prompts where the runner can run them in one forward)."""
    batches = kv_plan.decode_batches(decodes, core.runner.group_key) if decodes else []
    fresh, chunks = _fresh(core, chunks)
    pairs, batches, groups = kv_plan.mixes(
        batches, kv_plan.prefill_groups(fresh, core.runner.group_key), core.runner.group_key,
        core.config.max_num_batched_tokens, core.runner.can_mix)
    for kv in batches:
        emit_rows(core, kv.seqs, _decode_isolated(core, kv))
    for kv, group in pairs:
        _mixed_isolated(core, kv, group)
    _prefill(core, chunks, groups)


def _decode_isolated(core: Any, kv: KVBatch) -> torch.Tensor | list[torch.Tensor | None]:
    """The runner's decode_batch; if the batch fails, each row alone, so only the rows at
    fault fail. A failed decode_batch leaves the cache as it was, so a re-run is safe."""
    try:
        return core.runner.decode_batch(kv)  # [B, V]
    except Exception as exc:
        if len(kv) == 1:
            core._fail(kv.seqs[0], "decode", exc)
            return [None]
        log.warning("decode batch of %d failed (%s); re-running row by row", len(kv), exc)
        out: list[torch.Tensor | None] = []
        for i in range(len(kv)):
            out += list(_decode_isolated(core, kv_plan.alone(kv, i)))  # rows [V] (None where failed)
        return out


def _fresh(core: Any, chunks: list[tuple[Sequence, int]]) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
    """This step's fresh whole prompts that may share a padded forward (with each other, or
    with decoding rows), and the other chunks."""
    fresh, other = [], []
    for seq, n in chunks:
        if (core.runner.kv_batchable and seq.num_cached == 0 and n == seq.num_prompt and seq.image is None
                and seq.params.prompt_logprobs is None):
            fresh.append(seq)
        else:
            other.append((seq, n))
    return fresh, other


def _mixed_isolated(core: Any, kv: KVBatch, group: list[Sequence]) -> None:
    """Decode `kv` and prefill `group` in one forward (the runner's `mixed`); apart when the
    model's mixed forward differs or the forward fails (then only the rows at fault fail)."""
    seqs = kv.seqs + group
    try:
        logits = core.runner.mixed(kv, group)  # [B, V], or None: run apart
    except Exception as exc:  # nothing was committed: both run again apart
        log.warning("mixed forward of %d decodes and %d prompts failed (%s); running them apart",
                    len(kv), len(group), exc)
        logits = None
    if logits is None:
        emit_rows(core, kv.seqs, _decode_isolated(core, kv))
        _prefill_isolated(core, group)
        return
    emit_rows(core, seqs, logits)


def _prefill(core: Any, chunks: list[tuple[Sequence, int]], groups: list[list[Sequence]]) -> None:
    """Run this step's prompt chunks on their own sequences' caches, then each group of fresh
    whole prompts in one forward (kv_plan.prefill_groups)."""
    for seq, n in chunks:
        try:
            last = core.runner.prefill_chunk(seq, n)  # [V] or None mid-prompt
        except Exception as exc:  # this prompt (its adapter, its images) failed: only it
            core._fail(seq, "prefill", exc)
            continue
        if last is not None:
            emit_rows(core, [seq], [last])
    for group in groups:
        _prefill_isolated(core, group)


def _prefill_isolated(core: Any, seqs: list[Sequence]) -> None:
    if len(seqs) == 1:
        try:
            last = core.runner.prefill_chunk(seqs[0], seqs[0].num_prompt)
        except Exception as exc:
            core._fail(seqs[0], "prefill", exc)
            return
        emit_rows(core, seqs, [last])
        return
    try:
        logits = core.runner.prefill_group(seqs)  # [B, V]
    except Exception as exc:
        log.warning("prefill of %d prompts failed (%s); re-running one by one", len(seqs), exc)
        for seq in seqs:
            _prefill_isolated(core, [seq])
        return
    emit_rows(core, seqs, logits)
