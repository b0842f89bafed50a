"""Per-sample model outputs -> task metrics with standard errors.

Metric names follow lm-evaluation-harness: `acc`, `acc_norm` (multiple
choice, length-normalised by characters), `exact_match` / `contains` /
`regex_match` (generation), `bits_per_byte`, `byte_perplexity`,
`word_perplexity` (perplexity). Standard errors: sample standard deviation /
sqrt(n) for means (as lm-eval's `mean_stderr`); for `bits_per_byte`, a ratio
of sums, the delta-method standard error of a ratio estimator.

Raw outputs come from a runner (one dict per record, in record order):
- choice tasks: {"logliks": [float per choice]}
- generation: {"output": str}
- perplexity: {"loglik": float, "n_tokens": int}

The in-process runner adds per-token outputs, kept in the samples for output
agreement: "output_ids" and per decoding step "step_ids" / "step_top_ids" /
"step_top_logprobs" (generation), and "token_logprobs" / "top_ids" /
"top_logprobs" per scored token (perplexity; choice tasks: every choice's
tokens in choice order).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from moeflow.core.errors import UserError
from moeflow.evaluation.suite import Task


@dataclass(frozen=True)
class Metric:
    """One task metric."""

    value: float
    stderr: float | None  # None: no sampling error estimate (reported, not gated)
    higher_is_better: bool
    gate: bool = True  # compared against baselines; False: informational only

    def to_dict(self) -> dict:
        return asdict(self)


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n); 0 for n < 2)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def ratio_stderr(num: list[float], den: list[float]) -> tuple[float, float]:
    """R = sum(num) / sum(den) and its delta-method standard error.

    Why not mean_stderr: per-document bits per byte weighted by document length
    is a ratio of sums, and its spread is that of the residuals num - R * den.
    """
    n, total = len(num), math.fsum(den)
    ratio = math.fsum(num) / total
    if n < 2:
        return ratio, 0.0
    mean_den = total / n
    resid = math.fsum((a - ratio * b) ** 2 for a, b in zip(num, den)) / (n - 1)
    return ratio, math.sqrt(resid / n) / mean_den


def truncate(text: str, stop: list[str]) -> str:
    """Cut a generation at the first stop string."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


def score_task(task: Task, raw: list[dict]) -> tuple[dict[str, Metric], list[dict]]:
    """Score one task's raw outputs.

    Args:
        task: the loaded task.
        raw: one runner output per record, in record order.

    Returns:
        (metrics by name, per-sample rows: inputs, outputs and scores).
    """
    if len(raw) != len(task.records):
        raise ValueError(f"task {task.name}: {len(raw)} outputs for {len(task.records)} records")
    kind = task.spec.type
    if kind in ("multiple_choice", "multimodal"):
        return _score_choice(task, raw)
    if kind == "generation":
        return _score_generation(task, raw)
    return _score_perplexity(task, raw)


def _score_choice(task: Task, raw: list[dict]) -> tuple[dict[str, Metric], list[dict]]:
    acc, acc_norm, rows = [], [], []
    for i, (rec, out) in enumerate(zip(task.records, raw)):
        lls = out["logliks"]
        # first maximum wins, so ties resolve the same way on every run
        pred = max(range(len(lls)), key=lambda j: (lls[j], -j))
        norm = [ll / len(c) for ll, c in zip(lls, rec["choices"])]
        pred_norm = max(range(len(norm)), key=lambda j: (norm[j], -j))
        acc.append(float(pred == rec["gold"]))
        acc_norm.append(float(pred_norm == rec["gold"]))
        rows.append({"index": i, "gold": rec["gold"], "pred": pred, "logliks": lls,
                     "acc": acc[-1], "acc_norm": acc_norm[-1], **_tokens(out)})
    metrics = {"acc": Metric(*mean_stderr(acc), higher_is_better=True),
               "acc_norm": Metric(*mean_stderr(acc_norm), higher_is_better=True)}
    return metrics, rows


def _tokens(out: dict) -> dict:
    """Per-token outputs a runner recorded (output agreement's input), if any."""
    return {k: out[k] for k in ("token_logprobs", "top_ids", "top_logprobs") if k in out}


_STEP_KEYS = ("output_ids", "step_ids", "step_top_ids", "step_top_logprobs")


def _matcher(task: Task):
    mode = task.spec.match
    if mode == "exact":
        return "exact_match", lambda out, tgt: out.strip() == tgt.strip()
    if mode == "contains":
        return "contains", lambda out, tgt: tgt.strip() in out
    return "regex_match", lambda out, tgt: re.search(tgt, out) is not None


def _score_generation(task: Task, raw: list[dict]) -> tuple[dict[str, Metric], list[dict]]:
    name, match = _matcher(task)
    scores, rows = [], []
    for i, (rec, out) in enumerate(zip(task.records, raw)):
        text = truncate(out["output"], task.spec.stop)
        try:
            hit = any(match(text, tgt) for tgt in rec["targets"])
        except re.error as exc:
            raise UserError(f"{task.path}: record {i + 1}: invalid regex in `target`: {exc}") from None
        scores.append(float(hit))
        rows.append({"index": i, "prompt": rec["prompt"], "output": text,
                     "target": rec["targets"][0], name: scores[-1],
                     **{k: out[k] for k in _STEP_KEYS if k in out}})
    return {name: Metric(*mean_stderr(scores), higher_is_better=True)}, rows


def _score_perplexity(task: Task, raw: list[dict]) -> tuple[dict[str, Metric], list[dict]]:
    nll, nbytes, nwords, rows = [], [], [], []
    for i, (rec, out) in enumerate(zip(task.records, raw)):
        text = rec["completion"]
        nll.append(-out["loglik"])
        nbytes.append(len(text.encode("utf-8")))
        nwords.append(max(1, len(text.split())))
        rows.append({"index": i, "loglik": out["loglik"], "n_tokens": out["n_tokens"],
                     "bytes": nbytes[-1], **_tokens(out)})
    if min(nbytes) == 0:
        raise UserError(f"{task.path}: perplexity task {task.name} has an empty text "
                        f"(record {nbytes.index(0) + 1})")
    bpb, se = ratio_stderr([v / math.log(2) for v in nll], [float(b) for b in nbytes])
    total = math.fsum(nll)
    metrics = {
        "bits_per_byte": Metric(bpb, se, higher_is_better=False),
        "byte_perplexity": Metric(math.exp(total / sum(nbytes)), None, False, gate=False),
        "word_perplexity": Metric(math.exp(total / sum(nwords)), None, False, gate=False),
    }
    return metrics, rows
