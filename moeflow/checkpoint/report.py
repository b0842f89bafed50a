"""Terminal tables (rich) and MLflow logging for inspect / convert / verify."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def inspect_tables(summary: dict) -> list[Table]:
    """The `moeflow inspect` report: one overview table and one per-kind table."""
    head = Table(title=f"checkpoint {summary['path']}", show_header=False)
    for key in ("families", "architectures", "layers", "experts", "tensors", "shards",
                "quantization", "dtypes", "total_bytes", "aux_files"):
        value = summary[key]
        if key == "total_bytes":
            value = _gb(value)
        elif isinstance(value, (list, dict)):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) if isinstance(value, dict) \
                else ", ".join(map(str, value))
        head.add_row(key, str(value))
    kinds = Table(title="tensors per kind")
    for col in ("kind", "tensors", "bytes"):
        kinds.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in summary["kinds"].items():
        kinds.add_row(kind, str(row["tensors"]), _gb(row["bytes"]))
    stored = Table(title="stored formats (release quantisation formats by name, else dtype)")
    for col in ("format", "tensors", "bytes", "kinds"):
        stored.add_column(col, justify="right" if col in ("tensors", "bytes") else "left")
    for fmt, row in summary.get("formats", {}).items():
        stored.add_row(fmt, str(row["tensors"]), _gb(row["bytes"]), ", ".join(row["kinds"]))
    return [head, kinds, stored]


def verification_table(report: dict) -> Table:
    """Per-kind tensor counts, mismatches and max error, plus the functional check."""
    fn = report.get("functional") or {}
    caption = ("from_pretrained: " + ("ok" if not (fn.get("missing") or fn.get("unexpected"))
                                      else "MISSING/UNEXPECTED KEYS")
               + (f"; logits max |diff| {fn['logits_max_abs_diff']:.3g}"
                  if fn.get("logits_max_abs_diff") is not None else "")
               + (f"; logits check skipped: {fn['skipped']}" if fn.get("skipped") else "")
               + (f"; {fn['per_layer']['layers']} layers: max |diff| {fn['per_layer']['max_abs_diff']:.3g}"
                  if fn.get("per_layer") else "")) if fn else ""
    table = Table(title=f"verification: {'PASSED' if report['passed'] else 'FAILED'}", caption=caption)
    for col in ("kind", "tensors", "mismatches", "max abs error"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in report["kinds"].items():
        table.add_row(kind, str(row["tensors"]), str(row["mismatches"]), f"{row['max_abs_err']:.3g}")
    table.add_row("total", str(report["tensors"]), str(report["mismatches"]), "")
    return table


def log_to_mlflow(result: dict) -> bool:
    """Log the manifest, verification report and counts to the active MLflow run.

    Returns:
        False (and logs nothing) when no run is active.
    """
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow

    if mlflow.active_run() is None:
        return False
    out = Path(result["output_dir"])
    mlflow.log_artifact(str(out / "manifest.json"), artifact_path="convert")
    metrics = {"convert.tensors": result["tensors"], "convert.files": result["files"],
               "convert.bytes": result["bytes"]}
    if "seconds" in result:
        metrics["convert.seconds"] = result["seconds"]
    report = result.get("report")
    if report:
        mlflow.log_dict(report, "convert/verification.json")
        rows = [{"kind": k, **v} for k, v in report["kinds"].items()]
        mlflow.log_table({k: [r[k] for r in rows] for k in ("kind", "tensors", "mismatches", "max_abs_err")},
                         "convert/verification_table.json")
        metrics["verify.mismatches"] = report["mismatches"]
        metrics["verify.passed"] = float(report["passed"])
        fn = report.get("functional") or {}
        if fn.get("logits_max_abs_diff") is not None:
            metrics["verify.logits_max_abs_diff"] = fn["logits_max_abs_diff"]
        if fn.get("per_layer"):
            metrics["verify.layer_max_abs_diff"] = fn["per_layer"]["max_abs_diff"]
    mlflow.log_metrics(metrics)
    mlflow.set_tags({"moeflow.family": result["family"], "moeflow.manifest_sha256": result["manifest_sha256"]})
    return True
