"""The engine core's sampling of a step's logits, functions of `EngineCore`.

One token per row (sampling.py: penalties, greedy or seeded sampling, logprobs), recorded
on its sequence with its `CoreOutput`, and the stop checks the core can make: EOS,
max_tokens, the context length. A row whose largest logit is not finite (a NaN anywhere,
a +inf) or whose sampling fails, fails alone. Both steps (paged_step.py, padded_step.py)
send their forwards' logits here.

Axis legend: B rows, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch

from moeflow.serving.request import CoreOutput, Sequence, TokenLogprob
from moeflow.serving.sampling import greedy_and_finite, penalise, sample, sample_rows, topk

# `core` below is the EngineCore (engine_core.py), which imports this module (through its
# steps): typed Any here so that the import graph keeps no cycle


def emit_rows(core: Any, seqs: list[Sequence], rows: torch.Tensor | list[torch.Tensor | None]) -> None:
    """Sample one token per row and record it (`_token`) for `core`; a failure, or logits whose
    largest is not finite, fail that row only.

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
    drawn: list[tuple[Sequence, torch.Tensor, torch.Tensor]] = []  # (sequence, raw row, row to sample)
    for i, (seq, row) in enumerate(live):
        if not finite[i]:
            adapter = f" with adapter {seq.adapter!r}" if seq.adapter else ""
            core._fail(seq, "sampling", RuntimeError(f"the model{adapter} produced non-finite logits"))
            continue
        try:
            p = seq.params
            chosen = penalise(p, row, seq.tokens, seq.num_prompt,
                              core.eos_ids if not p.ignore_eos else frozenset()) if p.penalised else row
            if not p.greedy:
                drawn.append((seq, row, chosen))
                continue
            _token(core, seq, greedy[i] if chosen is row else int(torch.argmax(chosen)), row)
        except Exception as exc:
            core._fail(seq, "sampling", exc)
            continue
        core._fail_streak = 0
    if drawn:
        _draw(core, drawn)


def _draw(core: Any, drawn: list[tuple[Sequence, torch.Tensor, torch.Tensor]]) -> None:
    """The sampling rows drawn together (`sample_rows`); if that fails, each row alone, so only
    the rows at fault fail."""
    try:
        batch = torch.stack([c for _, _, c in drawn])  # [S, V]
        toks: list[int | None] = list(sample_rows([s.params for s, _, _ in drawn], batch,
                                                  [s.generator for s, _, _ in drawn]))
    except Exception as exc:
        if len(drawn) == 1:
            core._fail(drawn[0][0], "sampling", exc)
            return
        toks = []
        for seq, _, chosen in drawn:
            try:
                toks.append(sample(seq.params, chosen, seq.generator))
            except Exception as one:
                core._fail(seq, "sampling", one)
                toks.append(None)
    for (seq, row, _), tok in zip(drawn, toks):
        if tok is None:
            continue
        try:
            _token(core, seq, tok, row)
        except Exception as exc:
            core._fail(seq, "sampling", exc)
            continue
        core._fail_streak = 0


def _token(core: Any, seq: Sequence, tok: int, logits: torch.Tensor) -> None:
    """Record a sampled token and its output; finish the sequence on EOS or a length limit.

    Args:
        logits: the row's raw logits [V] (logprobs are of these, as vLLM's default).
    """
    seq.tokens.append(tok)
    lps: list[TokenLogprob] = []
    if seq.params.logprobs is not None:
        lp = torch.log_softmax(logits, dim=-1)  # [V]
        lps.append((tok, lp[tok].item(), topk(lp, seq.params.logprobs)))
    out = CoreOutput(seq.req_id, [tok], lps)
    if len(seq.out_ids) == 1 and seq.params.prompt_logprobs is not None:
        out.prompt_logprobs = seq.prompt_lp
    if tok in core.eos_ids and not seq.params.ignore_eos:
        out.finish_reason = "stop"
    elif len(seq.out_ids) >= seq.params.max_tokens or len(seq.tokens) >= core.max_model_len:
        out.finish_reason = "length"
    core._step_out.outputs.append(out)
    if out.finish_reason is not None:
        core._end(seq)
