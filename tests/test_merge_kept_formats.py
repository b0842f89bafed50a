"""A LoRA adapter merged into compressed-tensors releases kept in their own format (INT4
group, NVFP4, FP8 blocks: experts quantised, per expert on disk as Qwen3-MoE / Kimi-K2
ship them): attention adapters leave every packed byte and give base + adapter's logits;
expert adapters are split back onto the per-expert tensors (transformers' reverse
conversion) and requantised within the format's bound (moeflow.checkpoint.requant),
the error recorded; a zero adapter changes no byte; the merged release serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_merge_kept import _adapter, _logits, _packed_parts, _stored

pytestmark = pytest.mark.usefixtures("one_thread")
FORMATS = {"int4-group": "pack-quantized", "nvfp4": "nvfp4-pack-quantized",
           "fp8-block": "float-quantized"}
EXPERTS = {"target_modules": ["q_proj"],
           "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.releases import ct_release
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("merge-kept-formats")
    qwen = build_debug_model("qwen3_moe", root / "qwen", dtype="float32")
    out = {"root": root,
           "attention": _adapter(qwen, root / "a-attn", target_modules=["q_proj", "v_proj", "o_proj"]),
           "experts": _adapter(qwen, root / "a-experts", **EXPERTS),
           "zero": _adapter(qwen, root / "a-zero", zero_b=True, **EXPERTS)}
    for name in FORMATS:
        rel = ct_release(qwen, root / f"{name}-rel", name, experts_only=True)
        convert_checkpoint(rel, root / f"{name}-kept", dtype="keep", workers=1)
    return out


def _reference(kept: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel

    from moeflow.model.packed_base import load_packed

    plain, _ = load_packed(kept, torch.float32, packed=False)
    return _logits(PeftModel.from_pretrained(plain, str(adapter)).eval(), plain.config.vocab_size)


@pytest.mark.parametrize("name", list(FORMATS))
def test_attention_merge_keeps_every_packed_byte(world, name):
    from moeflow.model.packed_base import load_packed
    from moeflow.training.merge_kept import merge_kept

    kept = world["root"] / f"{name}-kept"
    out = merge_kept(kept, world["attention"], world["root"] / f"{name}-attn")
    before, after = _stored(kept), _stored(Path(out["output_dir"]))
    parts = _packed_parts(kept)
    assert parts and before.keys() == after.keys() and out["requantized"] == {}
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in parts)
    assert {k for k in before if not torch.equal(before[k], after[k])} == set(out["merged"])
    ref = _reference(kept, world["attention"])
    merged, held = load_packed(out["output_dir"], torch.float32)
    assert held and (_logits(merged, merged.config.vocab_size) - ref).abs().max() \
        <= 1e-5 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("name", list(FORMATS))
def test_expert_merge_requantises_in_the_release_format_within_its_bound(world, name):
    from moeflow.checkpoint.formats import find_packed
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.model.packed_base import load_packed
    from moeflow.training.merge_kept import merge_kept, merge_metrics

    kept = world["root"] / f"{name}-kept"
    out = merge_kept(kept, world["experts"], world["root"] / f"{name}-experts")
    req = out["requantized"]
    experts = {k for k in find_packed(read_checkpoint(kept))[0] if ".experts." in k}
    assert set(req) == experts  # every expert of every layer: split back from the fused delta
    assert all(s["within_bound"] and 0 < s["max_over_bound"] <= 1 and 0 < s["rel_rms"] < 0.25
               for s in req.values())
    packed, _ = find_packed(read_checkpoint(out["output_dir"]))
    assert {t.format for k, t in packed.items() if k in experts} == {FORMATS[name]}
    before, after = _stored(kept), _stored(Path(out["output_dir"]))
    assert {k: (v.dtype, v.shape) for k, v in before.items() if k not in out["merged"]} == \
        {k: (v.dtype, v.shape) for k, v in after.items() if k not in out["merged"]}
    assert all(after[k].dtype == before[k].dtype and after[k].shape == before[k].shape
               for k in out["merged"] if ".experts." in k)
    metrics = merge_metrics(out["output_dir"])
    assert metrics["merge/requantized_tensors"] == len(experts)
    assert 0 < metrics["merge/requant_max_over_bound"] <= 1
    # the merged release's error against base + adapter, as the engine loads it
    ref = _reference(kept, world["experts"])
    merged, held = load_packed(out["output_dir"], torch.float32)
    got = _logits(merged, merged.config.vocab_size)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert held and cos > 0.95 and out["logits"]["cosine"] > 0.95


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_zero_expert_adapter_changes_no_byte(world, name):
    from moeflow.training.merge_kept import merge_kept

    kept = world["root"] / f"{name}-kept"
    out = merge_kept(kept, world["zero"], world["root"] / f"{name}-zero")
    before, after = _stored(kept), _stored(Path(out["output_dir"]))
    assert out["requantized"] == {} and before.keys() == after.keys()
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before
               if ".experts." in k)


def test_requantised_int4_release_serves_on_the_local_engine(world):
    from transformers import AutoTokenizer

    from moeflow.model.models import load_model
    from moeflow.model.packed_base import load_packed
    from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
    from moeflow.training.merge import write_merged

    kept = world["root"] / "int4-group-kept"
    merged = write_merged(str(kept), world["experts"], world["root"] / "int4-serve", "float32")
    tok = AutoTokenizer.from_pretrained(str(merged))
    prompts = ["hello world", "the quick brown fox"]
    cand, _ = load_packed(merged, torch.float32)  # what the engine loads: experts packed
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        refs.append(cand.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist())
    engine = Engine(load_model(merged, torch.float32), tok, EngineConfig(max_num_batched_tokens=16))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(str(i), tok(p).input_ids, SamplingParams(max_tokens=8),
                      lambda d, i=i: out[i].extend(d.token_ids))
    engine.run_until_idle()
    assert [out[i] for i in range(len(prompts))] == refs


# --- FP8 blocks in DeepSeek's own layout (`weight` e4m3 + `weight_scale_inv`, quant_method fp8),
# kept by `convert --dtype fp8`: attention is FP8 there too

def _adapter_on(kept: Path, out: Path, zero_b: bool = False, **targets) -> Path:
    from peft import LoraConfig, get_peft_model

    from moeflow.model.packed_base import load_packed

    torch.manual_seed(0)
    model, _ = load_packed(kept, torch.float32, packed=False)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=zero_b,
                                     **targets)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.tiny import build_fp8_debug_model

    root = tmp_path_factory.mktemp("merge-fp8-blocks")
    convert_checkpoint(build_fp8_debug_model(root / "src"), root / "kept", dtype="fp8", workers=1)
    kept = root / "kept"
    experts = {"target_modules": ["q_b_proj"],
               "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    return {"root": root, "kept": kept,
            "attention": _adapter_on(kept, root / "a-attn", target_modules=["q_b_proj", "o_proj"]),
            "experts": _adapter_on(kept, root / "a-experts", **experts),
            "zero": _adapter_on(kept, root / "a-zero", zero_b=True, **experts)}


def test_fp8_block_merge_requantises_in_weight_scale_inv_blocks(deepseek):
    from moeflow.checkpoint.manifest import read_manifest
    from moeflow.model.packed_base import load_packed
    from moeflow.training.merge import write_merged

    kept = deepseek["kept"]
    merged = write_merged(str(kept), deepseek["experts"], deepseek["root"] / "m-experts", "float32")
    record = read_manifest(merged)["merged_adapter"]
    req = record["requantized"]
    assert sorted(req) == sorted([f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2)
                                  for p in ("gate_up_proj", "down_proj")]
                                 + [f"model.layers.{i}.self_attn.q_b_proj.weight" for i in (0, 1, 2)])
    assert all(s["within_bound"] and 0 < s["max_over_bound"] <= 1 and 0 < s["rel_rms"] < 0.05
               for s in req.values())
    before, after = _stored(kept), _stored(merged)
    assert before.keys() == after.keys()
    assert {k: (v.dtype, v.shape) for k, v in before.items()} == {k: (v.dtype, v.shape) for k, v in after.items()}
    assert {k for k in before if not torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))} \
        <= set(record["tensors"])
    ref = _reference(kept, deepseek["experts"])
    model, _ = load_packed(merged, torch.float32)
    got = _logits(model, model.config.vocab_size)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.99


def test_fp8_block_attention_merge_leaves_the_experts_and_a_zero_adapter_every_byte(deepseek):
    from moeflow.training.merge_kept import merge_kept

    kept = deepseek["kept"]
    before = _stored(kept)
    out = merge_kept(kept, deepseek["attention"], deepseek["root"] / "m-attn")
    after = _stored(Path(out["output_dir"]))
    experts = [k for k in before if ".mlp.experts." in k]
    assert experts and all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))
                           for k in experts)
    assert set(out["requantized"]) == {f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1, 2)
                                       for p in ("q_b_proj", "o_proj")}
    zero = merge_kept(kept, deepseek["zero"], deepseek["root"] / "m-zero")
    after = _stored(Path(zero["output_dir"]))
    assert zero["requantized"] == {} and zero["merged"] == []
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before)


def test_merged_fp8_block_release_serves_on_the_local_engine(deepseek):
    """The engine over moeflow's loader (`load_packed` decodes the fused experts' scale_inv;
    transformers' CPU path leaves them unused: docs/release-formats.md)."""
    from transformers import AutoTokenizer

    from moeflow.model.packed_base import load_packed
    from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
    from moeflow.training.merge_kept import merge_kept

    merged = Path(merge_kept(deepseek["kept"], deepseek["experts"], deepseek["root"] / "m-serve",
                             check_logits=False)["output_dir"])
    tok = AutoTokenizer.from_pretrained(str(merged))
    model, _ = load_packed(merged, torch.float32)
    prompts = ["hello world", "the quick brown fox"]
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        refs.append(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist())
    engine = Engine(model, tok, EngineConfig(max_num_batched_tokens=16))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(str(i), tok(p).input_ids, SamplingParams(max_tokens=8),
                      lambda d, i=i: out[i].extend(d.token_ids))
    engine.run_until_idle()
    assert [out[i] for i in range(len(prompts))] == refs
