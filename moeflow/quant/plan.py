"""Precision plan: quantise, compare, and greedily return the most sensitive modules to
their source precision until the end-to-end check holds.

Sensitivity is a module's isolated-mode divergence (1 - cosine of its output when
fed the baseline's input). Every candidate is a real quantised checkpoint written by
moeflow.quant.quantize and compared by moeflow.quant.compare, so what is judged is
exactly what is shipped. The resulting ignore list is the plan; it is written into
the output checkpoint's quantization_config.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from moeflow.evaluation.ties import TIE_MARGIN
from moeflow.quant.compare import compare_checkpoints
from moeflow.quant.quantize import quantize_checkpoint
from moeflow.quant.schemes import Scheme

SENSITIVE_KINDS = ("attention", "moe", "mlp")


def holds(final: dict, min_cosine: float, min_top1: float) -> bool:
    cos = final["logits_cosine"]
    return not math.isnan(cos) and cos >= min_cosine and final["top1_agreement"] >= min_top1


def ranked(result: dict, skip: set[str]) -> list[str]:
    """Module rows, most sensitive first (isolated 1 - cosine; NaN first)."""
    rows = [r for r in result["layers"] if r["kind"] in SENSITIVE_KINDS and r["name"] not in skip]

    def gap(r):
        return math.inf if math.isnan(r["cosine"]) else 1.0 - r["cosine"]
    return [r["name"] for r in sorted(rows, key=gap, reverse=True)]


def module_pattern(name: str) -> str:
    """compressed-tensors ignore entry for every linear under module `name`."""
    return f"re:^{re.escape(name)}\\."


def precision_plan(src: str | Path, out: str | Path, scheme: Scheme, ignore: list[str],
                   samples: list[dict], *, min_cosine: float, min_top1: float,
                   enabled: bool = True, step: int = 1, max_steps: int = 16, shards: int = 1,
                   layer_workers: int = 1, expert_groups: int = 1, tie_margin: float = TIE_MARGIN,
                   log=print) -> dict:
    """Quantise `src` into `out`, compare, and return modules to high precision until the
    end-to-end check holds (or `max_steps` rounds). `layer_workers` > 1: quantisation and
    compare split over Ray tasks by contiguous ranges of decoder layers (same result);
    `expert_groups` > 1: each layer's routed experts too (moeflow.quant.groups).

    Returns:
        {"first": the compare result with every eligible module quantised (it locates),
         "result": the final (shipped) compare result, "quantize": quantiser record, "ignore": final list,
         "added": modules returned to high precision, "steps": [{"added", "final"}],
         "holds": bool}
    """
    added: list[str] = []
    current = list(ignore)
    record = quantize_checkpoint(src, out, scheme, current, workers=layer_workers,
                                 expert_groups=expert_groups)
    result = compare_checkpoints(src, out, samples, shards=shards, layer_workers=layer_workers,
                                 expert_groups=expert_groups, tie_margin=tie_margin)
    steps = [{"added": [], "final": result["final"]}]
    first = result
    order = ranked(result, set())
    while enabled and not holds(result["final"], min_cosine, min_top1) and order \
            and len(steps) <= max_steps:
        take, order = order[:step], order[step:]
        added += take
        current = list(ignore) + [module_pattern(n) for n in added]
        log(f"precision plan: logits cosine {result['final']['logits_cosine']:.6f}, top-1 "
            f"{result['final']['top1_agreement']:.4f}; keeping {', '.join(take)} in high precision")
        record = quantize_checkpoint(src, out, scheme, current, workers=layer_workers,
                                 expert_groups=expert_groups)
        result = compare_checkpoints(src, out, samples, shards=shards, layer_workers=layer_workers,
                                     expert_groups=expert_groups, tie_margin=tie_margin)
        steps.append({"added": take, "final": result["final"]})
    return {"first": first, "result": result, "quantize": record, "ignore": current, "added": added,
            "steps": steps, "holds": holds(result["final"], min_cosine, min_top1)}
