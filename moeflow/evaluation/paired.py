"""Paired, sample-by-sample comparisons of two results on the same suite.

Both results scored the same records, so the gate works on per-sample
differences (lm-eval's paired view): a metric's delta is the mean of
per-sample deltas and its standard error is that of the differences, far
smaller than an unpaired one when the models agree on most samples.

Output agreement (result format >= 2, in-process runner): the candidate must
reproduce the reference's outputs —
- generation: greedy token ids, judged at the first divergent step
  (moeflow.evaluation.ties: a near-tie flip there is excused), and the
  per-step KL over the steps both sides took on the same context;
- perplexity / multiple choice: per scored token, the KL divergence
  KL(reference || candidate) estimated on the union of both top-k supports
  (a token outside one side's top-k gets that side's k-th log-prob, its
  upper bound; the rest of the mass is one bucket), and top-1 agreement
  (a near-tie flip counts as agreeing, as in ties.py).
An unchanged model gives 0 KL and agreement 1 exactly.
"""

from __future__ import annotations

import math

from moeflow.evaluation.scoring import mean_stderr, ratio_stderr
from moeflow.evaluation.ties import TIE_MARGIN, swing

_PER_SAMPLE = ("acc", "acc_norm", "exact_match", "contains", "regex_match")
SHOW = 5  # samples named in a failing row's note


def per_sample_delta(metric: str, ref: list[dict], cand: list[dict]) -> tuple[float, float,
                                                                               list[int]] | None:
    """Paired delta (candidate - reference) of one metric, its stderr, changed samples.

    Returns:
        (mean delta, paired standard error, indices of samples whose score moved),
        or None when the samples cannot be paired (missing scores, other records).
    """
    if not ref or len(ref) != len(cand):
        return None
    if any(r.get("index") != c.get("index") for r, c in zip(ref, cand)):
        return None
    if metric in _PER_SAMPLE:
        if not all(metric in s for s in ref + cand):
            return None
        diffs = [float(c[metric]) - float(r[metric]) for r, c in zip(ref, cand)]
        mean, se = mean_stderr(diffs)
        return mean, se, [i for i, d in enumerate(diffs) if d != 0.0]
    if metric == "bits_per_byte":
        if not all("loglik" in s and "bytes" in s for s in ref + cand):
            return None
        # bpb = sum(nll / ln 2) / sum(bytes); bytes are the same on both sides, so
        # the delta is a ratio of summed per-sample nll deltas (delta-method stderr)
        num = [(r["loglik"] - c["loglik"]) / math.log(2) for r, c in zip(ref, cand)]
        mean, se = ratio_stderr(num, [float(r["bytes"]) for r in ref])
        return mean, se, [i for i, d in enumerate(num) if d != 0.0]
    return None


def kl_topk(ref_ids, ref_lps, cand_ids, cand_lps) -> float:
    """KL(ref || cand) for one position, estimated on the union of both top-k sets."""
    r, c = dict(zip(ref_ids, ref_lps)), dict(zip(cand_ids, cand_lps))
    if r == c:
        return 0.0
    r_floor, c_floor = min(ref_lps), min(cand_lps)
    kl, r_mass, c_mass = 0.0, 0.0, 0.0
    for tok in set(r) | set(c):
        lr, lc = r.get(tok, r_floor), c.get(tok, c_floor)
        pr = math.exp(lr)
        kl += pr * (lr - lc)
        r_mass += pr
        c_mass += math.exp(lc)
    r_rest, c_rest = max(1.0 - r_mass, 1e-12), max(1.0 - c_mass, 1e-12)
    kl += r_rest * math.log(r_rest / c_rest)
    return max(kl, 0.0)


def logprob_agreement(ref: list[dict], cand: list[dict],
                      tie_margin: float = TIE_MARGIN) -> dict | None:
    """Per-token KL and tie-aware top-1 agreement over every scored token of a task.

    Returns:
        {"kl_mean", "kl_max", "top1_agreement", "ties" (excused near-tie flips),
         "max_abs_logprob_delta", "positions", "changed": [sample indices whose token
         outputs differ]} or None when either side has no per-token record.
    """
    if not ref or len(ref) != len(cand):
        return None
    if not all("top_ids" in s for s in ref + cand):
        return None
    kls, agree, ties, worst, changed = [], 0, 0, 0.0, []
    for i, (r, c) in enumerate(zip(ref, cand)):
        if len(r["top_ids"]) != len(c["top_ids"]):  # another tokenisation: nothing is equal
            changed.append(i)
            kls += [math.inf] * len(r["top_ids"])
            continue
        moved = r["token_logprobs"] != c["token_logprobs"] or r["top_ids"] != c["top_ids"]
        for ri, rl, ci, cl, rt, ct in zip(r["top_ids"], r["top_logprobs"], c["top_ids"],
                                          c["top_logprobs"], r["token_logprobs"],
                                          c["token_logprobs"]):
            kls.append(kl_topk(ri, rl, ci, cl))
            tie = ri[0] != ci[0] and swing(ri, rl, ci, cl, ri[0], ci[0]) <= tie_margin
            agree += ri[0] == ci[0] or tie
            ties += tie
            worst = max(worst, abs(rt - ct))
        if moved or r["top_logprobs"] != c["top_logprobs"]:
            changed.append(i)
    n = len(kls)
    return {"kl_mean": math.fsum(kls) / n if n else 0.0, "kl_max": max(kls, default=0.0),
            "top1_agreement": agree / n if n else 1.0, "ties": ties,
            "max_abs_logprob_delta": worst,
            "positions": n, "changed": changed}


def samples_note(indices: list[int], samples: list[dict]) -> str:
    """'samples 3, 7, 12 (+4 more)' using the records' own indices."""
    if not indices:
        return ""
    names = [str(samples[i].get("index", i)) for i in indices[:SHOW]]
    more = f" (+{len(indices) - SHOW} more)" if len(indices) > SHOW else ""
    return f"samples {', '.join(names)}{more}"
