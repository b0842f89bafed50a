"""The result record each stage hands downstream (`result.json`), as types.

A record is JSON: paths as strings, small numbers, nested dicts. These TypedDicts are the
contract between stages: `StageContext.input("convert")` is a `ConvertRecord` to the type
checker, so a key a stage reads that its upstream never writes is an error before anything
runs. Keys are optional (`total=False`) where a record's shape depends on the config (a
vLLM deployment, a run without tenant adapters, a skipped probe).
"""

from __future__ import annotations

from typing import Any, TypedDict


class ConvertRecord(TypedDict, total=False):
    output_dir: str  # the converted checkpoint (HF layout, manifest.json last)
    manifest: str
    manifest_sha256: str
    family: str
    architecture: str
    source_dir: str
    tensors: int
    files: int
    bytes: int
    seconds: float
    verified: bool
    mismatches: int
    logits_max_abs_diff: float | None
    resumed_files: int
    headline: dict[str, Any]


class PlanRecord(TypedDict, total=False):
    plan_path: str
    plan: dict[str, Any]  # the summary: degrees, memory per device, `serving` sub-plan
    chart: str
    alternatives_path: str


class OperatorsRecord(TypedDict, total=False):
    load_path: str
    operators_path: str
    heatmap: str
    model_path: str  # the checkpoint with hot experts placed (or the converted one)
    placement_applied: bool
    balancedness_before: float
    balancedness_after: float
    ep_size: int
    experts_implementation: dict[str, Any]  # {"training": ..., "serving": ...}


class CalibrateRecord(TypedDict, total=False):
    checkpoint: str  # the quantised checkpoint (compressed-tensors)
    scheme: str
    report_path: str
    first_divergent: str | None
    final: dict[str, Any]
    precision_plan: dict[str, Any]
    native_load: bool


class AdapterRecord(TypedDict, total=False):
    adapter_dir: str
    registered_model: str
    model_version: str | None
    metrics: dict[str, float]
    target_tasks: list[str] | None
    tenant: bool


class FinetuneRecord(TypedDict, total=False):
    adapter_dir: str
    adapter_name: str
    adapters: dict[str, AdapterRecord]  # the main adapter and every tenant adapter, by name
    base_dir: str
    merged_dir: str | None
    lora_uri: str | None  # the adapters' root in the store, when the workdir is one
    registered_model: str
    model_version: str | None
    probe_path: str
    dataset_sha256: str
    targets: dict[str, Any]
    num_workers: int
    metrics: dict[str, float]


class RegressRecord(TypedDict, total=False):
    passed: bool
    metrics: dict[str, float]
    base_metrics: dict[str, float]
    results_path: str
    suite: str
    suite_sha256: str
    baseline_run_id: str | None
    manifest_sha256: str
    adapter_sha256: str
    gated: list[str]
    probe: dict[str, Any] | None


class ServingRecord(TypedDict, total=False):
    serving_yaml: str
    report_path: str
    chosen: dict[str, Any]  # the knobs deploy applies
    goodput_rps: float
    default_goodput_rps: float
    slo_met: bool
    message: str


class DeployRecord(TypedDict, total=False):
    # the local backend (Ray Serve, moeflow's engine)
    app_name: str
    url: str
    mode: str
    ingress: str
    models: list[str]
    served: str
    replicas: dict[str, Any]
    serving_yaml: dict[str, Any]
    smoke: dict[str, Any]
    experts_implementation: str
    plan_not_applied: str
    # deploy.backend vllm (Ray Serve LLM): the Serve config written and, unless a dry run, applied
    backend: str
    serve_config: str
    checkpoint: str
    plan: dict[str, Any]
    adapters: list[dict[str, Any]]
    uploads: dict[str, str]
    notes: list[str]
    deployed: bool


# stage name -> its record type (tests check that every registered stage has one)
RECORDS: dict[str, type] = {"convert": ConvertRecord, "plan": PlanRecord, "operators": OperatorsRecord,
                            "calibrate": CalibrateRecord, "finetune": FinetuneRecord,
                            "regress": RegressRecord, "serving": ServingRecord, "deploy": DeployRecord}
