"""What the serving search renders for vLLM is what vLLM 0.29 itself accepts: the
`vllm serve` command line through vLLM's own argument parser and engine config, the Ray
Serve LLM engine_kwargs through its EngineArgs -- in the vLLM environment (skipped naming
`make setup-vllm` without it). vLLM 0.29 has no max_num_partial_prefills /
max_long_partial_prefills (its V1 scheduler): they are the local engine's, never rendered."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from moeflow.serving import render, vllm_run
from moeflow.serving.tune_space import ENGINE_KNOBS

pytestmark = pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))

# runs in the vLLM venv: vLLM's `vllm serve` parser, its checks and its engine config
PARSE = """
import json, shlex, sys
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

cmd, kwargs, model = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
argv = shlex.split(cmd)
assert argv[:2] == ["vllm", "serve"], argv
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[2], *argv[3:]])
validate_parsed_serve_args(args)
AsyncEngineArgs.from_cli_args(args).create_engine_config()
EngineArgs(model=model, **kwargs).create_engine_config()
print("accepted")
"""


def _vllm_accepts(cmd: str, kwargs: dict, model: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    return subprocess.run([str(vllm_run.vllm_python()), "-c", PARSE, cmd, json.dumps(kwargs), str(model)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow  # two vLLM imports and engine configs: about a minute on a loaded host
def test_vllm_accepts_the_rendered_settings(tmp_path):
    from moeflow_testing.tiny import build_debug_model

    base = build_debug_model("qwen3_moe", tmp_path / "base", head_dim=32, dtype="float32")
    knobs = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "enable_chunked_prefill": True,
             "long_prefill_token_threshold": None, "max_num_partial_prefills": 4,
             "max_long_partial_prefills": 2, "num_replicas": 1, "max_ongoing_requests": 16}
    plan = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1}
    common = {"served_name": "m", "max_model_len": 256, "lora_rank": None, "max_loras": 1, "plan": plan}
    cmd = render.vllm_args(knobs, model=str(base), adapters={}, **common)
    kwargs = render.ray_llm_config(knobs, model=str(base), **common)["engine_kwargs"]
    assert "partial-prefills" not in cmd and not {"max_num_partial_prefills", "max_long_partial_prefills"} & set(kwargs)
    assert kwargs["long_prefill_token_threshold"] == 256  # half the step budget, capped at max_model_len
    proc = _vllm_accepts(cmd, kwargs, base)
    assert proc.returncode == 0 and "accepted" in proc.stdout, proc.stderr[-2000:]
    # the check can fail: the knobs vLLM 0.29 lacks are refused by its parser and its EngineArgs
    refused = _vllm_accepts(cmd + " --max-num-partial-prefills 4", kwargs, base)
    assert refused.returncode != 0 and "max-num-partial-prefills" in refused.stderr
    refused = _vllm_accepts(cmd, {**kwargs, "max_num_partial_prefills": 4}, base)
    assert refused.returncode != 0 and "max_num_partial_prefills" in refused.stderr
    assert set(render.VLLM_ENGINE_KNOBS) < set(ENGINE_KNOBS)


# runs in the vLLM venv: the adapter tiers as vLLM's EngineArgs take them, and Ray Serve LLM's
# config models (the ones in the vLLM venv, where replicas run) offer no pinning
TIERS = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig, LoraConfig

kwargs, model = json.loads(sys.argv[1]), sys.argv[2]
lora = EngineArgs(model=model, **kwargs).create_engine_config().lora_config
print("tiers", lora.max_loras, lora.max_cpu_loras)
try:
    EngineArgs(model=model, **{**kwargs, "max_cpu_loras": kwargs["max_loras"] - 1}).create_engine_config()
except Exception as exc:
    print("refused", type(exc).__name__)
print("pin fields", sorted(f for m in (LLMConfig, LoraConfig) for f in m.model_fields if "pin" in f))
"""


@pytest.mark.slow  # one vLLM import and engine config: about a minute on a loaded host
def test_vllm_takes_the_adapter_tiers_and_ray_serve_llm_cannot_pin(tmp_path):
    """deploy.max_cpu_loras reaches vLLM's own LoRAConfig under that name (and vLLM, like
    moeflow's check, refuses one below max_loras); Ray Serve LLM's LLMConfig / LoraConfig
    have no pinning field, which is why the vllm backend refuses deploy.pinned_adapters
    for adapters served as LoRA (this fails if Ray adds one: then map it instead)."""
    from moeflow.core.config import validate
    from moeflow.serving import vllm_backend as V
    from moeflow_testing.tiny import build_debug_model

    base = build_debug_model("qwen3_moe", tmp_path / "base", head_dim=32, dtype="float32")
    plan = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "enable_expert_parallel": False,
            "data_parallel_size": 1}
    knobs = {**V.engine_settings(validate({"model": {"path": str(base)}})), "max_loras": 2}
    kwargs = V.engine_kwargs(plan, knobs, "float32", None, [8], 0.9, 6)
    kwargs.pop("gpu_memory_utilization")  # the GPU's; vLLM's CPU build takes its KV cache size from env
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(vllm_run.vllm_python()), "-c", TIERS, json.dumps(kwargs), str(base)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tiers 2 6" in proc.stdout and "refused" in proc.stdout, proc.stdout
    assert "pin fields []" in proc.stdout, proc.stdout
