"""Stage `operators` (step 3): expert-load profile, EPLB placement, operator choices.

    moeflow run configs/demo.yaml --stages operators     (through the pipeline)
    moeflow operators configs/demo.yaml                  (the stage and what it needs)
    moeflow eplb LOAD.json --ep 32 --redundant 32 --nodes 4 --groups 8   (placement alone)

What it does, on the converted checkpoint:
1. counts tokens per (MoE layer, expert) from the routers' own decisions on the
   calibration set (Ray tasks for big sets): expert_load.json + heatmap; a model larger
   than one device of the hardware spec (or `operators.streamed: always`) runs one
   decoder layer at a time (moeflow.quant.streamed), so no process holds more than a layer;
2. places experts for the plan's EP size (moeflow/operators/eplb.py), reports
   per-layer balancedness before/after, renders the placement for SGLang and
   vLLM, and — transformers having no expert replicas — permutes the experts in
   a copy of the checkpoint when that lowers the heaviest rank;
3. times each experts implementation on one MoE block of the model's own shapes
   (forward for serving, forward+backward for training), token dispatch by
   all-to-all vs all-gather on 2 gloo ranks, and the KV-cache bytes;
4. writes operators.json, whose choices finetune and deploy apply.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeflow.core.config import PipelineConfig
from moeflow.core.devices import local_device
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.operators import eplb, opbench
from moeflow.operators import placement as PL
from moeflow.operators import profile as P
from moeflow.operators.dist import dispatch_bench, ep_rank_load
from moeflow.operators.placement import routing_groups
from moeflow.operators.profile import calibration_texts
from tasks.base import StageContext, StageSpec, gpu_if_cluster_has_one, refuse_kept_base, streams_layers


def _model_dir(ctx: StageContext) -> str:
    return str(ctx.inputs.get("convert", {}).get("output_dir") or ctx.config.model.path)


def _device() -> str:
    """cuda when Ray granted this stage a GPU (outside Ray: when torch sees one), else cpu.
    Not torch.cuda.is_available() alone: a Ray task granted no GPU may still see the host's."""

    return local_device().type


def layout(cfg: PipelineConfig, plan: dict, model_config: dict, experts: int) -> dict:
    """EP size, nodes, groups and physical slots the placement targets.

    EP: `operators.ep_size`, else the larger of the plan's training and serving EP
    degrees. Nodes: how many of the hardware's nodes EP spans.
    """

    o = cfg.operators
    ep = o.ep_size or max(int(plan.get("expert_parallel") or 1),
                          int((plan.get("serving") or {}).get("expert_parallel") or 1))
    per_node = load_hardware(cfg.hardware.spec, cfg.hardware.nodes).devices_per_node
    nodes = ep // per_node if ep > per_node and ep % per_node == 0 else 1
    groups = o.num_groups or routing_groups(model_config)
    return {"ep": ep, "nodes": nodes, "groups": groups, "redundant": o.num_redundant_experts,
            "physical": experts + o.num_redundant_experts}


def profile_load(ctx: StageContext, model_dir: str):
    """The load record (matrix [L][E], hot experts, routers, ...) and its heatmap figure
    (also written to out_dir/expert_load.png)."""

    o = ctx.config.operators
    texts, source = P.calibration_texts(o.calibration_file, o.max_calibration)
    dtype = "float32" if ctx.config.model.dtype == "float32" else "bfloat16"
    streamed = streams_layers(ctx.config, o.streamed, model_dir, dtype)
    load = P.profile(model_dir, texts, dtype=dtype, shard_size=o.shard_size, max_tokens=o.max_tokens,
                     device=_device(), streamed=streamed)
    counts = np.asarray(load["counts"])  # [L, E]
    load.update(source=source, streamed=streamed, texts=len(texts), hot_experts=P.hot_experts(counts, o.hot_factor),
                shape=list(counts.shape))
    fig = P.heatmap(counts, load["layers"], f"routed tokens per expert ({len(texts)} texts)")
    fig.savefig(ctx.out_dir / "expert_load.png", dpi=110)
    return load, fig


def place(ctx: StageContext, model_dir: str, load: dict, lay: dict) -> dict:
    """EPLB placement + engine renders + (when it helps) the permuted checkpoint."""

    counts = np.asarray(load["counts"], dtype=np.float64)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(counts, lay["physical"], lay["groups"],
                                                      lay["nodes"], lay["ep"])
    summary = eplb.summary(counts, phy2log, logcnt, lay["ep"])
    summary.update(logical_count=logcnt.tolist(), layout=lay,
                   mode="hierarchical" if lay["groups"] % lay["nodes"] == 0 and lay["nodes"] > 1 else "global")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers = int(PL.text_config(config).get("num_hidden_layers") or max(load["layers"]) + 1)
    sglang = ctx.write_json("sglang_expert_location.json",
                            PL.sglang_expert_location(phy2log, load["layers"], layers))
    engines = {"vllm": PL.vllm_eplb_args(lay["redundant"]),
               "sglang": {"args": ["--enable-eplb", "--ep-num-redundant-experts", str(lay["redundant"]),
                                   "--init-expert-location", str(sglang)], "file": str(sglang)}}
    permutation = _permute(ctx, model_dir, load, counts, lay)
    return {"eplb": summary, "engines": engines, "permutation": permutation}


def _permute(ctx: StageContext, model_dir: str, load: dict, counts: np.ndarray, lay: dict) -> dict:
    o = ctx.config.operators
    if o.apply_placement == "never" or (o.apply_placement == "auto" and lay["ep"] == 1):
        return {"applied": False, "reason": f"apply_placement={o.apply_placement}, EP {lay['ep']}"}
    plan = PL.plan_permutation(counts, lay["ep"], lay["groups"])
    record = {"applied": False, "ep": lay["ep"], "before": plan["before"], "after": plan["after"],
              "perms": plan["perms"]}
    if not plan["changed"] and o.apply_placement == "auto":
        return dict(record, reason="no permutation lowers the heaviest rank")
    res = PL.apply_permutation(model_dir, ctx.out_dir / "placed", load["routers"], plan["perms"],
                               {"ep": lay["ep"], "load": str(ctx.out_dir / "expert_load.json")})
    record.update(res, applied=True)
    if o.measure_ep_load:
        texts, _ = calibration_texts(o.calibration_file, o.max_calibration)
        record["ep_load"] = {"before": ep_rank_load(model_dir, texts, lay["ep"]),
                             "after": ep_rank_load(res["model_path"], texts, lay["ep"])}
    return record


def time_operators(ctx: StageContext, model_dir: str, plan: dict) -> dict:
    """Experts implementations on the model's block, dispatch, KV cache."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoConfig


    cfg, o = ctx.config, ctx.config.operators
    dtype = cfg.model.dtype if o.bench_dtype == "auto" else o.bench_dtype
    dtype = "bfloat16" if dtype == "float16" else dtype
    device = _device()
    experts_lora = any("expert" in t for t in cfg.lora.target_modules)
    block = opbench.bench_block(AutoConfig.from_pretrained(model_dir), tokens=o.bench_tokens, dtype=dtype,
                                device=device, lora_rank=cfg.lora.rank if experts_lora else None,
                                max_block_gb=o.max_block_gb, reps=o.bench_reps)
    shape = block["shape"]
    dispatch = None
    if o.dispatch and shape["experts_built"] % 2 == 0:
        dispatch = dispatch_bench(block["tokens"], shape["hidden"], shape["experts_built"],
                                  shape["top_k"], dtype)
    tp = int((plan.get("serving") or {}).get("tensor_parallel") or plan.get("tensor_parallel") or 1)
    kv = opbench.kv_cache(model_dir, cfg.plan.kv_dtype, cfg.plan.context, tp)
    return {"experts": block, "dispatch": dispatch, "kv_cache": kv}


def _log_mlflow(ctx: StageContext, paths: list[Path], fig, result: dict) -> None:
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow

    if mlflow.active_run() is None:
        return
    for path in paths:
        mlflow.log_artifact(str(path), artifact_path="operators")
    mlflow.log_figure(fig, "operators/expert_load.png")
    eplb_summary = result["placement"]["eplb"]
    for row in eplb_summary["layers"]:
        metrics = {"balancedness_after": row["after"]}
        if row["before"] is not None:
            metrics["balancedness_before"] = row["before"]
        mlflow.log_metrics(metrics, step=row["layer"])
    whole = {k: eplb_summary[k] for k in ("balancedness_before", "balancedness_after") if eplb_summary[k] is not None}
    mlflow.log_metrics({f"model.{k}": v for k, v in whole.items()})
    chosen = result["experts_implementation"]
    mlflow.log_params({"experts_implementation.training": chosen["training"],
                       "experts_implementation.serving": chosen["serving"],
                       "placement_applied": result["placement_applied"]})


# the stage's placement permutes expert tensors in a copy of the checkpoint and its dispatch
# bench shards the experts (EP): both work on expert parameters, which a packed base has not
KEPT_WHY = ("expert placement permutes and EP-shards expert parameters, and packed experts "
            "are not parameters")


def run(ctx: StageContext) -> dict:
    """Profile, place, time; returns the operators result record (see CONTRACTS in DESIGN)."""
    model_dir = _model_dir(ctx)
    refuse_kept_base("operators", KEPT_WHY, model_dir=model_dir)
    plan = ctx.inputs.get("plan", {}).get("plan", {})
    load, fig = profile_load(ctx, model_dir)
    load_path = ctx.write_json("expert_load.json", load)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    lay = layout(ctx.config, plan, config, len(load["counts"][0]))
    placed = place(ctx, model_dir, load, lay)
    ops = time_operators(ctx, model_dir, plan)
    chosen = ops["experts"]["chosen"]
    applied = placed["permutation"]["applied"]
    operators = {"experts_implementation": chosen, "experts": ops["experts"], "dispatch": ops["dispatch"],
                 "kv_cache": ops["kv_cache"], "placement": placed, "load_path": str(load_path),
                 # a store URI with the workdir in a store: `moeflow rebalance` reads it from anywhere
                 "hot_experts": load["hot_experts"], "model_dir": ctx.uri_of(model_dir)}
    ops_path = ctx.write_json("operators.json", operators)
    placement_path = ctx.write_json("placement.json", placed["eplb"])
    record = {"operators_path": str(ops_path), "experts_implementation": chosen,
              "load_path": str(load_path), "placement_applied": applied,
              "model_path": placed["permutation"].get("model_path") if applied else model_dir,
              "balancedness_before": placed["eplb"]["balancedness_before"],
              "balancedness_after": placed["eplb"]["balancedness_after"],
              "ep_size": lay["ep"], "heatmap": str(ctx.out_dir / "expert_load.png")}
    _log_mlflow(ctx, [ops_path, load_path, placement_path, ctx.out_dir / "sglang_expert_location.json"],
                fig, dict(operators, placement_applied=applied))
    return record


def _preflight(cfg: PipelineConfig) -> None:
    """Before anything runs: the calibration file parses; an explicit EP size divides
    the model's experts + redundant ones."""
    # lazy: loads torch, which importing this module does not
    from moeflow.checkpoint.parse import num_experts

    refuse_kept_base("operators", KEPT_WHY, cfg=cfg)
    o = cfg.operators
    if o.calibration_file:
        calibration_texts(o.calibration_file, 1)
    path = Path(cfg.model.path) / "config.json"
    experts = num_experts(json.loads(path.read_text())) if o.ep_size and path.is_file() else None
    if experts and o.ep_size and (experts + o.num_redundant_experts) % o.ep_size:
        raise UserError(f"operators.ep_size {o.ep_size} does not divide experts + redundant = "
                        f"{experts} + {o.num_redundant_experts}")


STAGE = StageSpec(
    name="operators",
    run=run,
    upstream=("convert", "plan"),
    sections=("model", "hardware", "lora", "plan", "operators"),
    fingerprint=("operators.calibration_file", "hardware.spec"),
    preflight=_preflight,
    num_gpus=gpu_if_cluster_has_one,  # load profile and kernel timings on the device that will run them
    description="expert-load profile, EPLB placement of hot experts, experts kernels timed on the model's shapes",
)
