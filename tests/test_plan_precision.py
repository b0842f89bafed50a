"""The planner follows the checkpoint's stored precision (its quantization_config)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reference_mxfp4_release_plans_at_a_quarter_of_bf16():
    from moeflow.core.hardware import load_hardware
    from moeflow.model.params import spec_from_path
    from moeflow.parallel.memory import Workload, memory_for_plan
    from moeflow.parallel.planner import search, weights_alone

    hw = load_hardware("supernode-384")
    release = spec_from_path(ROOT / "configs/models/reference-2.8t-mxfp4.json")
    bf16 = spec_from_path(ROOT / "configs/models/reference-2.8t.json")
    assert release.precision == {"experts": "mxfp4"} and bf16.precision == {}
    w, ref = weights_alone(release, hw), weights_alone(bf16, hw)
    assert w["of_bf16"] <= 0.35 and ref["of_bf16"] == 1.0
    assert w["dtype"] == "experts mxfp4, rest bf16" and w["devices"] < ref["devices"]
    # per-device memory follows too: the same plan holds a quarter of the expert bytes
    work = Workload(mode="lora", seq_len=4096)
    best = search(release, hw, work, "generic").best
    a = memory_for_plan(release, best.plan, work, hw.memory_bytes, 0.0).parts["weights_experts"]
    b = memory_for_plan(bf16, best.plan, work, hw.memory_bytes, 0.0).parts["weights_experts"]
    assert abs(a / b - 4.25 / 16) < 1e-3


def test_plan_cli_prints_the_precision():
    out = subprocess.run([sys.executable, "-m", "workflows.cli", "plan",
                          "configs/models/reference-2.8t-mxfp4.json", "--hardware", "supernode-384"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "in experts mxfp4, rest bf16 (0.27x of bf16)" in " ".join(out.stdout.split())


def test_compressed_tensors_groups_set_the_kinds(tmp_path):
    from moeflow.model.params import model_spec

    cfg = json.loads((ROOT / "configs/models/qwen3-30b-a3b.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"g": {"targets": ["re:.*mlp.experts.*"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}}}}
    spec = model_spec(cfg)
    assert spec.precision == {"experts": "int4"}
    cfg["quantization_config"]["config_groups"]["g"]["targets"] = ["Linear"]
    assert model_spec(cfg).precision == {"attention": "int4", "experts": "int4"}
