"""An adapter the serving engine would refuse, or load and never apply, fails regress before
any evaluation, naming its tensors: moeflow's engine's check always, vLLM's own LoRA loading
(in the vLLM environment; skipped naming `make setup-vllm` without it) with deploy.backend vllm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.serving import vllm_run
from moeflow.serving.adapter_check import check_adapters, local_problems, vllm_problems
from tasks.base import StageContext

needs_vllm = pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
RENAMED = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"  # the model has 2 layers
SHAPED = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("adapter-check")
    base = build_debug_model("qwen3_moe", root / "base", head_dim=32)
    good = make_lora_adapter(base, root / "good", seed=1)

    def variant(name: str, edit) -> Path:
        out = root / name
        shutil.copytree(good, out)
        tensors = load_file(str(out / "adapter_model.safetensors"))
        edit(tensors)
        save_file(tensors, str(out / "adapter_model.safetensors"))
        return out

    def rename(t):  # both halves of layer 0's q_proj LoRA moved to a layer the model lacks
        for half in ("lora_A", "lora_B"):
            key = RENAMED.replace("lora_A", half)
            t[key] = t.pop(key.replace("layers.7", "layers.0"))

    def reshape(t):
        t[SHAPED] = t[SHAPED][:, :-8].contiguous()  # 8 input features short

    return {"base": Path(base), "good": good, "renamed": variant("renamed", rename),
            "shaped": variant("shaped", reshape)}


def test_the_local_engine_names_a_renamed_and_a_misshaped_tensor(adapters):
    assert local_problems(adapters["base"], adapters["good"]) == []
    (renamed,) = local_problems(adapters["base"], adapters["renamed"])
    assert RENAMED in renamed and "lacks" in renamed
    (shaped,) = local_problems(adapters["base"], adapters["shaped"])
    assert SHAPED in shaped and "in features" in shaped


@pytest.mark.slow  # vLLM's own loader in its venv
@needs_vllm
def test_vllms_loading_names_a_renamed_and_a_misshaped_tensor(adapters):
    assert vllm_problems(adapters["base"], adapters["good"]) == []
    # vLLM itself compares only the leaf (q_proj): the renamed tensor loads and is never applied
    (renamed,) = vllm_problems(adapters["base"], adapters["renamed"])
    assert "model.layers.7.self_attn.q_proj" in renamed and "never applied" in renamed
    (shaped,) = vllm_problems(adapters["base"], adapters["shaped"])
    assert "model.layers.1.self_attn.o_proj" in shaped and "do not fit" in shaped


@pytest.mark.slow  # vLLM's own loader in its venv
@needs_vllm
def test_vllm_names_a_fused_expert_adapter_it_would_apply_wrongly(adapters, tmp_path):
    from moeflow_testing.serving import make_lora_adapter

    experts = make_lora_adapter(adapters["base"], tmp_path / "experts", seed=2, experts=True)
    problems = vllm_problems(adapters["base"], experts)
    assert any("model.layers.0.mlp.experts" in p and "serve it merged" in p for p in problems)


def _regress(tmp_path: Path, base: Path, adapter: Path, backend: str):
    from tasks.regress import run

    cfg = validate({"model": {"path": str(base)}, "deploy": {"backend": backend}})
    ctx = StageContext(stage="regress", config=cfg, out_dir=tmp_path / "regress",
                       inputs={"convert": {"output_dir": str(base)},
                               "finetune": {"adapter_dir": str(adapter)}})
    (tmp_path / "regress").mkdir()
    return run(ctx)


@pytest.mark.parametrize("backend", ["local", pytest.param("vllm", marks=needs_vllm)])
def test_regress_fails_before_evaluating_naming_the_tensor(adapters, tmp_path, backend):
    with pytest.raises(UserError, match=f"adapter 'adapter' \\({backend} engine\\).*layers.7.self_attn.q_proj"):
        _regress(tmp_path, adapters["base"], adapters["renamed"], backend)
    assert not (tmp_path / "regress" / "results.json").exists()


def test_check_adapters_records_what_was_not_checked(adapters, monkeypatch):
    monkeypatch.setattr(vllm_run, "vllm_missing", lambda: "no vLLM environment (.venv-vllm): `make setup-vllm`")
    found = check_adapters(adapters["base"], {"a": str(adapters["good"])}, "vllm")
    assert found["adapters"] == {"a": {"local": []}}
    assert "make setup-vllm" in found["not_checked"]["vllm"]
    assert json.dumps(found)  # goes into the stage record
