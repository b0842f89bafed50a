"""The result record of an evaluation: raw outputs scored into one JSON-able dict.

`assemble` scores a model's raw outputs (runners.task_outputs) per task into the record
(format RECORD_FORMAT, per-token top-TOPK log-probs), with the library versions that decide
the numbers (`library_versions`); `flat_metrics` names its metrics `eval/<task>/<metric>`
for MLflow and the gate.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
from typing import Any

from moeflow.evaluation.lmeval import score_lm_eval
from moeflow.evaluation.scoring import score_task
from moeflow.evaluation.suite import Suite

TOPK = 8  # top-k log-probs recorded per scored token (output agreement's KL support)
RECORD_FORMAT = 2  # 1: scores only; 2: + per-token top-k log-probs and greedy token ids


def assemble(suite: Suite, raw: dict[str, Any], skipped: dict[str, str], *,
             model: str, adapter: str | None, settings: dict) -> dict:
    """Score raw outputs into one JSON-able result record.

    Returns:
        {"suite", "suite_sha256", "model", "adapter", "settings", "versions",
         "tasks": {name: {"metrics", "samples", "dataset"} | {"skipped", "dataset"}}}
    """
    tasks: dict[str, dict] = {}
    for task in suite.tasks:
        if task.name in skipped:
            tasks[task.name] = {"skipped": skipped[task.name], "dataset": task.identity()}
            continue
        if task.spec.type == "lm_eval":
            metrics, samples = score_lm_eval(task, raw[task.name])
        else:
            metrics, samples = score_task(task, raw[task.name])
        tasks[task.name] = {"metrics": {k: m.to_dict() for k, m in metrics.items()},
                            "samples": samples, "n": len(samples), "dataset": task.identity(),
                            "tolerance": {"abs_tol": task.spec.abs_tol,
                                          "k_stderr": task.spec.k_stderr}}
    return {"format": RECORD_FORMAT, "topk": TOPK,
            "suite": suite.name, "suite_path": str(suite.path), "suite_sha256": suite.sha256,
            "model": model, "adapter": adapter, "settings": settings,
            "versions": library_versions(), "tasks": tasks}


def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide the numbers."""

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "tokenizers", "ray", "mlflow"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def flat_metrics(result: dict, prefix: str = "eval/") -> dict[str, float]:
    """`eval/<task>/<metric>` -> value (and `..._stderr`): one name per metric everywhere."""
    out: dict[str, float] = {}
    for name, task in result["tasks"].items():
        for metric, m in task.get("metrics", {}).items():
            out[f"{prefix}{name}/{metric}"] = m["value"]
            if m["stderr"] is not None:
                out[f"{prefix}{name}/{metric}_stderr"] = m["stderr"]
    return out
