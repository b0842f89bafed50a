"""Tie-aware output agreement: a near-tie flip is not a regression.

Two models that compute the same distribution up to rounding can still pick
different greedy tokens where the reference's top two are nearly tied; in a
free-running generation every later token then differs too, so counting
positions calls a model indistinguishable from its reference a regression.

The rule, used by regress, `moeflow watch` and calibrate's end-to-end check:
where the reference picks token `a` and the candidate `b` on the same context,
the flip's *swing* is how far the candidate moved the log-odds of `a` over `b`:

    swing = (log p_ref(a) - log p_ref(b)) + (log p_cand(b) - log p_cand(a))  >= 0

A flip whose swing is at most `tie_margin` nats is a near tie: the
reference's own preference there was within what rounding can move, and the
position counts as agreeing. A larger swing is a real change.

Free-running generations are judged at their first divergent step, the last
one where both models saw the same context: before it every step agrees; a
near-tie there excuses the rest of the sample (what follows is a different
context, not comparable token by token), a real flip counts the rest as
before (position by position). The steps up to and including the divergence
are compared like teacher-forced positions, so a generation task also gets a
per-token KL (`kl_mean`) that a shifted distribution fails even when the
greedy tokens survive.

Why this and not teacher-forced agreement on the reference's continuation:
it needs nothing at evaluation time but the model itself (a baseline is
recorded long before a candidate exists, so the candidate cannot be fed the
reference's tokens), and it judges the tokens the model really emits.
"""

from __future__ import annotations

import math

TIE_MARGIN = 0.05  # nats: p(a)/p(b) within 5% counts as a tie (measured swings below)


def _logprob(ids: list[int], lps: list[float], tok: int) -> float:
    """log p(tok) from a top-k record; a token outside the top-k gets the k-th log-prob
    (its upper bound), which can only understate the swing of a flip to it."""
    for i, lp in zip(ids, lps):
        if i == tok:
            return lp
    return min(lps)


def swing(ref_ids: list[int], ref_lps: list[float], cand_ids: list[int], cand_lps: list[float],
          a: int, b: int) -> float:
    """Log-odds swing of a flip from the reference's token `a` to the candidate's `b` (>= 0),
    from each side's top-k (ids, log-probs) at that position."""
    return max((_logprob(ref_ids, ref_lps, a) - _logprob(ref_ids, ref_lps, b))
               + (_logprob(cand_ids, cand_lps, b) - _logprob(cand_ids, cand_lps, a)), 0.0)


def generation_agreement(ref: list[dict], cand: list[dict], tie_margin: float,
                         kl=None) -> dict | None:
    """Tie-aware greedy-token agreement of a generation task.

    Args:
        ref, cand: samples with "output_ids" and, from record format 2 on, per step
            "step_ids", "step_top_ids", "step_top_logprobs" (without them a flip is
            never excused: positions are compared as they are).
        tie_margin: largest swing (nats) of an excused flip.
        kl: per-step KL(ref || cand) of two top-k records (paired._kl_topk).

    Returns:
        {"token_agreement", "positions", "changed": [samples whose outputs differ by a
         real flip], "ties": [samples whose outputs differ by an excused flip],
         "kl": [per-step KL over the comparable steps]} or None without token ids.
    """
    if not ref or len(ref) != len(cand):
        return None
    if not all("output_ids" in s for s in ref + cand):
        return None
    same, total, changed, ties, kls = 0, 0, [], [], []
    for i, (r, c) in enumerate(zip(ref, cand)):
        a, b = r["output_ids"], c["output_ids"]
        n = max(len(a), len(b), 1)
        total += n
        if a == b:
            same += n
            kls += _step_kls(r, c, None, kl)
            continue
        p = _first_divergence(r, c)
        kls += _step_kls(r, c, p, kl)
        if p is not None and _excused(r, c, p, tie_margin):
            same += n
            ties.append(i)
        else:
            same += sum(x == y for x, y in zip(a, b))
            changed.append(i)
    return {"token_agreement": same / total if total else 1.0, "positions": total,
            "changed": changed, "ties": ties, "kl": kls}


def _has_steps(s: dict) -> bool:
    return "step_ids" in s and "step_top_ids" in s and "step_top_logprobs" in s


def _first_divergence(r: dict, c: dict) -> int | None:
    """First step where the two chose different tokens (None: no step records)."""
    if not (_has_steps(r) and _has_steps(c)):
        return None
    a, b = r["step_ids"], c["step_ids"]
    return next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _excused(r: dict, c: dict, p: int, tie_margin: float) -> bool:
    """The flip at step p is a near tie (both sides recorded step p)."""
    if p >= len(r["step_ids"]) or p >= len(c["step_ids"]):
        return False  # one side stopped without a recorded stop step: nothing to weigh
    s = swing(r["step_top_ids"][p], r["step_top_logprobs"][p], c["step_top_ids"][p],
              c["step_top_logprobs"][p], r["step_ids"][p], c["step_ids"][p])
    return s <= tie_margin


def _step_kls(r: dict, c: dict, p: int | None, kl) -> list[float]:
    """Per-step KL over the steps both sides took on the same context (through step p)."""
    if kl is None or not (_has_steps(r) and _has_steps(c)):
        return []
    n = min(len(r["step_ids"]), len(c["step_ids"]))
    n = n if p is None else min(n, p + 1)
    return [kl(r["step_top_ids"][t], r["step_top_logprobs"][t], c["step_top_ids"][t],
               c["step_top_logprobs"][t]) for t in range(n)]


def top1_tie_aware(ref_logits, cand_logits, tie_margin: float) -> tuple[int, int, int]:
    """Teacher-forced top-1 agreement over full logits (calibrate's end-to-end check).

    Args:
        ref_logits, cand_logits: [..., V] logits of the two models on the same inputs.

    Returns:
        (agreeing positions, excused near-tie flips among them, positions).
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch

    ref = torch.log_softmax(ref_logits.float(), -1).reshape(-1, ref_logits.shape[-1])  # [N, V]
    cand = torch.log_softmax(cand_logits.float(), -1).reshape(-1, cand_logits.shape[-1])  # [N, V]
    a, b = ref.argmax(-1, keepdim=True), cand.argmax(-1, keepdim=True)  # [N, 1]
    s = (ref.gather(-1, a) - ref.gather(-1, b)) + (cand.gather(-1, b) - cand.gather(-1, a))  # [N, 1]
    flipped = (a != b)[:, 0]
    excused = int((flipped & (s[:, 0] <= tie_margin)).sum())
    return int((~flipped).sum()) + excused, excused, int(a.numel())


def kl_mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0
