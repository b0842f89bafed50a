"""The stages at scale, rehearsed here: a checkpoint 4x larger than a device, on Ray workers.

    .venv/bin/python benchmarks/rehearse_streamed.py            # ~10-20 min on 2 cores
    .venv/bin/python benchmarks/rehearse_streamed.py --layers 48 --json out.json
    .venv/bin/python benchmarks/rehearse_streamed.py --only-regress   # regress's layer ranges, ~5 min

The device is `cluster/hardware/cpu-budget.yaml`: a CPU worker allowed 150 MB for
the model. A random Qwen3-MoE of `--layers` decoder layers (hidden 384, 16 experts,
about 15 MB per layer in bf16) is written, converted (one file per layer), and
run through:

- operators' load profile: layer-streamed (the spec's `auto`), its texts split over
  2 Ray tasks; against the whole model loaded in one process (cpu-local): the counts
  must be equal;
- calibrate (fp8): quantisation and compare split over 2 layer workers (auto);
  against one process: the report must be equal;
- convert, on a Ray worker, of a second random Qwen3-MoE whose every layer exceeds the
  device in float32 (benchmarks/rehearse_stages.py: 8 layers of 32 wide experts), and
  calibrate of it split inside each layer too (expert groups, auto) against one process;
- regress of the first model with a LoRA adapter: base and adapter evaluated
  layer-streamed (auto) on a Ray worker, and over resident layer ranges (the stage's
  layout on REGRESS_NODES nodes of the spec: Ray actors each holding as many layers as
  the planner fits one device, the worker holding the front), against the model loaded
  whole: the same metrics (1e-5) and the same gate verdict;
- serving and deploy of a float32 Qwen3-MoE of 4x the device on vLLM (deploy.backend
  auto) in the plan's TP / PP layout on a node of 8 such devices (cpu-budget-node8.yaml:
  Ray Serve LLM keeps a CPU engine on one node), each vLLM worker's peak within the
  budget, its greedy completions equal to the local engine's on one device
  (benchmarks/rehearse_serving.py, on a Ray of its own; where the vLLM environment exists,
  else said);
- finetune (unless --no-finetune): the plan stage's LoRA plan for FT_NODES nodes of the
  spec run by the finetune stage (Ray Train, gloo) on a Ray cluster of that many nodes
  on this host, 3 steps, each rank's peak within the budget; against the same steps in one
  process (its losses within benchmarks/rehearse_stages.FT_TOLERANCE). The model is the
  rehearsal's own (FT_LAYERS, 40 layers: 4x the device) on 4 nodes, 8 ranks (EP8 FSDP8
  CP2), each rank's layers copied out of the checkpoint's file mappings
  (moeflow.training.worker.own_weights).

Convert's peaks are those of its processes: each output file's, each file's tensor
verification, and the functional check (layer by layer within the budget).

Each process's model-attributable peak is measured by moeflow.core.memmeter: the
kernel's resident-set high-water mark (VmHWM, reset when the process is about to
read its first tensor) minus the resident set at that moment. Every streamed or
split process must stay within the budget; the one-process runs are printed for
scale. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET_SPEC = ROOT / "cluster" / "hardware" / "cpu-budget.yaml"
SHAPE = dict(hidden_size=384, moe_intermediate_size=384, num_experts=16, num_experts_per_tok=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=48, intermediate_size=768)


def build(work: Path, layers: int) -> Path:
    """A random checkpoint of `layers` layers, converted: the converted dir."""
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.core.hardware import load_hardware
    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model("qwen3_moe", work / "src", num_hidden_layers=layers, max_shard_size="50MB",
                            **SHAPE)
    convert_checkpoint(src, work / "converted", dtype="keep",
                       memory_budget=load_hardware(str(BUDGET_SPEC)).memory_bytes)
    return work / "converted"


def _config(model: Path, hardware: str, work: Path) -> dict:
    from moeflow.core.config import validate

    return validate({"model": {"path": str(model), "dtype": "float32"}, "hardware": hardware,
                     "workdir": str(work), "operators": {"max_calibration": 16, "shard_size": 8,
                                                          "max_tokens": 64},
                     "calibrate": {"samples": 6, "max_tokens": 48, "min_logits_cosine": 0.0,
                                   "min_top1_agreement": 0.0, "max_plan_steps": 0}})


def operators(model: Path, hardware: str, out: Path) -> dict:
    from tasks.base import StageContext
    from tasks.operators import profile_load

    out.mkdir(parents=True)
    ctx = StageContext(stage="operators", config=_config(model, hardware, out), inputs={}, out_dir=out)
    return profile_load(ctx, str(model))[0]


def calibrate(model: Path, hardware: str, out: Path) -> dict:
    from tasks.calibrate import calibrate as run
    from tasks.calibrate import layer_workers

    out.mkdir(parents=True)
    cfg = _config(model, hardware, out)
    workers = layer_workers(cfg, str(model))
    return dict(run(str(model), out, cfg.calibrate, log=lambda *_: None, layer_workers=workers),
                layer_workers=workers)


def peaks(op: dict, cal: dict) -> dict[str, list[int | None]]:
    """Per stage process: its model-attributable peak, bytes."""
    compare = cal["memory"]["compare"]
    return {"operators (profile shards)": [m["peak_bytes"] for m in op["memory"]],
            "calibrate quantise (ranges)": [m["peak_bytes"] for m in cal["memory"]["quantize"]],
            "calibrate compare front (stage)": [c["front"]["peak_bytes"] for c in compare],
            "calibrate compare (ranges)": [m["peak_bytes"] for c in compare for m in c["layers"]]}


def _without_memory(report: dict) -> dict:
    out = {k: v for k, v in report.items() if k not in ("memory", "layer_workers", "expert_groups", "checkpoint")}
    out["quantize"] = {k: v for k, v in report["quantize"].items()
                       if k not in ("memory", "seconds", "output_dir")}
    return out


def rehearse(work: Path, layers: int = 40) -> dict:
    """Build, run both ways, measure; returns the record (see `checks`)."""
    import ray
    import torch

    from moeflow.core.hardware import load_hardware
    from moeflow.quant.streamed import resident_bytes

    torch.set_num_threads(1)  # as a Ray worker of 1 CPU: the same float sums on both sides
    budget = load_hardware(str(BUDGET_SPEC)).memory_bytes
    model = build(work, layers)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    started = not ray.is_initialized()
    temp = tempfile.mkdtemp(prefix="/tmp/mfreh")  # Ray's own, short (socket paths)
    try:
        if started:
            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        small = {"operators": operators(model, str(BUDGET_SPEC), work / "op-small"),
                 "calibrate": calibrate(model, str(BUDGET_SPEC), work / "cal-small")}
        big = {"operators": operators(model, "cpu-local", work / "op-big"),
               "calibrate": calibrate(model, "cpu-local", work / "cal-big")}
        later = _later_stages(work, model)
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    # on a Ray of its own (a node of its spec's 8 devices): a caller's Ray, still connected, is refused there
    serving = _serving_stage(work)
    return {"budget_bytes": budget, "checkpoint_bytes": size, "model_fp32_bytes":
            resident_bytes(model, torch.float32), "layers": layers,
            "streamed": small["operators"]["streamed"], "layer_workers": small["calibrate"]["layer_workers"],
            "peaks": {**peaks(small["operators"], small["calibrate"]), **later["peaks"]},
            "one_device_peaks": {**peaks(big["operators"], big["calibrate"]), **later["one_device_peaks"]},
            "counts_equal": small["operators"]["counts"] == big["operators"]["counts"],
            "report_equal": _reports_equal(small["calibrate"], big["calibrate"]), **later["record"],
            "serving": serving}


def _serving_stage(work: Path) -> dict:
    """serving + deploy on vLLM (benchmarks/rehearse_serving.py), or why they cannot run here."""
    import benchmarks.rehearse_serving as RS
    from moeflow.serving.vllm_run import vllm_missing

    if why := vllm_missing():
        return {"skipped": why}
    return RS.rehearse(work / "serving")


def _later_stages(work: Path, model: Path) -> dict:
    """convert + calibrate with expert groups on the wide model; regress streamed on `model`."""
    import benchmarks.rehearse_stages as S
    from moeflow.core.hardware import load_hardware
    from tasks.base import streams_layers

    wide, conv, conv_one = S.build_wide(work, load_hardware(str(BUDGET_SPEC)).memory_bytes)
    groups = {hw: S.calibrate_groups(wide, hw, work / f"groups-{n}", _config)
              for n, hw in (("small", str(BUDGET_SPEC)), ("big", "cpu-local"))}
    adapter = S.make_adapter(model, work / "adapter")
    streamed = streams_layers(_config(model, str(BUDGET_SPEC), work), "auto", str(model), "float32")
    reg = {"small": S.regress(model, adapter, streamed), "big": S.regress(model, adapter, False)}
    ranges = regress_ranges(work, model, adapter, reg["big"])
    plans = [S.plan_probe(model, BUDGET_SPEC, nodes) for nodes in (1, 4)]  # 2 and 8 devices
    small, big = groups[str(BUDGET_SPEC)], groups["cpu-local"]
    return {"peaks": {**S.convert_peaks(conv), **S.group_peaks(small),
                      "regress (streamed)": [reg["small"]["peak"]["peak_bytes"]], **ranges["peaks"]},
            "one_device_peaks": {**S.convert_peaks(conv_one), **S.group_peaks(big),
                                 "regress (streamed)": [reg["big"]["peak"]["peak_bytes"]],
                                 **ranges["one_device_peaks"]},
            "record": {"wide_checkpoint_bytes": sum(p.stat().st_size for p in wide.glob("*.safetensors")),
                       "convert_equal": conv["tensors"] == conv_one["tensors"] and conv["passed"]
                       and conv_one["passed"], "convert_check": conv["functional"],
                       "expert_groups": small["expert_groups"], "regress_streamed": streamed,
                       "groups_report_equal": _reports_equal(S.without_layout(small), S.without_layout(big))
                       and S.tensors_equal(small["checkpoint"], big["checkpoint"]),
                       "regress_equal": S.metrics_equal(reg["small"]["metrics"], reg["big"]["metrics"])
                       and reg["small"]["failed"] == reg["big"]["failed"],
                       "regress_failed": reg["small"]["failed"], "finetune_plans": plans, **ranges["record"]}}


def regress_ranges(work: Path, model: Path, adapter: Path, big: dict) -> dict:
    """regress of `model` + `adapter` over resident layer ranges (the stage's layout on
    REGRESS_NODES nodes of the budget spec), against `big` (the same loaded whole): peaks of
    the front and of each range, and whether metrics and verdict are equal."""
    import benchmarks.rehearse_stages as S

    lay = regress_layout(model, work)
    run = S.regress(model, adapter, False, ranges=lay.ranges)
    mem, one = run["peak"], [big["peak"]["peak_bytes"]]
    return {"peaks": {"regress (layer ranges), front": [mem["front"]["peak_bytes"]],
                      "regress (layer ranges), per range": [m["peak_bytes"] for m in mem["ranges"]]},
            "one_device_peaks": {"regress (layer ranges), front": one, "regress (layer ranges), per range": one},
            "record": {"regress_layout": lay.kind, "regress_ranges": lay.ranges,
                       "regress_range_bytes": lay.range_bytes,
                       "regress_ranges_equal": S.metrics_equal(run["metrics"], big["metrics"])
                       and run["failed"] == big["failed"]}}


def rehearse_regress(work: Path, layers: int = 40) -> dict:
    """Only regress's resident layer ranges against the model loaded whole (`--only-regress`)."""
    import ray

    import benchmarks.rehearse_stages as S
    from moeflow.core.hardware import load_hardware

    model = build(work, layers)
    temp = tempfile.mkdtemp(prefix="/tmp/mfreh")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        adapter = S.make_adapter(model, work / "adapter")
        big = S.regress(model, adapter, False)
        got = regress_ranges(work, model, adapter, big)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    return {"budget_bytes": load_hardware(str(BUDGET_SPEC)).memory_bytes, "layers": layers,
            "checkpoint_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")),
            "peaks": got["peaks"], "one_device_peaks": got["one_device_peaks"], **got["record"]}


def regress_checks(rec: dict) -> list[str]:
    """What failed of regress over layer ranges (empty: it holds)."""
    bad = []
    for stage in ("regress (layer ranges), front", "regress (layer ranges), per range"):
        values = rec["peaks"][stage]
        if not values or any(v is None or v > rec["budget_bytes"] for v in values):
            bad.append(f"{stage}: peaks {values} over the budget {rec['budget_bytes']}")
    if rec["regress_layout"] != "ranges" or len(rec["regress_ranges"]) < 2 or not rec["regress_ranges_equal"]:
        bad.append(f"regress did not choose layer ranges ({rec['regress_layout']}, {rec['regress_ranges']}), or "
                   f"their metrics / verdict differ from the loaded model's")
    return bad


REGRESS_NODES = 10  # regress's spec: 20 devices of the budget, room for its ranges and the front


def regress_layout(model: Path, work: Path):
    """The regress stage's own layout for `model` on REGRESS_NODES nodes of the budget spec
    (tasks.regress.resolve_layout: the planner's ranges, each within one device)."""
    from moeflow.core.config import validate
    from moeflow.evaluation.suite import load_suite
    from tasks.regress import resolve_layout

    cfg = validate({"model": {"path": str(model), "dtype": "float32"}, "workdir": str(work),
                    "hardware": {"spec": str(BUDGET_SPEC), "nodes": REGRESS_NODES},
                    "regress": {"shards": 1, "batch_size": 4}})
    return resolve_layout(cfg, load_suite(None), str(model))


def _reports_equal(a: dict, b: dict) -> bool:
    import math

    def close(x, y):
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return len(x) == len(y) and all(close(p, q) for p, q in zip(x, y))
        if isinstance(x, float) and isinstance(y, float):
            return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7)
        return x == y
    return close(_without_memory(a), _without_memory(b))


def open_items(rec: dict) -> list[str]:
    """What the rehearsal measures but does not hold yet (printed, not failed)."""
    out: list[str] = []  # every peak in rec["peaks"] is held by checks()
    if "skipped" in (rec.get("serving") or {"skipped": "not run"}):
        out.append(f"serving and deploy not rehearsed: {(rec.get('serving') or {}).get('skipped', 'not run')}")
    else:
        from benchmarks.rehearse_serving import open_items as serving_open

        out += [f"serving/deploy: {line}" for line in serving_open(rec["serving"])]
    return out


def checks(rec: dict) -> list[str]:
    """What failed (empty: the rehearsal holds)."""
    bad = []
    if rec["checkpoint_bytes"] < 4 * rec["budget_bytes"]:
        bad.append(f"checkpoint {rec['checkpoint_bytes']} B is not 4x the budget")
    if not rec["streamed"] or rec["layer_workers"] < 2:
        bad.append("the stages did not choose streaming / layer workers")
    for stage, values in rec["peaks"].items():
        if not values or any(v is None or v > rec["budget_bytes"] for v in values):
            bad.append(f"{stage}: peaks {values} over the budget {rec['budget_bytes']}")
    if not rec["counts_equal"]:
        bad.append("operators' streamed counts differ from the loaded model's")
    if not rec["report_equal"]:
        bad.append("calibrate's split report differs from one process's")
    if not rec["groups_report_equal"]:
        bad.append("calibrate's expert-group report or quantised tensors differ from one process's")
    if rec["wide_checkpoint_bytes"] < 4 * rec["budget_bytes"] or rec["expert_groups"] < 2:
        bad.append(f"the wide model ({rec['wide_checkpoint_bytes']} B) did not need expert groups "
                   f"({rec['expert_groups']})")
    if not rec["convert_equal"]:
        bad.append("convert within the budget wrote other tensors (or failed its verification) than on one device")
    if not rec["regress_streamed"] or not rec["regress_equal"]:
        bad.append("regress did not stream, or its streamed metrics / verdict differ from the loaded model's")
    bad += [line for line in regress_checks(rec) if "budget" not in line]  # the peaks: above
    if rec.get("serving") and "skipped" not in rec["serving"]:
        from benchmarks.rehearse_serving import checks as serving_checks

        bad += [f"serving/deploy: {line}" for line in serving_checks(rec["serving"])]
    return bad


FT_LAYERS = 40  # the finetune stage's model: the rehearsal's own, 4x the device
FT_NODES = 4  # 8 devices of the budget spec: the fewest on which its LoRA plan fits


def finetune_lines(ft: dict) -> list[str]:
    mb, ranks, one = 1e6, ft["ranks"], ft["one_device"]
    return [f"  finetune plan on {FT_NODES} nodes: {ft['plan']} ({ft['plan_memory_gb'] * 1e3:.0f} MB per device "
            f"planned); {ranks['workers']} ranks on a {FT_NODES}-node Ray cluster, {ranks['seconds']:.0f} s",
            f"  {'finetune, per rank':36s} peaks {', '.join(f'{v / mb:.1f}' for v in ranks['peaks'])} MB "
            f"(loaded: {', '.join(f'{v / mb:.1f}' for v in ranks['load_peaks'])} MB)"
            f"   (one device: {one['peaks'][0] / mb:.1f} MB, {one['seconds']:.0f} s)",
            f"  finetune losses {[round(x, 5) for x in ranks['losses']]}, one process "
            f"{[round(x, 5) for x in one['losses']]}: max rel diff {ft['max_loss_rel_diff']:.2e} "
            f"(tolerance {ft['tolerance']})"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--no-finetune", action="store_true", help="skip the finetune stage (8 ranks)")
    parser.add_argument("--only-regress", action="store_true",
                        help="only regress over resident layer ranges against the model loaded whole")
    args = parser.parse_args()
    if args.only_regress:
        return regress_main(args)
    import benchmarks.rehearse_stages as S

    with tempfile.TemporaryDirectory(prefix="moeflow-rehearse-") as tmp:
        rec = rehearse(Path(tmp), args.layers)
        if not args.no_finetune:
            model = Path(tmp) / "converted"
            if args.layers != FT_LAYERS:
                model = build(Path(tmp) / "ft-model", FT_LAYERS)
            rec["finetune"] = S.rehearse_finetune(Path(tmp), model, BUDGET_SPEC, FT_NODES)
    mb = 1e6
    print(f"budget {rec['budget_bytes'] / mb:.0f} MB per device; checkpoint {rec['checkpoint_bytes'] / mb:.0f} MB "
          f"({rec['checkpoint_bytes'] / rec['budget_bytes']:.1f}x), {rec['layers']} layers, "
          f"float32 {rec['model_fp32_bytes'] / mb:.0f} MB")
    for stage, values in rec["peaks"].items():
        one = rec["one_device_peaks"][stage]
        print(f"  {stage:36s} peaks {', '.join(f'{v / mb:.1f}' for v in values)} MB"
              f"   (one device: {', '.join(f'{v / mb:.1f}' for v in one)} MB)")
    print(f"  operators counts equal: {rec['counts_equal']}; calibrate report equal: {rec['report_equal']}; "
          f"expert groups {rec['expert_groups']}, report equal: {rec['groups_report_equal']}; "
          f"regress streamed equal: {rec['regress_equal']}; regress over {len(rec['regress_ranges'])} "
          f"layer ranges {rec['regress_ranges']} equal: {rec['regress_ranges_equal']}")
    for p in rec["finetune_plans"]:
        print(f"  finetune (lora) plan on {p['nodes']} node(s) of the budget spec: "
              + (f"{p['workers']} ranks, {p['memory_per_device_gb']} GB per device" if p["feasible"]
                 else f"none fits: {p['message']}"))
    if rec.get("serving") and "skipped" not in rec["serving"]:
        from benchmarks.rehearse_serving import report

        print("\n".join(report(rec["serving"])))
    if "finetune" in rec:
        print("\n".join(finetune_lines(rec["finetune"])))
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1))
    for line in open_items(rec):
        print("OPEN:", line)
    bad = checks(rec) + (S.finetune_checks(rec["finetune"]) if "finetune" in rec else [])
    for line in bad:
        print("FAIL:", line)
    return 1 if bad else 0


def regress_main(args) -> int:
    mb = 1e6
    with tempfile.TemporaryDirectory(prefix="moeflow-rehearse-") as tmp:
        rec = rehearse_regress(Path(tmp), args.layers)
    print(f"budget {rec['budget_bytes'] / mb:.0f} MB per device; checkpoint {rec['checkpoint_bytes'] / mb:.0f} MB "
          f"({rec['checkpoint_bytes'] / rec['budget_bytes']:.1f}x), {rec['layers']} layers; regress over "
          f"{len(rec['regress_ranges'])} layer ranges {rec['regress_ranges']} (planned "
          f"{max(rec['regress_range_bytes']) / mb:.1f} MB for the fullest)")
    for stage, values in rec["peaks"].items():
        print(f"  {stage:36s} peaks {', '.join(f'{v / mb:.1f}' for v in values)} MB"
              f"   (one device: {', '.join(f'{v / mb:.1f}' for v in rec['one_device_peaks'][stage])} MB)")
    print(f"  metrics and verdict equal to the model loaded whole: {rec['regress_ranges_equal']}")
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1))
    bad = regress_checks(rec)
    for line in bad:
        print("FAIL:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
