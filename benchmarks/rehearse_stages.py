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


def convert_in_worker(src: str, dst: str) -> dict:
    """moeflow's convert of `src` into `dst`, here; its peak (a Ray task's body)."""
    from moeflow.checkpoint.convert import convert_checkpoint

    _, mem = _measured(convert_checkpoint, src, dst, dtype="keep")
    return mem


def build_wide(work: Path) -> tuple[Path, dict]:
    """A random checkpoint of WIDE layers, converted on a Ray worker: (converted dir, convert's peak)."""
    import ray

    from moeflow_testing.tiny import build_debug_model

    src = build_debug_model("qwen3_moe", work / "wide-src", num_hidden_layers=WIDE_LAYERS,
                            max_shard_size="50MB", **WIDE)
    mem = ray.get(ray.remote(num_cpus=1)(convert_in_worker).remote(str(src), str(work / "wide")))
    return work / "wide", mem


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


def regress_in_worker(model: str, adapter: str, streamed: bool, per_task: int) -> tuple[list, dict]:
    """The golden suite's raw outputs of base and adapter (as moeflow.evaluation.runners.
    eval_shard gives them) through the streamed or the in-memory runner; its peak."""
    import torch

    from moeflow.core.memmeter import PeakMemory
    from moeflow.evaluation.runnable import runnable_tasks
    from moeflow.evaluation.runners import HFRunner, task_outputs
    from moeflow.evaluation.streamed_runner import StreamedRunner

    torch.set_num_threads(1)
    suite = _suite(per_task)
    tasks, _ = runnable_tasks(suite, False, "text only")
    if streamed:
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
    return out, meter.record()


def _null():
    from contextlib import nullcontext

    return nullcontext()


def regress(model: Path, adapter: Path, streamed: bool, per_task: int = 3) -> dict:
    """Base and adapter on a Ray worker; their scored results, the gate verdict, the peak."""
    import ray

    from moeflow.evaluation.baseline import Agreement
    from moeflow.evaluation.gate import against_base
    from moeflow.evaluation.record import assemble, flat_metrics
    from moeflow.evaluation.runnable import runnable_tasks

    raw, mem = ray.get(ray.remote(num_cpus=1)(regress_in_worker).remote(str(model), str(adapter), streamed,
                                                                           per_task))
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
