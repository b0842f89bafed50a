"""The rehearsal's later stages (benchmarks/rehearse_streamed.py runs them): convert,
calibrate with expert groups on a model whose single layer exceeds a device, and regress
layer-streamed -- each in its own Ray worker process, its model-attributable peak measured
by moeflow.core.memmeter (VmHWM reset just before the first tensor is read, minus the resident
set then), against the same work on one device (cpu-local) for the results.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

# a layer of 32 experts x 3 x 512 x 768 in float32 is 151 MB: over the 150 MB device,
# so calibrate must split each layer's experts; 8 such layers are over 600 MB in bf16
WIDE = dict(hidden_size=512, moe_intermediate_size=768, num_experts=32, num_experts_per_tok=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1024)
WIDE_LAYERS = 8


def _measured(fn, *args, **kwargs):
    """Run fn in this process with the peak meter started first: (result, peak record)."""
    from moeflow.core.memmeter import PeakMemory

    meter = PeakMemory().start()
    out = fn(*args, **kwargs)
    return out, meter.record()


def convert_in_worker(src: str, dst: str, budget: float | None) -> dict:
    """moeflow's convert of `src` into `dst` (a Ray task's body; its file tasks and their
    verification run as Ray tasks of their own), with a device's `budget` or none (one
    device): the peaks convert measured in each process ("convert" per output file,
    "verify" per file, "functional"), the functional check's mode, and every tensor's
    manifest entry."""
    import json

    from moeflow.checkpoint.convert import convert_checkpoint

    rec = convert_checkpoint(src, dst, dtype="keep", memory_budget=budget)
    functional = rec["report"]["functional"]
    return {"memory": rec["memory"], "functional": functional.get("skipped") or "whole-model logits",
            "per_layer": {k: v for k, v in (functional.get("per_layer") or {}).items() if k != "per_layer"},
            "passed": rec["report"]["passed"], "bytes": rec["bytes"],
            "tensors": json.loads(Path(rec["manifest"]).read_text())["tensors"]}


def build_wide(work: Path, budget: float) -> tuple[Path, dict, dict]:
    """A random checkpoint of WIDE layers, converted on a Ray worker within `budget`, and
    again as on one device (no budget): (converted dir, the budget run, the one-device run)."""
    import ray

    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model("qwen3_moe", work / "wide-src", num_hidden_layers=WIDE_LAYERS,
                            max_shard_size="50MB", **WIDE)
    task = ray.remote(num_cpus=1)(convert_in_worker)
    small = ray.get(task.remote(str(src), str(work / "wide"), budget))
    big = ray.get(task.remote(str(src), str(work / "wide-one-device"), None))
    return work / "wide", small, big


def convert_peaks(rec: dict) -> dict[str, list]:
    """Per convert process: its model-attributable peak, bytes."""
    mem = rec["memory"]
    return {"convert (wide model), per file": mem["convert"], "convert verify, per file": mem["verify"],
            "convert functional check": [mem.get("functional")]}


def calibrate_groups(model: Path, hardware: str, out: Path, config) -> dict:
    """calibrate with layer workers and expert groups as the spec resolves them (auto)."""
    from tasks.calibrate import calibrate, expert_groups, layer_workers

    out.mkdir(parents=True)
    cfg = config(model, hardware, out)
    workers, groups = layer_workers(cfg, str(model)), expert_groups(cfg, str(model))
    report = calibrate(str(model), out, cfg.calibrate, log=lambda *_: None, layer_workers=workers,
                       expert_groups=groups)
    return dict(report, layer_workers=workers, expert_groups=groups)


def group_peaks(cal: dict) -> dict[str, list]:
    compare = cal["memory"]["compare"]
    return {"calibrate quantise (expert groups)": [m["peak_bytes"] for m in cal["memory"]["quantize"]],
            "calibrate compare front (groups)": [c["front"]["peak_bytes"] for c in compare],
            "calibrate compare ranges + group 1": [m["peak_bytes"] for c in compare for m in c["layers"]],
            "calibrate compare other groups": [g["peak_bytes"] for c in compare for m in c["layers"]
                                               for g in m.get("groups", [])]}


# what a grouped quantiser's record says about its files: one file per expert group by design,
# so their count and header bytes differ from one process's (the tensors are compared instead)
QUANTIZE_LAYOUT = ("files", "bytes")


def without_layout(report: dict) -> dict:
    """calibrate's report less the quantiser's file layout (QUANTIZE_LAYOUT)."""
    return dict(report, quantize={k: v for k, v in report["quantize"].items() if k not in QUANTIZE_LAYOUT})


def tensors_equal(a: str | Path, b: str | Path) -> bool:
    """Two checkpoints hold the same tensor names with byte-equal values, however they are
    split into files (one tensor of each in memory at a time)."""
    import json

    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        return {k: folder / f for k, f in index.items()}

    left, right = where(Path(a)), where(Path(b))
    if left.keys() != right.keys():
        return False
    for key in sorted(left):
        with safe_open(str(left[key]), "pt") as f, safe_open(str(right[key]), "pt") as g:
            x, y = f.get_tensor(key), g.get_tensor(key)
        if x.dtype != y.dtype or x.shape != y.shape or x.contiguous().view(-1).view(torch_uint8()).ne(
                y.contiguous().view(-1).view(torch_uint8())).any():
            return False
    return True


def torch_uint8():
    import torch

    return torch.uint8


def make_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter (attention q/v, random factors) for `model_dir`, made on the
    meta model: no tensor of the model is read."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    from moeflow.quant.source import ModelSource

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        base_model_name_or_path=str(model_dir))
    shapes = get_peft_model_state_dict(get_peft_model(copy.deepcopy(ModelSource(model_dir).fam.meta), config))
    gen = torch.Generator().manual_seed(0)
    out.mkdir(parents=True)
    save_file({k: (0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in shapes.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    return out


def _suite(per_task: int):
    from moeflow.evaluation.suite import load_suite

    suite = load_suite(None)
    for task in suite.tasks:
        task.records = task.records[:per_task]
    return suite


def regress_in_worker(model: str, adapter: str, streamed: bool, per_task: int,
                      ranges: list | None = None) -> tuple[list, dict]:
    """The golden suite's raw outputs of base and adapter (as moeflow.evaluation.runners.
    eval_shard gives them) through the streamed or the in-memory runner, or over resident
    layer `ranges` (Ray actors); its peak (with ranges: {"front", "ranges"} peaks)."""
    import torch

    from moeflow.core.memmeter import PeakMemory
    from moeflow.evaluation.runnable import runnable_tasks
    from moeflow.evaluation.runners import HFRunner, task_outputs
    from moeflow.evaluation.streamed_runner import StreamedRunner

    torch.set_num_threads(1)
    suite = _suite(per_task)
    tasks, _ = runnable_tasks(suite, False, "text only")
    if ranges:
        from moeflow.evaluation.ranges_runner import RangesRunner

        runner = RangesRunner(model, batch_size=4, ranges=ranges)
        meter = runner
    elif streamed:
        runner = StreamedRunner(model, batch_size=4)  # starts its meter before the first tensor
        meter = runner.meter
    else:
        meter = PeakMemory().start()
        runner = HFRunner(model, batch_size=4)
    out = []
    for name in (None, adapter):
        if name is not None:
            runner.attach_adapter(name)
        with runner.base_only() if name is None else _null():
            out.append({t.name: task_outputs(runner, t, t.records) for t in tasks})
    if ranges:
        mem = runner.memory()
        runner.close()
        return out, mem
    return out, meter.record()


def _null():
    from contextlib import nullcontext

    return nullcontext()


def regress(model: Path, adapter: Path, streamed: bool, per_task: int = 3, ranges: list | None = None) -> dict:
    """Base and adapter on a Ray worker (and its range actors, with `ranges`); their scored
    results, the gate verdict, the peak."""
    import ray

    from moeflow.evaluation.baseline import Agreement
    from moeflow.evaluation.gate import against_base
    from moeflow.evaluation.record import assemble, flat_metrics
    from moeflow.evaluation.runnable import runnable_tasks

    raw, mem = ray.get(ray.remote(num_cpus=1)(regress_in_worker).remote(str(model), str(adapter), streamed,
                                                                           per_task, ranges))
    suite = _suite(per_task)
    _, skipped = runnable_tasks(suite, False, "text only")
    base, adapted = (assemble(suite, r, skipped, model=str(model), adapter=a, settings={})
                     for r, a in zip(raw, (None, str(adapter))))
    sections = against_base(base, {"adapter": adapted}, {"adapter": []}, Agreement("gate", 0.05, 0.85, 0.05))
    return {"metrics": {**flat_metrics(base, "base/"), **flat_metrics(adapted)},
            "failed": [s.failed for s in sections], "peak": mem}


def metrics_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-5) for k in a)


def plan_probe(model: Path, spec: Path, nodes: int) -> dict:
    """`moeflow plan MODEL --mode lora` on `spec` with `nodes` nodes (a separate process, as a
    user runs it): whether a LoRA plan fits the devices, and its memory per device."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "workflows.cli", "plan", str(model), "--hardware", str(spec),
           "--nodes", str(nodes), "--mode", "lora", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        rec = json.loads(proc.stdout)
    except ValueError:
        return {"nodes": nodes, "feasible": False, "message": (proc.stderr or proc.stdout).strip()[-300:]}
    if rec.get("feasible") is False:
        return {"nodes": nodes, "feasible": False, "message": str(rec.get("message", "")).splitlines()[0]}
    return {"nodes": nodes, "feasible": True, "workers": rec.get("num_workers"),
            "memory_per_device_gb": rec.get("memory", {}).get("total_gb"),
            "degrees": {k: rec.get(k) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel",
                                                "data_parallel", "fsdp", "context_parallel")}}


def plan_record(model: Path, spec: Path, nodes: int) -> dict:
    """The plan stage's LoRA plan of `model` on `nodes` nodes of `spec` (`moeflow plan --json`,
    a separate process, as a user runs it): what finetune is handed."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "workflows.cli", "plan", str(model), "--hardware", str(spec),
           "--nodes", str(nodes), "--mode", "lora", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, check=True,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    return json.loads(proc.stdout)


ONE_DEVICE = {"num_workers": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1,
              "data_parallel": 1, "fsdp": 1, "context_parallel": 1, "mode": "lora"}


def finetune(model: Path, plan: dict, work: Path, steps: int = 3, seq_len: int = 64) -> dict:
    """The finetune stage (tasks.finetune.run: Ray Train, gloo) on `plan`'s ranks, `steps`
    optimizer steps of attention LoRA in bf16: {"losses": per step, "peaks": per rank
    (moeflow.core.memmeter from just before the base's first tensor), "seconds"}.

    The one-device run it is compared with takes micro-batches of `replicas` rows, so each
    of its steps trains on the rows the plan's data-parallel replicas share out."""
    import time

    from mlflow.tracking import MlflowClient

    from moeflow.core.config import validate
    from moeflow_testing.demo_data import make_dataset
    from tasks.base import StageContext
    from tasks.finetune import run

    replicas = max(1, int(plan["data_parallel"]) // int(plan.get("context_parallel") or 1))
    data = work / "data"
    train = data / "train.jsonl" if (data / "train.jsonl").is_file() else make_dataset(data, n_train=96, n_eval=1)[0]
    name = f"ft-{plan['num_workers']}"
    out = work / name
    out.mkdir(parents=True)
    uri = f"sqlite:///{out}/mlflow.db"
    cfg = validate({
        "name": name, "model": {"path": str(model), "dtype": "bfloat16"},
        "data": {"train_file": str(train), "seq_len": seq_len, "eval_fraction": 0.0},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["attention"]},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "finetune": {"max_steps": steps, "micro_batch_size": 1 if plan["num_workers"] > 1 else replicas,
                     "checkpoint_every": steps, "register_model": False, "merge": False},
        "tracking": {"uri": uri}})
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment(name, artifact_location=str(out / "artifacts"))).info.run_id
    ctx = StageContext(stage="finetune", config=cfg, out_dir=out / "stage", mlflow_run_id=run_id, tracking_uri=uri,
                       inputs={"convert": {"output_dir": str(model)}, "plan": {"plan": dict(plan)}})
    ctx.out_dir.mkdir(parents=True)
    start = time.perf_counter()
    rec = run(ctx)
    seconds = time.perf_counter() - start
    losses = [p.value for p in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda p: p.step)]
    m = rec["metrics"]
    return {"losses": losses, "seconds": seconds, "workers": rec["num_workers"],
            "peaks": [int(m[f"plan/rank{r}/peak_bytes"]) for r in range(rec["num_workers"])],
            "load_peaks": [int(m[f"plan/rank{r}/load_peak_bytes"]) for r in range(rec["num_workers"])],
            "planned_bytes": [int(m[f"plan/rank{r}/planned_bytes"]) for r in range(rec["num_workers"])]}


def losses_close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) > 0 and all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b))


def node_cluster(nodes: int, cpus: int, temp: str):
    """A Ray cluster of `nodes` nodes of `cpus` CPUs on this host (ray.cluster_utils: one
    raylet per node), the driver connected: how the project rehearses several nodes."""
    import os

    import ray
    from ray.cluster_utils import Cluster

    root = Path(__file__).resolve().parents[1]
    # the cluster records its address under Ray's temp dir (RAY_TMPDIR): this run's own
    (Path(temp) / "ray").mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = temp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False,
                                                            "temp_dir": temp})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    return cluster


# relative: step 1 (the base, before any update: the same rows, bf16 sums in another order over
# the ranks), then every step (Adam turns those differences into slightly different updates)
FT_FIRST_TOLERANCE, FT_TOLERANCE = 1e-2, 5e-2


def rehearse_finetune(work: Path, model: Path, spec: Path, nodes: int, steps: int = 3) -> dict:
    """Finetune of `model` on the plan for `nodes` nodes of `spec` (its ranks on a Ray cluster
    of that many nodes on this host), against the same steps in one process."""
    import os
    import shutil
    import tempfile

    import ray

    from moeflow.core.hardware import load_hardware

    hw = load_hardware(str(spec), nodes)
    plan = plan_record(model, spec, nodes)
    temp = tempfile.mkdtemp(prefix="/tmp/mfft")  # Ray's own, short (socket paths)
    cluster = node_cluster(nodes, hw.devices_per_node, temp)
    try:
        small = finetune(model, plan, work, steps)
        big = finetune(model, ONE_DEVICE, work, steps)
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(temp, ignore_errors=True)
    return {"budget_bytes": hw.memory_bytes, "plan": {k: plan.get(k) for k in (
                "num_workers", "tensor_parallel", "expert_parallel", "data_parallel", "fsdp",
                "context_parallel", "recompute")}, "plan_memory_gb": plan["memory"]["total_gb"],
            "ranks": small, "one_device": big, "tolerance": [FT_FIRST_TOLERANCE, FT_TOLERANCE],
            "losses_equal": losses_close(small["losses"][:1], big["losses"][:1], FT_FIRST_TOLERANCE)
            and losses_close(small["losses"], big["losses"], FT_TOLERANCE),
            "max_loss_rel_diff": max((abs(a - b) / abs(b) for a, b in zip(small["losses"], big["losses"])),
                                     default=float("nan"))}


def finetune_checks(rec: dict) -> list[str]:
    """What failed in `rehearse_finetune`'s record (empty: it holds)."""
    bad = []
    ranks = rec["ranks"]
    if ranks["workers"] != rec["plan"]["num_workers"] or ranks["workers"] < 2:
        bad.append(f"finetune ran {ranks['workers']} ranks, the plan has {rec['plan']['num_workers']}")
    if any(p < 0 for p in ranks["peaks"]):
        bad.append(f"finetune rank peaks {ranks['peaks']}: not measured")
    elif any(p > rec["budget_bytes"] for p in ranks["peaks"]):
        bad.append(f"finetune rank peaks {ranks['peaks']} (when the base had loaded: {ranks.get('load_peaks')}) "
                   f"over the budget {rec['budget_bytes']:.0f} (planned {rec['plan_memory_gb'] * 1e9:.0f})")
    if not rec["losses_equal"]:
        bad.append(f"finetune losses {ranks['losses']} differ from one process's {rec['one_device']['losses']} "
                   f"beyond rel {rec['tolerance']} (first step, every step)")
    return bad
