"""`deploy.backend: vllm` served for real: a tiny Qwen3-MoE (head_dim 32, float32) and an
attention adapter, deployed as `moeflow serve --merge` deploys them (the adapter merged: vLLM's
CPU build has no MoE LoRA), through Ray Serve LLM with its replicas in the vLLM environment.
Its greedy completions, base and adapter, equal moeflow's own engine serving the same base with
the adapter unmerged. Needs `make setup-vllm` (skips naming it without); slow: minutes on CPU."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.parallel.vllm_plan import single_device_plan
from moeflow.serving import vllm_backend as V
from moeflow.serving import vllm_run
from moeflow.serving.deployment import decide

PROMPTS = ["reverse: abc\nanswer:", "hello world", "kqzm zz"]
NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("vllm-serve")
    base = build_debug_model("qwen3_moe", root / "tiny-moe", head_dim=32, dtype="float32")
    return {"base": Path(base), "adapter": make_lora_adapter(base, root / "a1", seed=3, scale=1.0)}


def _cfg(tiny, **deploy):
    return validate({"model": {"path": str(tiny["base"]), "dtype": "float32"},
                     "deploy": {"backend": "vllm", "dtype": "float32", "max_model_len": 256,
                                "host": "127.0.0.1", "port": 0, "adapters": {"a1": str(tiny["adapter"])},
                                **deploy}})


def _greedy(url: str, model: str) -> list[tuple[str, int]]:
    """(text, completion tokens) per prompt. A completion that ends inside a multi-byte UTF-8
    character ends in U+FFFD in moeflow's text and without it in vLLM's (it holds back the
    partial bytes): the text is compared without trailing U+FFFD, the token count in full."""
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((body["choices"][0]["text"].rstrip("\ufffd"), body["usage"]["completion_tokens"]))
    return out


def test_an_unmerged_adapter_on_cpu_is_refused_naming_the_limit(tiny, tmp_path):
    cfg = _cfg(tiny, lora_uri="s3://bucket/adapters")
    dep = decide(cfg, {})
    with pytest.raises(UserError, match=r"vLLM's CPU build cannot serve LoRA adapters on an MoE model.*a1"):
        V.build_run(cfg, dep, {"vllm": single_device_plan()}, tmp_path, device="cpu")
    assert not (tmp_path / "merged").exists()  # refused before anything was written


@pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
def test_a_head_dim_vllms_cpu_build_lacks_is_one_line(tmp_path):
    from moeflow_testing.tiny import build_debug_model

    base = build_debug_model("qwen3_moe", tmp_path / "hd16")  # the debug models' head_dim 16
    with pytest.raises(UserError, match=r"head_dim 16: vLLM's CPU build serves head sizes 32, 64"):
        vllm_run.check_cpu_head_dim(base)


@pytest.mark.slow  # two vLLM engines start on CPU: 5-10 minutes on a busy 2-core host
@pytest.mark.timeout(1500)
@pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
def test_vllm_deploy_with_a_merged_adapter_equals_the_local_engine(tiny, ray_local, tmp_path, monkeypatch):
    from ray import serve

    from moeflow.serving.app import ServeSettings, free_port, start

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a shared CPU host
    cfg = _cfg(tiny, merge=True)
    dep = decide(cfg, {}, merge="a1")  # as `moeflow serve --adapter a1=DIR --merge a1`
    device = vllm_run.cluster_device()
    built = V.build_run(cfg, dep, {"vllm": single_device_plan()}, tmp_path, device=device)
    for llm in built["llm_configs"]:
        llm["engine_kwargs"]["enforce_eager"] = True  # no compile: starts faster
    record = V.serve_and_smoke(cfg, built, device)
    base = tiny["base"].name
    assert sorted(record["models"]) == sorted([base, "a1"])
    assert all(c["completion_tokens"] >= 1 for c in record["smoke"]["completions"].values())
    served = {m: _greedy(record["url"], m) for m in (base, "a1")}
    serve.shutdown()

    url = start(ServeSettings(base_dir=str(tiny["base"]), adapters={"a1": str(tiny["adapter"])},
                              dtype="float32"), port=free_port())
    try:
        ours = {base: _greedy(url, base), "a1": _greedy(url, f"{base}:a1")}
    finally:
        serve.shutdown()
    assert served[base] != served["a1"]  # the adapter changes the output: the test can fail
    assert served == ours
