"""Expert LoRA exported as vLLM loads it: PEFT's fused 3-D layout (target_parameters on
`experts.gate_up_proj` / `experts.down_proj`) split into the checkpoint's per-expert modules
(moeflow.training.adapter_layout). The split is exact (the same factors, so the same dW as
PEFT computes from the 3-D adapter); vLLM's own LoRA loading and MoE packing accept it
(in the vLLM environment), and name a renamed or missing per-expert tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeflow.core.errors import UserError
from moeflow.serving import vllm_run
from moeflow.training.adapter_layout import PEFT_PREFIX, export_per_expert, fused_loras

needs_vllm = pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
E, R = 8, 4  # the debug Qwen3-MoE's experts; the adapter's rank


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("vllm-layout")
    base = build_debug_model("qwen3_moe", root / "base", head_dim=32, dtype="float32")
    fused = make_lora_adapter(base, root / "fused", seed=4, rank=R, experts=True)
    return {"base": Path(base), "fused": fused, "root": root,
            "per_expert": export_per_expert(base, fused, root / "per-expert")}


def _per_expert_delta(t: dict, prefix: str, names: list[str], e: int, scale: float) -> torch.Tensor:
    """dW of expert e's fused tensor rebuilt from the exported per-expert modules (Linear view)."""
    parts = [t[f"{prefix}experts.{e}.{n}.lora_B.weight"] @ t[f"{prefix}experts.{e}.{n}.lora_A.weight"]
             for n in names]
    return torch.cat(parts, dim=0) * scale


def test_the_per_expert_export_is_the_same_adapter(tiny):
    """Factors round-trip bit for bit; dW equals PEFT's own get_delta_weight of the 3-D adapter."""
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper

    from moeflow.model.models import load_model

    fused = load_file(str(tiny["fused"] / "adapter_model.safetensors"))
    split = load_file(str(tiny["per_expert"] / "adapter_model.safetensors"))
    conf = json.loads((tiny["per_expert"] / "adapter_config.json").read_text())
    assert not conf.get("target_parameters")
    assert {"gate_proj", "up_proj", "down_proj", "q_proj"} <= set(conf["target_modules"])
    # non-expert tensors unchanged; no fused expert tensor left
    assert all(torch.equal(split[k], v) for k, v in fused.items() if ".experts." not in k)
    assert not any(k.endswith(("experts.lora_A.weight", "experts.base_layer.lora_A.weight")) for k in split)
    loras = {f.param: f for f in fused_loras(tiny["base"], tiny["fused"])}
    assert sorted(loras) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    layout = {"gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}
    model = PeftModel.from_pretrained(load_model(tiny["base"], torch.float32), str(tiny["fused"]))
    wrappers = {n.removeprefix(PEFT_PREFIX).replace(".base_layer", "") + "." + m.parameter_name: m
                for n, m in model.named_modules() if isinstance(m, ParamWrapper)}
    for param, lora in loras.items():
        fused_a, fused_b = (fused[f"{lora.key}.lora_{h}.weight"] for h in "AB")
        prefix = PEFT_PREFIX + param.rsplit("experts.", 1)[0]
        names = layout[param.rsplit(".", 1)[-1]]
        # the 3-D factors rebuilt from the per-expert ones: PEFT's A rows expert-major, B columns rank-major
        a = torch.cat([split[f"{prefix}experts.{e}.{names[0]}.lora_A.weight"] for e in range(E)])
        b = torch.stack([torch.cat([split[f"{prefix}experts.{e}.{n}.lora_B.weight"] for n in names])
                         for e in range(E)], dim=-1).reshape(fused_b.shape[0], -1)
        assert torch.equal(a, fused_a) and torch.equal(b, fused_b), param
        if len(names) == 2:  # gate and up share A: the export writes it twice
            assert all(torch.equal(split[f"{prefix}experts.{e}.gate_proj.lora_A.weight"],
                                   split[f"{prefix}experts.{e}.up_proj.lora_A.weight"]) for e in range(E))
        peft_dw = wrappers[param].get_delta_weight("default")  # [E, out, in]
        scale = wrappers[param].scaling["default"]
        for e in range(E):
            torch.testing.assert_close(_per_expert_delta(split, prefix, names, e, scale), peft_dw[e],
                                       rtol=0, atol=1e-6)


def test_no_per_expert_layout_is_one_line(tiny):
    from moeflow.training.adapter_layout import per_expert_names

    with pytest.raises(UserError, match=r"model.layers.0.mlp.experts.gate_up_proj: the checkpoint stores it fused"):
        per_expert_names("model.layers.0.mlp.experts.gate_up_proj", [])
    with pytest.raises(UserError, match=r"not a PEFT adapter"):
        export_per_expert(tiny["base"], tiny["root"], tiny["root"] / "nothing")


def _variant(tiny, name: str, edit) -> Path:
    out = tiny["root"] / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tiny["per_expert"], out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@needs_vllm
def test_vllm_loads_the_export_and_names_a_renamed_or_missing_expert(tiny):
    from moeflow.serving.adapter_check import vllm_problems

    assert vllm_problems(tiny["base"], tiny["per_expert"]) == []
    # the 3-D adapter as trained: vLLM would take it for a 2-D LoRA
    assert any("model.layers.0.mlp.experts" in p and "per expert" in p
               for p in vllm_problems(tiny["base"], tiny["fused"]))
    key = PEFT_PREFIX + "model.layers.1.mlp.experts.3.up_proj.lora_{}.weight"

    def rename(t):  # expert 3's up_proj moved to an expert the model lacks
        for h in "AB":
            t[key.format(h).replace("experts.3", "experts.11")] = t.pop(key.format(h))

    # an expert the model lacks: vLLM's own expected-module check (experts.<e>.<proj>) refuses it
    (renamed,) = vllm_problems(tiny["base"], _variant(tiny, "renamed", rename))
    assert "vLLM refuses the adapter" in renamed and "model.layers.1.mlp.experts.11.up_proj" in renamed

    def drop(t):  # expert 3's up_proj left out: vLLM packs every expert of the layer
        for h in "AB":
            del t[key.format(h)]

    (dropped,) = vllm_problems(tiny["base"], _variant(tiny, "dropped", drop))
    assert "missing model.layers.1.mlp.experts.3.up_proj" in dropped

    def reshape(t):  # expert 5's down_proj A 8 input features short
        k = key.replace("3.up_proj", "5.down_proj").format("A")
        t[k] = t[k][:, :-8].contiguous()

    problems = vllm_problems(tiny["base"], _variant(tiny, "shaped", reshape))
    assert any("model.layers.1.mlp.experts.5.down_proj" in p and "do not fit" in p for p in problems)
