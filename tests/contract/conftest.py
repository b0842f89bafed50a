"""Backends the OpenAI contract suite runs against: `local` (moeflow's engine on Ray Serve)
always; `vllm` (Ray Serve LLM over vLLM, its replicas in the project's vLLM environment)
wherever that environment exists (`make setup-vllm`; vLLM's CPU build on a CPU host).
Each yields an `Endpoint`: an openai client, the base model id, and the model id each adapter
is served under. On a CPU host vLLM cannot apply LoRA to an MoE model, so the vllm backend
serves the adapter merged (model id: its name); on a GPU it needs the adapter in cloud
storage (MOEFLOW_CONTRACT_LORA_URI=<prefix holding contract-a1/>, else its adapter checks
skip) and serves it as `<base>:<adapter>`. The model has head_dim 32: vLLM's CPU attention
refuses the debug models' 16."""

from __future__ import annotations

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
    adapters: dict[str, str] = field(default_factory=dict)  # adapter name -> its served model id


@pytest.fixture(scope="module")
def contract_model(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint and one attention LoRA adapter for it."""
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("contract")
    base = build_debug_model("qwen3_moe", root / "contract-moe", head_dim=32)
    adapter = make_lora_adapter(base, root / "adapters" / ADAPTER, seed=1)
    return {"root": root, "base": Path(base), "adapter": adapter}


def _local(contract_model) -> Endpoint:
    from moeflow.core.devices import gpus_per_worker
    from moeflow.serving.app import ServeSettings, free_port, start

    settings = ServeSettings(base_dir=str(contract_model["base"]), api_key=KEY,
                             adapters={ADAPTER: str(contract_model["adapter"])})
    url = start(settings, port=free_port(), num_gpus=gpus_per_worker("auto"))  # a GPU where the cluster has one
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return Endpoint("local", client, contract_model["base"].name,
                    {ADAPTER: f"{contract_model['base'].name}:{ADAPTER}"})


def _vllm(contract_model, tmp_path) -> Endpoint:
    from moeflow.core.config import validate
    from moeflow.parallel.vllm_plan import single_device_plan
    from moeflow.serving import vllm_backend as V
    from moeflow.serving import vllm_run
    from moeflow.serving.app import free_port

    device = vllm_run.cluster_device()
    lora_uri = os.environ.get("MOEFLOW_CONTRACT_LORA_URI")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: a shared CPU host
    cfg = validate({"model": {"path": str(contract_model["base"])},
                    "deploy": {"backend": "vllm", "lora_uri": lora_uri, "gpu_memory_utilization": 0.3,
                               "max_model_len": 512}})
    merged = device == "cpu"  # vLLM's CPU build has no MoE LoRA
    adapters = {ADAPTER: str(contract_model["adapter"])} if lora_uri or merged else {}
    built = V.build(cfg, str(contract_model["base"]), {"vllm": single_device_plan()}, adapters, tmp_path,
                    merge=ADAPTER if merged else None, device=device)
    for llm in built["llm_configs"]:
        llm["engine_kwargs"]["enforce_eager"] = True  # no graph capture or compile: starts faster
    url = V.start(built["serve_config"], device, "127.0.0.1", free_port())
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=300)
    base = contract_model["base"].name
    ids = {a["name"]: a["name"] if a["served"] == "merged" else f"{base}:{a['name']}" for a in built["adapters"]}
    return Endpoint("vllm", client, base, ids)


@pytest.fixture(scope="module", params=["local", pytest.param("vllm", marks=pytest.mark.slow)])  # vLLM: minutes
def endpoint(request, ray_local, contract_model, tmp_path_factory):
    """The served endpoint of one backend (module scope: started once per backend)."""
    from ray import serve

    from moeflow.serving.vllm_run import vllm_missing

    if request.param == "vllm" and (why := vllm_missing()):
        pytest.skip(why)
    start = _local if request.param == "local" else (
        lambda m: _vllm(m, tmp_path_factory.mktemp("vllm-merged")))
    ep = start(contract_model)
    yield ep
    serve.shutdown()
