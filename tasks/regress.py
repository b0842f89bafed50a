"""Stage `regress`: evaluate every model the pipeline made on a fixed suite; gate the release.

    moeflow run configs/demo.yaml --only regress     # after convert + finetune are cached

Gated, in one table (moeflow.evaluation.gate): the adapter (finetune output)
and each tenant adapter must help on their target tasks and not hurt any other
task beyond tolerance vs their base (paired, sample by sample); the quantised
checkpoint of the calibrate stage, when that stage ran (optional upstream
`calibrate`, record key `checkpoint`), must agree with the base's outputs
within regress.calibrated_*; and every model is compared with its own results
in the last recorded baseline (outputs must match exactly-ish when it is the
same model). Any failure raises UserError: the stage FAILS and the DAG stops
before `deploy`. Metrics land as `eval/<task>/<metric>` (adapter),
`eval_base/...`, `eval_<tenant>/...`, `eval_calibrated/...`, plus the base's
held-out perplexity ratio and expert-load skew (`base/...`).

Where each model runs is `regress.layout` (`_layout`, sized as the dry run sizes it:
moeflow.parallel.stage_prices.regress_layout): whole on one device where it fits; else over
resident layer ranges (moeflow.evaluation.ranges_runner: Ray workers each holding a contiguous
range of decoder layers, the checkpoint read once) where hardware.spec has the devices; else
layer-streamed (moeflow.evaluation.streamed_runner: one decoder layer resident, read every
pass). Both give the loaded model's log-likelihoods and greedy generations; the probe and the
serving engines' adapter check, which load the whole model, are then not run (the stage says so).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.evaluation.baseline import (
    BASE_ARCH_TAG,
    Agreement,
    dir_checksum,
    load_baseline,
    model_fingerprint,
    record_baseline,
)
from moeflow.evaluation.gate import Section, against_base, against_baseline, identity
from moeflow.evaluation.probe import probe_model
from moeflow.evaluation.ranges_runner import Ranges
from moeflow.evaluation.record import flat_metrics
from moeflow.evaluation.report import failure_summary, gate_table, render_text
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.streamed_runner import StreamedRunner
from moeflow.evaluation.suite import load_suite, shipped_suites_version
from moeflow.evaluation.verdict import set_verdict
from moeflow.model.params import load_config_json
from moeflow.parallel.stage_prices import RegressLayout, regress_layout
from moeflow.serving.deployment import serving_experts_impl
from tasks.base import StageContext, StageSpec, gpu_if_cluster_has_one
from tasks.records import FinetuneRecord


def _targets(ctx: StageContext, suite) -> list[str]:
    names = ctx.config.regress.target_tasks
    names = list(suite.spec.target_tasks if names is None else names)
    for name in names:
        suite.task(name)  # UserError naming the suite's tasks
    return names


def _log(results: dict, report: str, probe: dict | None) -> None:
    """Log to the stage's MLflow run, when one is active (not in a bare unit call).

    Metrics: `eval/...` (adapter), `eval_base/...` (base), `eval_<tenant>/...`,
    `eval_calibrated/...`, and the base probe (`base/heldout_ppl_ratio`,
    `base/max_expert_load_skew`, per layer `base/expert_load_skew/<i>`).
    """
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow

    if mlflow.active_run() is None:
        return
    for label, result in results["models"].items():
        mlflow.log_metrics(flat_metrics(result, prefix=_prefix(label)))
    if probe:
        mlflow.log_metrics({"base/heldout_ppl": probe["heldout_ppl"],
                            "base/heldout_ppl_ratio": probe["ppl_ratio"],
                            "base/max_expert_load_skew": probe["max_load_skew"],
                            **{f"base/expert_load_skew/{i}": v
                               for i, v in enumerate(probe["load_max_over_mean"])}})
    mlflow.log_text(report, "regress/comparison.txt")
    mlflow.log_dict(results, "regress/results.json")


def _prefix(label: str) -> str:
    """MLflow metric prefix of a model: eval/ (adapter), eval_base/, eval_<tenant>/, ..."""
    if label == "adapter":
        return "eval/"
    return f"eval_{label.removeprefix('adapter ').strip(chr(39))}/"


def _probe(ctx: StageContext, suite, base_dir: str) -> dict | None:
    """Held-out perplexity and expert-load skew of the base (regress.probe_task)."""

    name = ctx.config.regress.probe_task
    if name is None or name not in [t.name for t in suite.tasks]:
        return None
    task = suite.task(name)
    if task.spec.type != "perplexity":
        raise UserError(f"regress.probe_task {name!r} is a {task.spec.type} task; "
                        f"name a perplexity task of {suite.path}")
    prompts = [r.get("prompt", "") + r.get("completion", "") if "completion" in r
               else r.get("prompt") or r.get("context") for t in suite.tasks for r in t.records]
    return probe_model(base_dir, [r["prompt"] + r["completion"] for r in task.records],
                       [p for p in prompts if p])


def resolve_layout(cfg: PipelineConfig, suite, model_dir: str) -> RegressLayout:
    """regress.layout resolved for the checkpoint `model_dir` on hardware.spec, as the dry run
    resolves it (moeflow.parallel.stage_prices.regress_layout) but on the checkpoint's own
    architecture and stored bytes, and the suite's records."""
    # lazy: the checkpoint's headers and config, read only where a layout is resolved
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.core.hardware import load_hardware
    from moeflow.model.params import count_params, spec_from_path

    spec = spec_from_path(model_dir)
    tensors = read_checkpoint(model_dir).tensors.values()
    stored = sum(t.nbytes for t in tensors) / max(1, sum(math.prod(t.shape) for t in tensors))  # per value
    records = [r for t in suite.tasks for r in t.records]
    # tokens per record as the dry run counts them (its text bytes / estimate.bytes_per_token)
    per_record = sum(len(json.dumps(r)) for r in records) / cfg.estimate.bytes_per_token / max(1, len(records))
    return regress_layout(cfg.regress, spec, count_params(spec), load_hardware(cfg.hardware.spec, cfg.hardware.nodes),
                          stored, per_record)


def _runner(lay: RegressLayout):
    """The runner class evaluate() builds for a layout (None: the in-memory one)."""
    if lay.kind == "ranges":
        return Ranges(tuple(lay.ranges))
    return StreamedRunner if lay.kind == "streamed" else None


def _evaluate(ctx: StageContext, suite, base_dir: str, adapter_dir: str, tenants: dict,
              calibrated: str | None, layouts: dict[str, RegressLayout]) -> dict[str, dict]:
    """Results by label: base, adapter, each tenant, the quantised model when present;
    `layouts`: each checkpoint's, filled in here."""
    sec = ctx.config.regress
    # the kernel the produced models will be served with (the operators stage's choice)
    impl = serving_experts_impl(ctx.inputs.get("operators"))

    def run(model: str, adapters: list[str | None]) -> list[dict]:
        if model not in layouts:
            layouts[model] = resolve_layout(ctx.config, suite, model)
        return evaluate(suite, model, adapters, shards=sec.shards, dtype=sec.dtype,
                        batch_size=sec.batch_size, seed=ctx.config.seed, experts_implementation=impl,
                        runner_cls=_runner(layouts[model]))

    base, adapted, *others = run(base_dir, [None, adapter_dir, *(a["adapter_dir"] for a in tenants.values())])
    models = {"base": base, "adapter": adapted,
              **{f"adapter {name!r}": r for name, r in zip(tenants, others)}}
    if calibrated:
        if not Path(calibrated, "config.json").is_file():
            raise UserError(f"calibrate checkpoint {calibrated}: not a Hugging Face "
                            f"checkpoint dir (no config.json)")
        models["calibrated"] = run(calibrated, [None])[0]
    return models


def _identities(manifest: str, adapter_dir: str, tenants: dict,
                calibrated: str | None) -> dict[str, str]:
    ids = {"base": identity(manifest), "adapter": identity(manifest, dir_checksum(adapter_dir)),
           **{f"adapter {n!r}": identity(manifest, dir_checksum(a["adapter_dir"]))
              for n, a in tenants.items()}}
    if calibrated:
        ids["calibrated"] = identity(model_fingerprint(calibrated))
    return ids


def _sections(ctx: StageContext, suite, models: dict, targets: dict, ids: dict,
              arch: str) -> tuple[list[Section], str | None]:
    """Every model vs the base, then vs the last baseline of the suite (if any) on a base of
    architecture `arch` (any, when regress.baseline names one)."""
    sec = ctx.config.regress
    quant = Agreement("gate", sec.calibrated_max_kl, sec.calibrated_min_token_agreement,
                      sec.calibrated_tie_margin)
    produced = {k: v for k, v in models.items() if k != "base"}
    if not sec.compare_base:
        produced = {k: v for k, v in produced.items() if k == "calibrated"}
    sections = against_base(models["base"], produced, targets, quant, sec.min_gain)
    if not (ctx.tracking_uri or sec.baseline):
        return sections, None  # a bare call: no tracking store, no named baseline
    found = load_baseline(sec.baseline, tracking_uri=ctx.tracking_uri, suite_sha256=suite.sha256,
                          base_arch=None if sec.baseline else arch)
    if not found:
        return sections, None
    run_id, reference = found
    label = f"baseline {reference.get('baseline', sec.baseline)!r}"
    rule = Agreement("gate", sec.max_kl, sec.min_token_agreement, sec.tie_margin)
    return sections + against_baseline(reference, label, models, ids, rule), run_id


def base_arch(ctx: StageContext) -> str:
    """The base checkpoint's architecture (config.json `architectures[0]`, else model_type):
    an unnamed baseline is looked up, and recorded, per architecture."""
    config = load_config_json(ctx.input("convert")["output_dir"])
    return str((config.get("architectures") or [config.get("model_type") or "unknown"])[0])


def _check_loadable(ctx: StageContext, base_dir: str, adapter_dir: str, tenants: dict) -> dict:
    """Each serving engine's own loading code on every adapter, before any evaluation
    (moeflow.serving.adapter_check): an adapter the deployment's engine would refuse, or load
    and never apply, fails here naming its tensors. vLLM checks the adapters it serves as LoRA
    (a fused expert one as its per-expert export; the one deploy.merge names it serves merged)."""
    # lazy: the serving package (the engine, torch) only where adapters are checked
    from moeflow.serving.adapter_check import check_adapters

    adapters = {"adapter": adapter_dir, **{n: a["adapter_dir"] for n, a in tenants.items()}}
    d = ctx.config.deploy
    lora = {n for n in adapters if not (d.merge and n == "adapter")}
    found = check_adapters(base_dir, adapters, d.backend, vllm_lora=lora)
    for engine, why in found["not_checked"].items():
        ctx.note(f"the {engine} engine's adapter check not run: {why}")
    return found


def run(ctx: StageContext) -> dict:
    """Evaluate base, adapters (and the quantised model), gate them, optionally record
    a baseline.

    Returns:
        {"passed", "metrics" (adapter, eval/...), "base_metrics", "results_path",
         "suite", "suite_sha256", "baseline_run_id", "manifest_sha256", "adapter_sha256",
         "gated" (model labels), "probe" (base held-out ppl ratio, expert-load skew)}

    Raises:
        UserError: a regression (naming the model, rule and metrics), or bad input.
    """
    sec = ctx.config.regress
    convert, finetune = ctx.input("convert"), ctx.input("finetune")
    base_dir, adapter_dir = convert["output_dir"], finetune["adapter_dir"]
    calibrated = ctx.inputs.get("calibrate", {}).get("checkpoint")  # optional upstream
    suite = load_suite(sec.suite)
    targets = {"adapter": _targets(ctx, suite)}
    # tenant adapters (finetune.adapters): evaluated with the same loaded base, each gated
    # on its own target tasks and on not regressing the others
    tenants = {name: a for name, a in (finetune.get("adapters") or {}).items() if a.get("tenant")}
    for name, info in tenants.items():
        for task in info.get("target_tasks") or []:
            suite.task(task)  # UserError naming the suite's tasks
        targets[f"adapter {name!r}"] = list(info.get("target_tasks") or [])
    layouts = {base_dir: resolve_layout(ctx.config, suite, base_dir)}
    lay = layouts[base_dir]
    streamed = lay.kind != "whole"  # nothing holds the whole model
    how = ("over resident layer ranges " + ", ".join(f"{a}-{b - 1}" for a, b in lay.ranges)
           if lay.kind == "ranges" else "layer-streamed")
    if streamed:
        ctx.note(f"regress: evaluated {how} ({lay.why}); the engines' adapter check and the base's probe "
                 f"load the whole model and are not run")
    loadable = ({"adapters": {}, "not_checked": {"all": f"the model is evaluated {how}"}} if streamed
                else _check_loadable(ctx, base_dir, adapter_dir, tenants))
    models = _evaluate(ctx, suite, base_dir, adapter_dir, tenants, calibrated, layouts)
    manifest = convert.get("manifest_sha256") or model_fingerprint(base_dir)
    ids = _identities(manifest, adapter_dir, tenants, calibrated)
    arch = base_arch(ctx)
    sections, baseline_run = _sections(ctx, suite, models, targets, ids, arch)
    probe = None if streamed else _probe(ctx, suite, base_dir)
    report = render_text(gate_table(sections, f"regress: suite {suite.name} "
                                              f"({suite.sha256[:12]})"), width=260)
    if baseline_run is None:
        report += (f"\nno recorded baseline for suite {suite.name} ({suite.sha256[:12]})"
                   + ("" if sec.baseline else f" on a {arch} base") + "\n")
    if probe:
        report += (f"base: held-out perplexity {probe['heldout_ppl']:.2f} = "
                   f"{probe['ppl_ratio']:.3f} x uniform ({probe['uniform_ppl']:.0f}); "
                   f"max/mean expert load per MoE layer "
                   f"{', '.join(f'{v:.2f}' for v in probe['load_max_over_mean'])}\n")
    failed = [s for s in sections if s.failed]
    extra = {"manifest_sha256": manifest, "adapter_sha256": dir_checksum(adapter_dir),
             "config": ctx.config.model_dump(mode="json"), "seed": ctx.config.seed,
             "identities": ids, "calibrated_checkpoint": calibrated, "streamed": lay.kind == "streamed",
             "layout": {m: {"kind": v.kind, "ranges": v.ranges} for m, v in layouts.items()}}
    results = {"passed": not failed, "base": models["base"], "adapter": models["adapter"],
               "models": models, "report": report, "probe": probe,
               "tenants": {n: models[f"adapter {n!r}"] for n in tenants},
               "baseline_run_id": baseline_run, **extra}
    path = ctx.write_json("results.json", results)
    table = Path(ctx.out_dir) / "comparison.txt"
    table.with_name(table.name + ".tmp").write_text(report)
    table.with_name(table.name + ".tmp").replace(table)  # never half-written
    _log(results, report, probe)
    _verdicts(ctx, finetune, sections, models, ids)
    print(report, flush=True)
    if failed:
        raise UserError("regress: " + "; ".join(f"{s.title}: {failure_summary(s.rows, s.reference)}"
                                                for s in failed) + f" (table: {table})")
    if sec.record_baseline:
        # lazy: mlflow: heavy, loaded only when this runs
        import mlflow

        active = mlflow.active_run()
        others = {k: v for k, v in models.items() if k != "adapter"}
        record_baseline(sec.record_baseline, models["adapter"], tracking_uri=ctx.tracking_uri,
                        experiment=ctx.config.experiment, tags={BASE_ARCH_TAG: arch},
                        run_id=active.info.run_id if active else None,
                        extra=dict(extra, models=others))
    return {"passed": True, "metrics": flat_metrics(models["adapter"]),
            "base_metrics": flat_metrics(models["base"], prefix="eval_base/"),
            "results_path": str(path), "suite": suite.name, "suite_sha256": suite.sha256,
            "baseline_run_id": baseline_run, "manifest_sha256": manifest,
            "adapter_sha256": extra["adapter_sha256"], "gated": list(models), "loadable": loadable,
            "streamed": lay.kind == "streamed", "layout": lay.kind, "ranges": lay.ranges,
            "probe": probe and {k: probe[k] for k in ("ppl_ratio", "max_load_skew",
                                                      "load_max_over_mean")}}


def _verdicts(ctx: StageContext, finetune: FinetuneRecord, sections: list[Section],
              models: dict[str, dict] | None = None, ids: dict[str, str] | None = None) -> None:
    """Gate verdicts on the registered adapter versions this stage gated (moeflow.evaluation.verdict):
    what `moeflow deploy` checks, and what `moeflow watch` then skips. Each version's own
    outputs are logged beside them (`verdict/<model>/v<version>/results.json`, named by the
    version's results tag), so the watcher compares the lineage's next version with them."""
    if not ctx.tracking_uri:
        return
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    active = mlflow.active_run()
    run_id = active.info.run_id if active else None
    adapters = finetune.get("adapters") or {}
    for label, rec in [("adapter", finetune)] + [(f"adapter {n!r}", a) for n, a in adapters.items()
                                                   if a.get("tenant")]:
        name, version = rec.get("registered_model"), rec.get("model_version")
        if not (name and version):
            continue
        mine = [s for s in sections if s.model == label]
        bad = [s for s in mine if s.failed]
        reason = "; ".join(f"{s.title}: {failure_summary(s.rows, s.reference)}" for s in bad) or \
            "regress stage: no regression"
        try:
            results = _record_outputs(client, run_id, name, version, (models or {}).get(label),
                                      (ids or {}).get(label))
            set_verdict(client, name, version, not bad, run_id, reason,
                        ", ".join(s.reference for s in mine) or "none", results=results)
        except MlflowException as exc:  # a version another store holds: the gate result stands
            ctx.note(f"no verdict tag on models:/{name}/{version}: {str(exc).splitlines()[0][:200]}")


def _record_outputs(client, run_id: str | None, name: str, version: str, result: dict | None,
                    ident: str | None) -> str | None:
    """Log a gated version's outputs as `moeflow watch` records its own (identity, result);
    the artifact path, or None when there is no run to log to."""
    if not (run_id and result is not None):
        return None
    path = f"verdict/{name}/v{version}/results.json"
    client.log_dict(run_id, {"identity": ident, "kind": "adapter", "result": result}, path)
    return path


def _stage_gpus(cfg) -> float:
    """In-process evaluation (regress.shards 1) runs on the stage's own GPU when the cluster has
    GPUs; sharded evaluation's shards ask for theirs, so the stage itself holds none."""
    return gpu_if_cluster_has_one(cfg) if cfg.regress.shards <= 1 else 0.0


STAGE = StageSpec(
    name="regress",
    run=run,
    version=shipped_suites_version(),
    upstream=("convert", "finetune"),
    # the quantised checkpoint is gated too when calibrate runs; models are evaluated with the
    # operators stage's serving kernel when it runs
    after=("calibrate", "operators"),
    sections=("model", "regress"),
    num_gpus=_stage_gpus,
    fingerprint=("model.path", "regress.suite"),
    description="evaluate base and adapter on a fixed suite; fail on regression vs base "
                "and vs the recorded baseline",
)
