"""Stage `regress`: evaluate base and adapter on a fixed suite; gate the release.

    moeflow run configs/demo.yaml --only regress     # after convert + finetune are cached

The adapter (finetune output) must help on the suite's target tasks and not
hurt any other task beyond tolerance, compared with its own base (convert
output) on the same suite; it must also not regress against the last recorded
baseline. Any failure raises UserError: the stage FAILS and the DAG stops
before `deploy`. Metrics land as `eval/<task>/<metric>` (adapter) and
`eval_base/<task>/<metric>` (base), so MLflow's compare view lines runs up.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from moeflow.errors import UserError
from moeflow.evaluation.baseline import (Row, check_gain, compare, dir_checksum,
                                         load_baseline, model_fingerprint, record_baseline)
from moeflow.evaluation.report import diff_table, failure_summary, render_text
from moeflow.evaluation.runners import evaluate, flat_metrics
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite, sha256_file
from tasks.base import StageContext, StageSpec


def _targets(ctx: StageContext, suite) -> list[str]:
    names = ctx.config.regress.target_tasks
    names = list(suite.spec.target_tasks if names is None else names)
    for name in names:
        suite.task(name)  # UserError naming the suite's tasks
    return names


def _log(base: dict, adapted: dict, report: str, results: dict) -> None:
    """Log to the stage's MLflow run, when one is active (not in a bare unit call)."""
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.log_metrics(flat_metrics(adapted))
    mlflow.log_metrics(flat_metrics(base, prefix="eval_base/"))
    mlflow.log_text(report, "regress/comparison.txt")
    mlflow.log_dict(results, "regress/results.json")


def _log_tenants(results: dict) -> None:
    """Tenant adapters' metrics as `eval_<name>/<task>/<metric>` on the stage's run."""
    import mlflow

    if mlflow.active_run() is None:
        return
    for name, result in results.items():
        mlflow.log_metrics(flat_metrics(result, prefix=f"eval_{name}/"))


def _gate(ctx: StageContext, suite, targets: list[str], base: dict,
          adapted: dict) -> tuple[list[tuple[str, str, list[Row]]], str | None]:
    """Comparison sections (title, reference label, rows) and the baseline run used."""
    sec = ctx.config.regress
    sections: list[tuple[str, str, list[Row]]] = []
    if sec.compare_base:
        rows = check_gain(base, adapted, targets, sec.min_gain)
        rows += compare(base, adapted, label="base", exclude=tuple(targets))
        sections.append(("adapter vs base", "base", rows))
    if not (ctx.tracking_uri or sec.baseline):
        return sections, None  # a bare call: no tracking store, no named baseline
    found = load_baseline(sec.baseline, tracking_uri=ctx.tracking_uri, suite_sha256=suite.sha256)
    if not found:
        return sections, None
    run_id, reference = found
    label = f"baseline {reference.get('baseline', sec.baseline)!r}"
    sections.append((f"adapter vs {label} (run {run_id})", label,
                     compare(reference, adapted, label=label)))
    return sections, run_id


def run(ctx: StageContext) -> dict:
    """Evaluate base and adapter, gate, optionally record a baseline.

    Returns:
        {"passed", "metrics" (adapter, eval/...), "base_metrics", "results_path",
         "suite", "suite_sha256", "baseline_run_id", "manifest_sha256", "adapter_sha256"}

    Raises:
        UserError: a regression (with the failing metrics), or bad input.
    """
    sec = ctx.config.regress
    convert, finetune = ctx.input("convert"), ctx.input("finetune")
    base_dir, adapter_dir = convert["output_dir"], finetune["adapter_dir"]
    suite = load_suite(sec.suite)
    targets = _targets(ctx, suite)
    # tenant adapters (finetune.adapters): evaluated with the same loaded base, each gated
    # on its own target tasks and on not regressing the others
    tenants = {name: a for name, a in (finetune.get("adapters") or {}).items() if a.get("tenant")}
    for name, info in tenants.items():
        for task in info.get("target_tasks") or []:
            suite.task(task)  # UserError naming the suite's tasks
    base, adapted, *others = evaluate(
        suite, base_dir, [None, adapter_dir, *(a["adapter_dir"] for a in tenants.values())],
        shards=sec.shards, dtype=sec.dtype, batch_size=sec.batch_size, seed=ctx.config.seed)

    sections, baseline_run = _gate(ctx, suite, targets, base, adapted)
    for (name, info), result in zip(tenants.items(), others):
        own = list(info.get("target_tasks") or [])
        rows = check_gain(base, result, own, sec.min_gain) if own else []
        rows += compare(base, result, label="base", exclude=tuple(own))
        sections.append((f"adapter {name!r} vs base", "base", rows))
    report = "\n".join(render_text(diff_table(rows, title, reference=ref))
                       for title, ref, rows in sections)
    if baseline_run is None:
        report += f"\nno recorded baseline for suite {suite.name} ({suite.sha256[:12]})\n"
    failed = [(title, ref, rows) for title, ref, rows in sections if any(r.failed for r in rows)]
    extra = {"manifest_sha256": convert.get("manifest_sha256") or model_fingerprint(base_dir),
             "adapter_sha256": dir_checksum(adapter_dir),
             "config": ctx.config.model_dump(mode="json"), "seed": ctx.config.seed}
    results = {"passed": not failed, "base": base, "adapter": adapted, "report": report,
               "tenants": dict(zip(tenants, others)), "baseline_run_id": baseline_run, **extra}
    path = ctx.write_json("results.json", results)
    table = Path(ctx.out_dir) / "comparison.txt"
    table.with_name(table.name + ".tmp").write_text(report)
    table.with_name(table.name + ".tmp").replace(table)  # never half-written
    _log(base, adapted, report, results)
    if tenants:
        _log_tenants(dict(zip(tenants, others)))
    print(report, flush=True)
    if failed:
        raise UserError("regress: " + "; ".join(f"{title}: {failure_summary(rows, ref)}"
                                                for title, ref, rows in failed)
                        + f" (table: {table})")
    if sec.record_baseline:
        import mlflow

        active = mlflow.active_run()
        record_baseline(sec.record_baseline, adapted, tracking_uri=ctx.tracking_uri,
                        experiment=ctx.config.experiment,
                        run_id=active.info.run_id if active else None, extra=extra)
    return {"passed": True, "metrics": flat_metrics(adapted),
            "base_metrics": flat_metrics(base, prefix="eval_base/"), "results_path": str(path),
            "suite": suite.name, "suite_sha256": suite.sha256, "baseline_run_id": baseline_run,
            "manifest_sha256": extra["manifest_sha256"], "adapter_sha256": extra["adapter_sha256"]}


def _shipped_suites_version() -> str:
    """Hash of the shipped suite files: editing the golden data reruns the stage
    (a custom `regress.suite` YAML is fingerprinted by the DAG's cache key)."""
    root = GOLDEN_SUITE.parent
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return "1-" + hashlib.sha256("".join(f"{p.relative_to(root)}:{sha256_file(p)}\n"
                                         for p in files).encode()).hexdigest()[:12]


STAGE = StageSpec(
    name="regress",
    run=run,
    version=_shipped_suites_version(),
    upstream=("convert", "finetune"),
    sections=("model", "regress"),
    fingerprint=("model.path", "regress.suite"),
    description="evaluate base and adapter on a fixed suite; fail on regression vs base "
                "and vs the recorded baseline",
)
