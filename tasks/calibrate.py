"""Stage `calibrate` (step 4): quantise, compare layer by layer on the golden set, plan precision.

    moeflow run configs/demo.yaml --only calibrate     (through the pipeline)
    moeflow calibrate configs/demo.yaml                 (this stage and its upstream)

Quantises the pipeline's model (the operators stage's `model_path` when present,
else the converted checkpoint, else `model.path`) with `calibrate.scheme` into
`<out>/quantized` (compressed-tensors format), runs the golden set through the
baseline and the quantised model one decoder layer at a time, names the first
divergent layer (isolated mode) -- on a model larger than a device, split over Ray
workers by ranges of layers (`calibrate.layer_workers`) and, where one layer exceeds a
device, by groups of each layer's routed experts (`calibrate.expert_groups`) -- and
returns the most sensitive modules to high precision until the end-to-end check holds. Writes `report.json`, `table.txt`
and `layers.png`, logs them to MLflow, and fails (UserError) when the check
does not hold within `calibrate.max_plan_steps` rounds.
"""

from __future__ import annotations

import math
from pathlib import Path

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.evaluation.suite import load_suite, shipped_suites_version
from moeflow.quant.golden import golden_samples
from moeflow.quant.report import log_mlflow, plot, render_text
from tasks.base import StageContext, StageSpec, gpu_if_cluster_has_one, refuse_kept_base, streams_layers


def source_dir(ctx: StageContext) -> str:
    """The checkpoint to quantise: operators' (permuted) one, else convert's, else model.path."""
    return str(ctx.inputs.get("operators", {}).get("model_path")
               or ctx.inputs.get("convert", {}).get("output_dir") or ctx.config.model.path)


def calibrate(src: str, out_dir: Path, sec, log=print, layer_workers: int = 1, expert_groups: int = 1) -> dict:
    """Quantise `src` under `out_dir`, compare, plan; returns the report dict.
    `layer_workers` > 1: both split over Ray tasks by ranges of decoder layers;
    `expert_groups` > 1: each layer's routed experts split over that many workers."""
    # lazy: loads torch, which importing this module does not
    from moeflow.quant.plan import precision_plan
    from moeflow.quant.quantize import default_ignore
    from moeflow.quant.schemes import get_scheme
    from moeflow.quant.source import ModelSource

    scheme = get_scheme(sec.scheme)
    samples = golden_samples(load_suite(sec.golden), src, limit=sec.samples,
                             max_tokens=sec.max_tokens, note=log)
    ignore = default_ignore(ModelSource(src), quantize_vision=sec.quantize_vision) + list(sec.ignore)
    plan = precision_plan(src, out_dir / "quantized", scheme, ignore, samples,
                          min_cosine=sec.min_logits_cosine, min_top1=sec.min_top1_agreement,
                          enabled=sec.precision_plan, step=sec.plan_step,
                          max_steps=sec.max_plan_steps, shards=sec.shards,
                          layer_workers=layer_workers, expert_groups=expert_groups,
                          tie_margin=sec.tie_margin, log=log)
    first, shipped = plan["first"], plan["result"]
    # layers / first_divergent: every eligible module quantised (where the scheme breaks
    # precision); final / shipped: the written checkpoint, after the precision plan
    return {"scheme": scheme.name, "checkpoint": plan["quantize"]["output_dir"], "baseline": src,
            "first_divergent": first["first_divergent"], "layers": first["layers"],
            "precision_plan": {"ignore": plan["ignore"], "added": plan["added"],
                               "steps": plan["steps"], "holds": plan["holds"]},
            "final": shipped["final"], "samples": len(samples),
            "shipped": {"first_divergent": shipped["first_divergent"],
                        "layers": shipped["layers"]},
            "loader": "transformers" if scheme.native else "moeflow (dequantising reader)",
            "quantize": plan["quantize"],
            # each process's peak above its level before its first tensor (moeflow.core.memmeter)
            "memory": {"quantize": plan["quantize"]["memory"], "compare": shipped["memory"]},
            "check": {"min_logits_cosine": sec.min_logits_cosine,
                      "min_top1_agreement": sec.min_top1_agreement, "tie_margin": sec.tie_margin}}


def run(ctx: StageContext) -> dict:
    """Calibrate the pipeline's model.

    Returns:
        {"checkpoint", "scheme", "report_path", "first_divergent", "final",
         "precision_plan": {"ignore"}, "native_load"}
    """

    sec = ctx.config.calibrate
    refuse_kept_base("calibrate", KEPT_WHY, model_dir=source_dir(ctx))
    workers = layer_workers(ctx.config, source_dir(ctx))
    groups = expert_groups(ctx.config, source_dir(ctx))
    report = calibrate(source_dir(ctx), Path(ctx.out_dir), sec, log=ctx.note,  # the terminal sees it
                       layer_workers=workers, expert_groups=groups)
    report["layer_workers"] = workers
    report["expert_groups"] = groups
    path = ctx.write_json("report.json", report)
    text = render_text(report, f"calibrate {report['scheme']}: baseline vs quantised")
    table = Path(ctx.out_dir) / "table.txt"
    table.with_name("table.txt.tmp").write_text(text)
    table.with_name("table.txt.tmp").replace(table)
    fig = plot(report, Path(ctx.out_dir) / "layers.png")
    log_mlflow(report, text, fig)
    print(text, flush=True)
    if not report["precision_plan"]["holds"]:
        final = report["final"]
        raise UserError(f"calibrate: end-to-end check not met after "
                        f"{len(report['precision_plan']['steps']) - 1} plan rounds: logits cosine "
                        f"{final['logits_cosine']:.6f} (min {sec.min_logits_cosine}), top-1 "
                        f"agreement {final['top1_agreement']:.4f} (min {sec.min_top1_agreement}); "
                        f"report: {path}")
    return {"checkpoint": report["checkpoint"], "scheme": report["scheme"],
            "report_path": str(path), "first_divergent": report["first_divergent"],
            "final": report["final"], "precision_plan": {"ignore": report["precision_plan"]["ignore"]},
            "native_load": report["quantize"]["native_load"]}


def layer_workers(cfg: PipelineConfig, src: str) -> int:
    """calibrate.layer_workers, auto resolved: 1 while the model in float32 (the compare's
    dtype) fits one device of hardware.spec, else one worker per device of a node."""
    # lazy: loads torch, which importing this module does not
    from moeflow.core.hardware import load_hardware
    from moeflow.quant.source import ModelSource

    setting = cfg.calibrate.layer_workers
    if setting != "auto":
        return int(setting)
    if not streams_layers(cfg, "auto", src, "float32"):
        return 1
    return min(ModelSource(src).num_layers, load_hardware(cfg.hardware.spec, cfg.hardware.nodes).devices_per_node)


def expert_groups(cfg: PipelineConfig, src: str) -> int:
    """calibrate.expert_groups, auto resolved as the planner resolves it (the dry run's
    moeflow.parallel.footprint.calibrate_layout, on this checkpoint's spec and stored bytes
    per value): the fewest groups of each layer's routed experts whose fullest worker
    (float32 part, its reads, the recorded inputs of `calibrate.samples` x
    `calibrate.max_tokens` tokens, the compute runtime) fits one device of hardware.spec;
    1 when a whole layer does."""
    # lazy: loads torch, which importing this module does not
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.core.hardware import load_hardware
    from moeflow.model.params import count_params, spec_from_path
    from moeflow.parallel.footprint import calibrate_layout

    setting = cfg.calibrate.expert_groups
    if setting != "auto":
        return int(setting)
    spec = spec_from_path(src)
    counts = count_params(spec)
    tensors = read_checkpoint(src).tensors.values()
    stored = sum(t.nbytes for t in tensors) / max(1, sum(math.prod(t.shape) for t in tensors))  # per value
    hw = load_hardware(cfg.hardware.spec, cfg.hardware.nodes)
    tokens = cfg.calibrate.samples * cfg.calibrate.max_tokens
    return calibrate_layout(spec, counts, hw, layer_workers(cfg, src), "auto", stored, tokens).expert_groups


KEPT_WHY = "calibrate quantises a full-precision base and compares with it"


def preflight(cfg: PipelineConfig) -> None:
    """Cheap checks: the scheme exists and the golden suite loads with at least one record;
    the base will not be a quantised release kept as stored (`convert.dtype: keep`)."""
    # lazy: loads torch, which importing this module does not
    from moeflow.quant.schemes import get_scheme

    refuse_kept_base("calibrate", KEPT_WHY, cfg=cfg)

    get_scheme(cfg.calibrate.scheme)
    suite = load_suite(cfg.calibrate.golden)
    if not any(t.records for t in suite.tasks):
        raise UserError(f"calibrate.golden {suite.path}: the golden set is empty")



def _stage_gpus(cfg: PipelineConfig) -> float:
    """The compare runs on the stage's own GPU when the cluster has GPUs (calibrate.shards 1);
    sharded compares' shards ask for theirs, so the stage itself holds none. With layer
    workers the stage's own process still runs the front (embeddings, head)."""
    return gpu_if_cluster_has_one(cfg) if cfg.calibrate.shards <= 1 else 0.0


STAGE = StageSpec(
    name="calibrate",
    run=run,
    upstream=("convert", "plan"),
    after=("operators",),  # its permuted checkpoint when it ran
    sections=("model", "calibrate"),
    fingerprint=("model.path", "calibrate.golden"),
    version=shipped_suites_version(),  # the shipped golden set is its default
    num_cpus=1,
    num_gpus=_stage_gpus,
    preflight=preflight,
    description="quantise (compressed-tensors), compare layer by layer on the golden set, plan precision",
)
