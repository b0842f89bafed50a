"""A merged kept release under vLLM's own loader (`vllm.LLM` in the vLLM environment, run
by tests/vllm_merged_load.py in a subprocess; skipped naming `make setup-vllm` without it):
a tiny Qwen3-MoE (head_dim 32, a size vLLM's CPU attention serves) as INT4 and FP8-block
compressed-tensors releases, an expert adapter merged and requantised. Where vLLM loads
the format its greedy tokens are compared with the local engine's over the same merged
checkpoint; where it refuses (this host: no AMX, so INT4 and FP8 MoE kernels do not run),
`merge_vllm.vllm_cpu_refusal` said so beforehand, and finetune's preflight refuses
deploy.merge on vLLM (CPU) in that one line."""

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
    from moeflow.model.packed_base import load_packed

    model, _ = load_packed(model_dir, torch.float32)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out.append(model.generate(ids, max_new_tokens=6, do_sample=False)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("name", ["int4-group", "fp8-block"])
def test_vllm_loads_the_merged_release_or_its_refusal_is_named(tmp_path, name):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.core.config import load_config
    from moeflow.core.errors import UserError
    from moeflow.training.merge_kept import merge_kept
    from moeflow.training.merge_vllm import vllm_cpu_refusal
    from moeflow_testing.releases import ct_release
    from moeflow_testing.tiny import build_debug_model
    from tests.test_merge_kept import REPO
    from workflows.dag import registry

    qwen = build_debug_model("qwen3_moe", tmp_path / "qwen", dtype="float32", head_dim=32)
    kept = tmp_path / "kept"
    convert_checkpoint(ct_release(qwen, tmp_path / "rel", name, experts_only=True), kept, dtype="keep", workers=1)
    adapter = _adapter(qwen, tmp_path / "a", target_modules=["q_proj"],
                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    merged = Path(merge_kept(kept, adapter, tmp_path / "merged")["output_dir"])
    refusal = vllm_cpu_refusal(merged, vllm_run.vllm_python())
    # the release's format, kept: the same answer for the release
    assert (refusal or "").replace(str(merged), "") == \
        (vllm_cpu_refusal(kept, vllm_run.vllm_python()) or "").replace(str(kept), "")
    got = _vllm(merged)
    if refusal:
        assert "error" in got, got  # vLLM refuses as said (its own words are in its log)
        data = tmp_path / "train.jsonl"
        data.write_text('{"prompt": "a", "completion": "b"}\n')
        cfg = load_config(REPO / "configs/demo.yaml", [
            f"model.path={kept}", "convert.dtype=keep", "deploy.merge=true", "deploy.backend=vllm",
            f"data.train_file={data}", f"data.eval_file={data}", "finetune.adapters={}"])
        with pytest.raises(UserError, match=r"^deploy.merge: .*routed experts stored") as e:
            registry()["finetune"].preflight(cfg)
        assert "\n" not in str(e.value)
        _deploy_refused(merged, refusal, tmp_path)
    else:
        assert got.get("tokens") == _local(merged), got


def _deploy_refused(merged: Path, refusal: str, tmp_path: Path) -> None:
    """`deploy.backend: vllm` on CPU of the merged release: the same one line from the deploy
    path (vllm_backend.start), raised before the Serve config reaches Ray."""
    from moeflow.core.config import validate
    from moeflow.core.errors import UserError
    from moeflow.parallel.vllm_plan import single_device_plan
    from moeflow.serving import vllm_backend as V

    cfg = validate({"model": {"path": str(merged)}, "deploy": {"backend": "vllm"}})
    built = V.build(cfg, str(merged), {"vllm": single_device_plan()}, {}, tmp_path / "deploy", device="cpu")
    reached = []
    real = vllm_run.deploy_config
    vllm_run.deploy_config = lambda *a, **k: reached.append(a)  # any call here is a failure below
    try:
        with pytest.raises(UserError) as e:
            V.start(built["serve_config"], "cpu", "127.0.0.1", 0)
    finally:
        vllm_run.deploy_config = real
    assert str(e.value) == refusal and "\n" not in refusal and not reached
