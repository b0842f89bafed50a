"""Pipeline parallelism on vLLM's CPU build, as the vllm backend deploys it: eager (as every
CPU engine moeflow starts), two pipeline stages, moeflow's worker extension named
(moeflow.serving.vllm_worker). Without the extension vLLM's CPU runner never makes the second
stage's receive buffer and the engine stops at its first step; with it the greedy tokens equal
transformers' over the same checkpoint. Needs the vLLM environment (skips naming
`make setup-vllm`); slow (two engines of two vLLM workers each on 2 cores: about 1.5 minutes)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moeflow.serving import vllm_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))]
SCRIPT = Path(__file__).with_name("vllm_merged_load.py")
PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 7, 300, 12]]
NEW = 6


def _vllm(model_dir: Path, engine: dict) -> tuple[dict, str]:
    """The script's JSON line (tokens, or the error vLLM raised last) and its whole output (vLLM's
    workers log to stdout, the engine to stderr)."""
    root = str(Path(__file__).resolve().parents[1])  # the extension imports moeflow from here
    # as vllm_run.app_runtime_env gives a deployment naming the extension
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TORCH_COMPILE_DISABLE": "1", "PYTHONPATH": root}
    if bind := vllm_run.cpu_binding(2):  # two local workers on one NUMA node (vllm_run)
        env[vllm_run.BIND_ENV] = bind
    proc = subprocess.run([str(vllm_run.vllm_python()), str(SCRIPT), str(model_dir), str(NEW), json.dumps(PROMPTS),
                           json.dumps(engine)], capture_output=True, text=True, timeout=900, env=env, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    got = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return got, proc.stdout + proc.stderr


def test_an_eager_cpu_pipeline_serves_with_moeflows_extension(tmp_path):
    from transformers import AutoModelForCausalLM

    from moeflow.serving.vllm_worker import EXTENSION
    from moeflow_testing.tiny import build_debug_model

    model_dir = build_debug_model("qwen3_moe", tmp_path / "qwen", dtype="float32", head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: the argmax, EOS or not
    want = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]
    engine = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "kv_cache_memory_bytes": 8 << 20}
    got, _ = _vllm(model_dir, {**engine, "worker_extension_cls": EXTENSION})
    assert got.get("tokens") == want, got
    # without it the engine dies at its first step, on the missing buffer (not on anything else):
    # when a vLLM release makes the buffer itself, this fails and the extension can go
    bare, log = _vllm(model_dir, engine)
    assert "error" in bare and "assert self.intermediate_tensors is not None" in log, bare
