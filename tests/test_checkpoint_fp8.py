"""`--dtype fp8`: FP8 block-scaled weights kept with their fused scales.

One DeepSeek-V3 FP8 debug model is converted once; the tests check the kept
bytes and scales against the source, the config, the verification (tensor
and logits) and the export round trip, and that a corrupted scale is caught.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.checkpoint.export import export_hf
from moeflow.checkpoint.st_io import read_header
from moeflow.checkpoint.verify import verify_converted
from moeflow.core.errors import UserError
from moeflow_testing.tiny import build_debug_model, build_fp8_debug_model

CORPUS = ["reverse: a b c\nanswer: c b a"] * 8


def _tensors(path):
    out = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def fp8_work(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8keep")
    src = build_fp8_debug_model(root / "src", corpus=CORPUS)
    result = convert_checkpoint(src, root / "out", dtype="fp8")
    return root, src, result


def test_fp8_kept_and_scales_fused(fp8_work):
    _, src, result = fp8_work
    out = Path(result["output_dir"])
    got, source = _tensors(out), _tensors(src)
    layer = "model.layers.2.mlp.experts"
    assert got[f"{layer}.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert got[f"{layer}.gate_up_proj_scale_inv"].dtype == torch.float32
    e = 3  # fused expert 3 = concat(gate, up) of its e4m3 bytes and of its scales
    gate, up = (f"model.layers.2.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up"))
    assert _bytes(got[f"{layer}.gate_up_proj"][e]) == _bytes(torch.cat([source[gate], source[up]]))
    assert torch.equal(got[f"{layer}.gate_up_proj_scale_inv"][e],
                       torch.cat([source[gate + "_scale_inv"], source[up + "_scale_inv"]]))
    down = f"model.layers.2.mlp.experts.{e}.down_proj.weight"
    assert torch.equal(got[f"{layer}.down_proj_scale_inv"][e], source[down + "_scale_inv"])
    q = "model.layers.1.self_attn.q_b_proj.weight"
    assert _bytes(got[q]) == _bytes(source[q])
    assert torch.equal(got[q + "_scale_inv"], source[q + "_scale_inv"])
    # non-quantised tensors are kept as they are (bf16)
    assert got["model.embed_tokens.weight"].dtype == torch.bfloat16
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "fp8" and not manifest["dequantized"]
    assert manifest["tensors"][f"{layer}.gate_up_proj_scale_inv"]["sources"][0].endswith("_scale_inv")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [16, 16]


def test_fp8_verified_tensor_and_logits(fp8_work):
    _, _, result = fp8_work
    report = result["report"]
    assert report["passed"] and report["mismatches"] == 0
    assert report["kinds"]["experts"]["max_abs_err"] == 0.0  # kept bytes: bit-exact
    fn = report["functional"]
    assert fn["loader"].startswith("moeflow-fp8")
    assert fn["missing"] == [] and fn["unexpected"] == [] and fn["mismatched"] == []
    # dequantised by our fp8.py vs the source dequantised by transformers
    assert fn["logits_equal"] is True


def test_fp8_export_round_trip(fp8_work):
    root, src, result = fp8_work
    back = export_hf(result["output_dir"], root / "back")
    a, b = _tensors(src), _tensors(back["output_dir"])
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and _bytes(a[k]) == _bytes(b[k]) for k in a)


def test_fp8_corrupted_scale_is_caught(fp8_work):
    root, src, result = fp8_work
    bad = root / "bad"
    shutil.copytree(result["output_dir"], bad)
    name = "model.layers.1.mlp.experts.down_proj_scale_inv"
    info = next(h[name] for f in bad.glob("*.safetensors") if name in (h := read_header(f)[0]))
    with open(info.file, "r+b") as f:  # double one scale: a wrong dequantised block
        f.seek(info.start + 4 * 5)
        value = torch.frombuffer(bytearray(f.read(4)), dtype=torch.float32) * 2
        f.seek(info.start + 4 * 5)
        f.write(value.numpy().tobytes())
    report = verify_converted(bad, src, functional=False)
    assert not report["passed"] and any(name in f for f in report["failures"])


def test_fp8_needs_scaled_source_blocks(tmp_path):
    """A bf16 model under --dtype fp8 is simply kept (nothing to keep scaled)."""
    src = build_debug_model("qwen3_moe", tmp_path / "src", corpus=CORPUS)
    result = convert_checkpoint(src, tmp_path / "out", dtype="fp8", verify=False)
    tensors = _tensors(result["output_dir"])
    assert not any(k.endswith("_scale_inv") for k in tensors)
    with pytest.raises(UserError, match="--dtype int4"):
        convert_checkpoint(src, tmp_path / "out2", dtype="int4", verify=False)


def test_section_accepts_fp8():
    from moeflow.core.sections.convert import ConvertSection

    assert ConvertSection(dtype="fp8").dtype == "fp8"


def test_fp8_per_layer_check(fp8_work):
    """Kept FP8 layers (dense first layer, MLA, fused experts with scales) equal
    the source layers dequantised by transformers' Fp8Dequantize."""
    from moeflow.checkpoint.layercheck import per_layer_check

    _, src, result = fp8_work
    manifest = json.loads((Path(result["output_dir"]) / "manifest.json").read_text())
    layers = per_layer_check(src, result["output_dir"], manifest)
    assert layers["layers"] == 3 and layers["equal"]


def test_fp8_loads_on_cpu_with_its_scales(fp8_work):
    """load_model of a `--dtype fp8` checkpoint on CPU: the fused experts' `*_scale_inv` are
    applied (transformers' dequantise-on-load leaves them unused and runs on raw e4m3 values).
    Reference: the source release dequantised by transformers' own FP8 loader, which pairs
    its per-expert `.weight_scale_inv`; both hold the same e4m3 values times the same scales."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.auto import AutoQuantizationConfig

    from moeflow.checkpoint import fp8
    from moeflow.model.models import load_model, unpaired_fp8_scales

    _, src, result = fp8_work
    out = Path(result["output_dir"])
    assert "model.layers.2.mlp.experts.gate_up_proj_scale_inv" in unpaired_fp8_scales(out)
    assert unpaired_fp8_scales(src) == []  # per-expert `.weight` scales: transformers pairs them
    qc = AutoQuantizationConfig.from_dict(json.loads((Path(src) / "config.json").read_text())["quantization_config"])
    qc.dequantize = True
    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, quantization_config=qc).eval()
    model = load_model(out, torch.float32).eval()
    stored = _tensors(out)
    name = "model.layers.2.mlp.experts.gate_up_proj"
    want = fp8.dequantize(stored[name], stored[name + "_scale_inv"], (16, 16), torch.float32)
    assert torch.equal(model.get_parameter(name).detach(), want)
    ids = (torch.arange(16).reshape(1, 16) * 7 + 3) % model.config.vocab_size  # [1, 16]
    with torch.no_grad():
        got, ref = model(input_ids=ids).logits, reference(input_ids=ids).logits  # [1, 16, V]
    # same values dequantised in fp32 on both sides: equal up to summation order
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    with pytest.raises(UserError, match="distributed_config"):
        load_model(out, torch.float32, distributed_config=object())
