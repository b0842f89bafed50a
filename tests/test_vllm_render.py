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
