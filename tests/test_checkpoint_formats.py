"""MXFP4 releases (GPT-OSS layout): the reader, and convert against transformers' own
dequantising load."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow.checkpoint import mxfp4
from moeflow.core.errors import UserError


def test_decode_is_transformers_and_encode_round_trips():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 48, 80) * 0.1  # [E, out, in], in not a multiple of 32
    blocks, scales = mxfp4.encode(w)
    assert blocks.shape == (3, 48, 3, 16) and scales.shape == (3, 48, 3)
    got = mxfp4.decode(blocks, scales, dtype=torch.float32, in_features=80)  # [E, out, in]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G*32, out]
    assert torch.equal(got, ref.transpose(1, 2)[..., :80])
    assert torch.equal(mxfp4.encode(got)[0], blocks)  # decoded values encode to the same codes
    rel = (got - w).abs().max() / w.abs().max()
    assert rel < 0.2  # E2M1: at most 1/6 of the group max, plus saturation
    assert torch.equal(mxfp4.decode(blocks, scales, dtype=torch.bfloat16, in_features=80).float(), got)


def test_narrow_widths_and_bad_layouts_are_one_line():
    w = torch.randn(2, 8, 16)  # expert width 16: half a block
    blocks, scales = mxfp4.encode(w)
    assert mxfp4.decode(blocks, scales, dtype=torch.float32, in_features=16).shape == (2, 8, 16)
    with pytest.raises(UserError, match="padding beyond input width 8"):
        mxfp4.decode(blocks, scales, dtype=torch.float32, in_features=8)
    with pytest.raises(UserError, match=r"not MXFP4 \[\*lead, out, G, 16\]"):
        mxfp4.decode(blocks[..., :8], scales, name="x")
    with pytest.raises(UserError, match="cannot hold 40 input values"):
        mxfp4.decode(blocks, scales, in_features=40)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from moeflow_testing.releases import mxfp4_release
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("mxfp4")
    src = build_debug_model("gpt_oss", root / "bf16")
    return mxfp4_release(src, root / "release")


def test_release_layout_and_inspect(gpt_oss):
    from moeflow.checkpoint.formats import summary
    from moeflow.checkpoint.parse import read_checkpoint

    ckpt = read_checkpoint(gpt_oss)
    blocks = ckpt.tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == "U8" and blocks.shape == (4, 64, 2, 16)  # [E, 2I, H/32, 16]
    assert ckpt.tensors["model.layers.0.mlp.experts.down_proj_scales"].shape == (4, 64, 1)
    formats = summary(ckpt)
    assert formats["mxfp4"]["tensors"] == 4 and "bf16" in formats


def test_mxfp4_release_converts_to_transformers_logits(gpt_oss, tmp_path):
    import transformers
    from safetensors import safe_open

    from moeflow.checkpoint.convert import convert_checkpoint

    result = convert_checkpoint(gpt_oss, tmp_path / "out", workers=1)
    fn = result["report"]["functional"]
    assert result["report"]["passed"], result["report"]["failures"]
    assert fn["logits_equal"] and fn["source_rounded_to_output"] and not fn["missing"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    entry = manifest["source_tensors"]["model.layers.1.mlp.experts.down_proj"]
    assert entry["format"] == "mxfp4" and entry["parts"]["blocks"]["dtype"] == "U8"
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    # the decoded experts are bit-identical to transformers' dequantised load (in bf16)
    ref = transformers.GptOssForCausalLM.from_pretrained(
        str(gpt_oss), dtype=torch.bfloat16,
        quantization_config=transformers.Mxfp4Config(dequantize=True))
    name = "model.layers.1.mlp.experts.down_proj"
    with safe_open(str(tmp_path / "out" / manifest["tensors"][name]["file"]), "pt") as f:
        assert torch.equal(f.get_tensor(name), ref.state_dict()[name])


def test_keep_keeps_mxfp4_and_transformers_loads_it_as_the_release(gpt_oss, tmp_path):
    """--dtype keep writes the release's stored tensors and quantization_config: transformers'
    own MXFP4 load of the output equals its load of the release."""
    import transformers

    from moeflow.checkpoint.convert import convert_checkpoint

    result = convert_checkpoint(gpt_oss, tmp_path / "keep", dtype="keep", workers=1)
    assert result["report"]["passed"] and result["report"]["kept"]
    ids = torch.arange(24).reshape(2, 12) * 5 % 200
    logits = []
    for path in (gpt_oss, tmp_path / "keep"):
        model = transformers.GptOssForCausalLM.from_pretrained(
            str(path), dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True))
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert torch.equal(*logits)


def test_mxfp4_experts_stream_one_expert_at_a_time(gpt_oss, tmp_path, monkeypatch):
    """Memory bound: with a one-expert budget every MXFP4 read decodes the experts that fit
    it (the parts are read as row ranges too), never the layer's fused tensor."""
    import moeflow.checkpoint.engine as engine_mod
    import moeflow.checkpoint.plan as plan_mod
    from moeflow.checkpoint import formats
    from moeflow.checkpoint.convert import convert_checkpoint

    monkeypatch.setattr(plan_mod, "ROW_BUDGET", 64 * 64 * 4)  # one expert of gate_up in fp32
    seen, original = [], formats.read

    def read(info, rows=None, fd=None, source=None):
        seen.append((info.name, rows))
        return original(info, rows, fd=fd, source=source)

    monkeypatch.setattr(engine_mod.formats, "read", read)
    result = convert_checkpoint(gpt_oss, tmp_path / "out", workers=1, verify=False)
    assert result["tensors"] > 0 and seen
    # gate_up experts are 64x64 (one per read), down_proj 64x32 (two fit the budget); E = 4
    width = {"gate_up_proj": 1, "down_proj": 2}
    assert all(rows is not None and rows[1] - rows[0] == width[n.rpartition(".")[2]]
               for n, rows in seen)
    assert {n for n, _ in seen} == {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                    for p in ("gate_up_proj", "down_proj")}
