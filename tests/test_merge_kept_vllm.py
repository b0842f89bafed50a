"""A merged kept release under vLLM's own loader (`vllm.LLM` in the vLLM environment, run
by tests/vllm_merged_load.py in a subprocess; skipped naming `make setup-vllm` without it):
a tiny Qwen3-MoE (head_dim 32, a size vLLM's CPU attention serves) as INT4 and FP8-block
compressed-tensors releases, an expert adapter merged and requantised. Where vLLM loads
the format its greedy tokens are compared with the local engine's over the same merged
checkpoint; where it refuses, its message is what `refuse_vllm` names."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moeflow.serving import vllm_run
from tests.test_merge_kept import _adapter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))]
SCRIPT = Path(__file__).with_name("vllm_merged_load.py")
PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 7, 300, 12]]


def _vllm(model_dir: Path) -> dict:
    proc = subprocess.run([str(vllm_run.vllm_python()), str(SCRIPT), str(model_dir), "6", json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}


def _local(model_dir: Path) -> list[list[int]]:
    from moeflow.packed_base import load_packed

    model, _ = load_packed(model_dir, torch.float32)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out.append(model.generate(ids, max_new_tokens=6, do_sample=False)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("name", ["int4-group", "fp8-block"])
def test_vllm_loads_the_merged_release_or_its_refusal_is_named(tmp_path, name):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.checkpoint.releases import ct_release
    from moeflow.tiny import build_debug_model
    from moeflow.training.merge_kept import VLLM_CPU_REFUSES, merge_kept

    qwen = build_debug_model("qwen3_moe", tmp_path / "qwen", dtype="float32", head_dim=32)
    kept = tmp_path / "kept"
    convert_checkpoint(ct_release(qwen, tmp_path / "rel", name, experts_only=True), kept, dtype="keep", workers=1)
    adapter = _adapter(qwen, tmp_path / "a", target_modules=["q_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    merged = Path(merge_kept(kept, adapter, tmp_path / "merged")["output_dir"])
    got = _vllm(merged)
    fmt = {"int4-group": "pack-quantized", "fp8-block": "float-quantized"}[name]
    if fmt in VLLM_CPU_REFUSES:
        assert "error" in got and VLLM_CPU_REFUSES[fmt] in got["error"], got
    else:
        assert got.get("tokens") == _local(merged), got
