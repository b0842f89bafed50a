"""Backends the OpenAI contract suite runs against: `local` (moeflow's engine on Ray Serve)
always; `vllm` (Ray Serve LLM) where vLLM and a GPU are present — benchmarks/gpu_check.sh
runs it there. Each yields an `Endpoint`: an openai client, the base model id, and the ids
of the adapters it serves (the vllm backend serves adapters only from cloud storage:
MOEFLOW_CONTRACT_LORA_URI=<prefix holding contract-a1/>, else its adapter checks skip)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

KEY = "contract-key"
ADAPTER = "contract-a1"


@dataclass
class Endpoint:
    backend: str
    client: openai.OpenAI
    base: str
    adapters: list[str] = field(default_factory=list)


def vllm_missing() -> str | None:
    """Why the vllm backend cannot run here (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'moeflow[vllm]'; benchmarks/gpu_check.sh runs it)"
    import torch

    if not torch.cuda.is_available():
        return "vllm needs a GPU"
    return None


@pytest.fixture(scope="module")
def contract_model(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint and one attention LoRA adapter for it."""
    from moeflow.serving.fixtures import make_lora_adapter
    from moeflow.tiny import build_debug_model

    root = tmp_path_factory.mktemp("contract")
    base = build_debug_model("qwen3_moe", root / "contract-moe")
    adapter = make_lora_adapter(base, root / "adapters" / ADAPTER, seed=1)
    return {"root": root, "base": Path(base), "adapter": adapter}


def _local(contract_model) -> Endpoint:
    from moeflow.devices import gpus_per_worker
    from moeflow.serving.app import ServeSettings, free_port, start

    settings = ServeSettings(base_dir=str(contract_model["base"]), api_key=KEY,
                             adapters={ADAPTER: str(contract_model["adapter"])})
    url = start(settings, port=free_port(), num_gpus=gpus_per_worker("auto"))  # a GPU where the cluster has one
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return Endpoint("local", client, contract_model["base"].name, [ADAPTER])


def _vllm(contract_model, tmp_path) -> Endpoint:
    from ray import serve

    from moeflow.config import validate
    from moeflow.vllm_plan import vllm_layout
    from moeflow.memory import Plan
    from moeflow.serving import vllm_backend as V
    from moeflow.serving.app import free_port

    lora_uri = os.environ.get("MOEFLOW_CONTRACT_LORA_URI")
    cfg = validate({"model": {"path": str(contract_model["base"])},
                    "deploy": {"backend": "vllm", "lora_uri": lora_uri, "gpu_memory_utilization": 0.3,
                               "max_model_len": 512}})
    plan = {**vllm_layout(Plan(tp=1, pp=1, ep=1, dp=1, fsdp=1)), "weight_dtype": "bf16",
            "enable_expert_parallel": False}
    adapters = {ADAPTER: str(contract_model["adapter"])} if lora_uri else {}
    built = V.build(cfg, str(contract_model["base"]), {"vllm": plan}, adapters, tmp_path)
    built["llm_configs"][0]["engine_kwargs"]["enforce_eager"] = True  # no CUDA-graph capture: starts faster
    built["llm_configs"][0].pop("accelerator_type", None)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    V.start(built["serve_config"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2,
                           timeout=300)
    return Endpoint("vllm", client, contract_model["base"].name, [ADAPTER] if lora_uri else [])


@pytest.fixture(scope="module", params=["local", "vllm"])
def endpoint(request, ray_local, contract_model, tmp_path_factory):
    """The served endpoint of one backend (module scope: started once per backend)."""
    from ray import serve

    if request.param == "vllm" and (why := vllm_missing()):
        pytest.skip(why)
    start = _local if request.param == "local" else (
        lambda m: _vllm(m, tmp_path_factory.mktemp("vllm-merged")))
    ep = start(contract_model)
    yield ep
    serve.shutdown()
