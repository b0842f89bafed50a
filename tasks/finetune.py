"""Stage `finetune`: LoRA fine-tuning of the converted MoE checkpoint on Ray Train.

Run alone: `moeflow finetune CONFIG`; in the DAG after `convert` and `plan`.
The stage task itself takes no CPU: it only drives the Ray Train workers,
which take the plan's worker count. Output: a standard PEFT adapter that loads
on the ORIGINAL Hugging Face checkpoint, logged to MLflow with its lineage
(base manifest checksum, dataset hash, config) and registered as a model
version `<config name>-adapter` so deploy can load it by name and version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from moeflow.core.config import PipelineConfig
from moeflow.core.devices import want_gpu
from moeflow.core.errors import UserError
from moeflow.core.storage import publish
from moeflow.training.merge import write_merged
from tasks.base import StageContext, StageSpec
from tasks.records import ConvertRecord


def _use_gpu(setting, workers: int = 1) -> bool:
    """finetune.use_gpu: auto is yes when the Ray cluster has a GPU per worker (moeflow.core.devices)."""

    return want_gpu(setting, workers)


def _experts_impl(ctx: StageContext) -> str:
    """operators.json's choice when the operators stage ran, else grouped_mm."""
    setting = ctx.config.finetune.experts_implementation
    if setting != "auto":
        return setting
    ops = ctx.inputs.get("operators", {})
    chosen = ops.get("experts_implementation")
    if not chosen and ops.get("operators_path") and Path(ops["operators_path"]).is_file():
        chosen = json.loads(Path(ops["operators_path"]).read_text()).get("experts_implementation")
    if isinstance(chosen, dict):  # operators.json: {"training": ..., "serving": ...}
        chosen = chosen.get("training")
    return chosen if chosen in ("grouped_mm", "eager", "batched_mm", "split_lora") else "grouped_mm"


def _log_experts_impl(ctx: StageContext, impl: str) -> None:
    """MLflow param `experts_implementation` on the stage's run (what training used)."""
    if ctx.mlflow_run_id:
        # lazy: mlflow: heavy, loaded only when this runs
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=ctx.tracking_uri).log_param(ctx.mlflow_run_id, "experts_implementation", impl)


def _point_at_original(adapter_dir: Path, original: str) -> None:
    """adapter_config.json names the original HF checkpoint (what other engines load)."""
    path = adapter_dir / "adapter_config.json"
    conf = json.loads(path.read_text())
    conf["base_model_name_or_path"] = str(original)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(conf, indent=2, sort_keys=True))
    tmp.replace(path)


def _register(ctx: StageContext, adapter_dir: Path, lineage: dict, metrics: dict,
              run_id: str | None = None, model_name: str | None = None):
    """Log the adapter + lineage to `run_id` (default: the stage's run); register a
    model version of `model_name` (default: `<config name>-adapter`).

    Returns:
        (registered model name, version) or (None, None) without a run.
    """
    run_id = run_id or ctx.mlflow_run_id
    if not run_id:
        return None, None
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    client.log_artifacts(run_id, str(adapter_dir), "adapter")
    client.log_dict(run_id, lineage, "lineage.json")
    for key in ("base_manifest_sha256", "dataset_sha256", "adapter_name"):
        if lineage.get(key):
            client.set_tag(run_id, f"moeflow.{key}", lineage[key])
    if not ctx.config.finetune.register_model:
        return None, None
    name = model_name or f"{ctx.config.name}-adapter"
    try:
        client.create_registered_model(name, description="PEFT LoRA adapters from moeflow")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/adapter"
    tags = {k: str(v) for k, v in lineage.items() if isinstance(v, (str, int, float))}
    tags.update({f"metric.{k}": str(v) for k, v in metrics.items()
                 if k in ("adapter_exact_match", "base_exact_match", "eval_loss")})
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    return name, str(version.version)


def at_planned_seq_len(cfg: PipelineConfig, plan: dict, note: Callable[[str], None]) -> PipelineConfig:
    """The config finetune trains with: when no parallel plan fits `data.seq_len` the plan
    stage halves it until one does (its notes say so); training at the length that was
    planned is what fits the devices, so rows are packed to the plan's seq_len."""
    planned = int(plan.get("seq_len") or cfg.data.seq_len)
    if planned >= cfg.data.seq_len:
        return cfg
    note(f"data.seq_len {cfg.data.seq_len} fits no plan on {plan.get('hardware', 'this hardware')}: "
         f"training at the planned seq_len {planned}")
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": planned})})


def run(ctx: StageContext) -> dict:
    """Fine-tune the main adapter and every tenant (finetune.adapters) in one Ray Train run,
    write each under ctx.out_dir, log and register them.

    Returns:
        {"adapter_dir", "adapter_name", "registered_model", "model_version",
         "base_dir", "metrics", "adapters", ...}.
    """
    # lazy: loads peft, safetensors, torch, which importing this module does not
    from moeflow.training.driver import TrainJob, train_adapters

    convert = ctx.input("convert")
    base_dir = convert["output_dir"]
    plan = ctx.input("plan")["plan"]
    cfg = at_planned_seq_len(ctx.config, plan, ctx.note)
    adapter_name = main_adapter_name(cfg)
    jobs = [TrainJob(adapter_name, cfg, ctx.out_dir, ctx.mlflow_run_id)]
    tenants = {}
    try:
        for tenant, spec in cfg.finetune.adapters.items():
            tcfg = cfg.model_copy(update={
                "data": cfg.data.model_copy(update={"train_file": spec.train_file,
                                                    "eval_file": spec.eval_file}),
                "finetune": cfg.finetune.model_copy(update={
                    "max_steps": spec.max_steps or cfg.finetune.max_steps, "adapters": {}})})
            out = ctx.out_dir / "adapters" / tenant
            tenants[tenant] = (spec, tcfg, _tenant_run(ctx, tenant, spec, tcfg, out))
            jobs.append(TrainJob(tenant, tcfg, out, tenants[tenant][2], label=f"adapter {tenant}"))
        records = train_adapters(
            jobs, base_dir, plan, tracking_uri=ctx.tracking_uri, experts_impl=_experts_impl(ctx),
            use_gpu=_use_gpu(cfg.finetune.use_gpu, int(plan.get("num_workers") or 1)),
            notify=ctx.note, progress_file=str(ctx.progress_file),
            storage_uri=f"{ctx.store_dir}/ray" if ctx.store_dir else None)
        res = records[0]
        # what training used: expert LoRA under TP trains split (moeflow.training.driver)
        _log_experts_impl(ctx, res.get("experts_implementation") or _experts_impl(ctx))
        adapter_dir = Path(res["adapter_dir"])
        _point_at_original(adapter_dir, ctx.uri_of(cfg.model.path))
        metrics = _numbers(res["metrics"])
        # store URIs, not this node's cached copies: the registered version's tags outlive them
        lineage = _lineage(adapter_name, cfg, ctx.uri_of(base_dir), convert, res, plan,
                           ctx.uri_of(cfg.model.path))
        ctx.write_json("lineage.json", lineage)
        merged = write_merged(base_dir, adapter_dir, ctx.out_dir / "merged", cfg.model.dtype) \
            if cfg.finetune.merge else None
        if merged is not None:
            _log_kept_merge(ctx, merged)
        name, version = _register(ctx, adapter_dir, lineage, metrics)
        adapters = {adapter_name: {"adapter_dir": str(adapter_dir), "registered_model": name,
                                   "model_version": version, "metrics": metrics,
                                   "target_tasks": None, "tenant": False}}
        for (tenant, (spec, tcfg, run_id)), rec in zip(tenants.items(), records[1:]):
            adapters[tenant] = _finish_tenant(ctx, tenant, spec, tcfg, run_id, rec, base_dir,
                                              plan, convert)
    except BaseException:
        _close_tenant_runs(ctx, [run_id for _, _, run_id in tenants.values()], "FAILED")
        raise
    _close_tenant_runs(ctx, [run_id for _, _, run_id in tenants.values()], "FINISHED")
    return {"lora_uri": _publish_lora(ctx, adapters), "adapter_dir": str(adapter_dir), "adapter_name": adapter_name,
            "registered_model": name, "model_version": version, "base_dir": base_dir,
            "merged_dir": str(merged) if merged else None, "probe_path": res["probe_path"],
            "dataset_sha256": res["dataset"]["sha256"], "targets": res["targets"],
            "num_workers": res["num_workers"], "metrics": metrics, "adapters": adapters}


def _log_kept_merge(ctx: StageContext, merged: Path) -> None:
    """A merge into a kept release: its logits check and requantisation errors in MLflow."""
    check = merged / "verification.json"
    if not ctx.mlflow_run_id or not check.is_file():
        return  # a plain merge (no verification record) or no tracking run
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.tracking import MlflowClient

    from moeflow.training.merge_kept import merge_metrics

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    for key, value in merge_metrics(merged).items():
        client.log_metric(ctx.mlflow_run_id, key, value)
    client.log_artifact(ctx.mlflow_run_id, str(check), "merge")


def _publish_lora(ctx: StageContext, adapters: dict) -> str | None:
    """With the workdir in a store: every adapter also under `<workdir>/<pipeline run>/lora/<name>/`,
    the layout Ray Serve LLM loads LoRA adapters from (`deploy.lora_uri` defaults to it)."""
    if not ctx.store_dir:
        return None

    prefix = f"{ctx.store_dir.rstrip('/').rsplit('/', 1)[0]}/lora"
    for name, rec in adapters.items():
        publish(rec["adapter_dir"], f"{prefix}/{name}")
    return prefix


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def _lineage(name: str, cfg, base_dir: str, convert: ConvertRecord, res: dict, plan: dict,
             base_model: str) -> dict:
    """What a registered version is tagged with (`base_dir`: what `moeflow watch` gates it on)."""
    return {"adapter_name": name, "base_model": base_model, "base_dir": base_dir,
            "base_manifest_sha256": convert.get("manifest_sha256"),
            "dataset_sha256": res["dataset"]["sha256"], "dataset": res["dataset"],
            "targets": res["targets"], "plan": plan, "config": cfg.model_dump(mode="json"),
            "metrics": _numbers(res["metrics"])}


def _tenant_run(ctx: StageContext, tenant: str, spec, tcfg, out: Path) -> str | None:
    """The tenant's MLflow run, nested under the stage's run (so the MLflow UI compares
    adapters side by side). An earlier attempt's run in the same out dir (a killed driver,
    resumed) is closed KILLED, as the stage closes its own lost attempts."""
    if not ctx.mlflow_run_id:
        return None
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    known = out / "mlflow_run_id"
    if known.is_file():
        try:
            lost = client.get_run(known.read_text().strip())
            if lost.info.status == "RUNNING":
                client.set_terminated(lost.info.run_id, "KILLED")
        except MlflowException:
            pass  # another store, or deleted: nothing to close
    parent = client.get_run(ctx.mlflow_run_id)
    run_id = client.create_run(parent.info.experiment_id, run_name=f"finetune:{tenant}", tags={
        "mlflow.parentRunId": ctx.mlflow_run_id, "moeflow.adapter": tenant}).info.run_id
    for key, value in (("train_file", spec.train_file), ("eval_file", spec.eval_file),
                       ("max_steps", tcfg.finetune.max_steps)):
        client.log_param(run_id, key, str(value))
    out.mkdir(parents=True, exist_ok=True)
    known.write_text(run_id)
    return run_id


def _close_tenant_runs(ctx: StageContext, run_ids: list, status: str) -> None:
    if not ctx.mlflow_run_id:
        return
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    for run_id in filter(None, run_ids):
        try:
            client.set_terminated(run_id, status)
        except Exception:  # closing is best effort: the training's outcome is what matters
            if status == "FINISHED":
                raise


def _finish_tenant(ctx: StageContext, tenant: str, spec, tcfg, run_id: str | None, res: dict,
                   base_dir: str, plan: dict, convert: ConvertRecord) -> dict:
    """A trained tenant adapter (finetune.adapters.<tenant>): its lineage, its artifacts in
    its own MLflow run and its own registered model `<config name>-<tenant>`."""
    adapter_dir = Path(res["adapter_dir"])
    _point_at_original(adapter_dir, ctx.uri_of(tcfg.model.path))
    metrics = _numbers(res["metrics"])
    lineage = _lineage(tenant, tcfg, ctx.uri_of(base_dir), convert, res, plan, ctx.uri_of(tcfg.model.path))
    out = adapter_dir.parent
    tmp = out / "lineage.json.tmp"
    tmp.write_text(json.dumps(lineage, indent=2, default=str))
    tmp.replace(out / "lineage.json")  # never half-written
    name, version = _register(ctx, adapter_dir, lineage, metrics, run_id=run_id,
                              model_name=f"{ctx.config.name}-{tenant}")
    return {"adapter_dir": str(adapter_dir), "registered_model": name, "model_version": version,
            "metrics": metrics, "target_tasks": list(spec.target_tasks), "tenant": True}


def main_adapter_name(cfg) -> str:
    """The main adapter's served/registered name: `<config>-<targets>-r<rank>`."""
    return f"{cfg.name}-{'-'.join(cfg.lora.target_modules)}-r{cfg.lora.rank}"


def _preflight(cfg) -> None:
    """Before anything runs: every data line valid, LoRA targets exist in model.path,
    tenant names usable as served model names and distinct from the main adapter's."""
    # lazy: loads peft, safetensors, torch, which importing this module does not
    from moeflow.serving.adapters import check_name
    from moeflow.training.data import validate_jsonl
    from moeflow.training.driver import targets_on_meta

    if not cfg.data.train_file:
        raise UserError("data.train_file is not set (JSONL of prompt/completion or messages)")
    for name in cfg.finetune.adapters:
        try:
            check_name(name)
        except UserError as exc:
            raise UserError(f"finetune.adapters: {exc}") from None
        if name == main_adapter_name(cfg):
            raise UserError(f"finetune.adapters.{name}: the main adapter (data:) already has this name")
    tenants = [(t.train_file, t.eval_file) for t in cfg.finetune.adapters.values()]
    for path in (p for pair in [(cfg.data.train_file, cfg.data.eval_file), *tenants] for p in pair):
        if path:
            validate_jsonl(path, cfg.data.on_bad_line)  # line by line: never the whole file
    if (Path(cfg.model.path) / "config.json").is_file():
        targets = targets_on_meta(cfg.model.path, cfg.lora)
        # a merge written into the kept release: refused now, not after training
        # (deploy.merge on the vllm backend writes one too; the local engine merges in memory)
        key = "finetune.merge" if cfg.finetune.merge else "deploy.merge" \
            if cfg.deploy.merge and cfg.deploy.backend == "vllm" else None
        if key and cfg.convert.dtype == "keep":
            # lazy: loads peft and torch, which importing this module does not
            from moeflow.training.merge_kept import refuse_unmergeable

            refuse_unmergeable(cfg.model.path, targets.modules, targets.parameters, key)
            # lazy: reads the hardware file; only for this setting
            from moeflow.core.hardware import load_hardware

            if key == "deploy.merge" and "cpu" in load_hardware(cfg.hardware.spec).accelerator.lower():
                # vLLM's CPU build runs quantised MoE experts on some hosts only: asked of
                # the vLLM environment (a subprocess) now, not a replica's failure later
                from moeflow.serving.vllm_run import vllm_missing, vllm_python
                from moeflow.training.merge_vllm import vllm_cpu_refusal

                python = None if vllm_missing() else vllm_python()
                why = vllm_cpu_refusal(cfg.model.path, python) if python else None
                if why:
                    raise UserError(f"deploy.merge: {why}")


STAGE = StageSpec(
    name="finetune", run=run, upstream=("convert", "plan"), after=("operators",),
    sections=("model", "lora", "data", "optimizer", "finetune", "parallel"),
    num_cpus=0, max_retries=0, preflight=_preflight,
    resumable=True,  # a resumed pipeline continues from the last Ray Train checkpoint
    description="LoRA fine-tuning on Ray Train (attention / experts), routing watched")
