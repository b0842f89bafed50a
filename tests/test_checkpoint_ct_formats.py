"""compressed-tensors releases (INT4/INT8 pack-quantized, NVFP4, FP8 float-quantized):
convert decodes them with the library's compressors; logits equal the library's own
model-free dequantisation (bf16), loaded by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow_testing.releases import SCHEMES


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    from moeflow_testing.tiny import build_debug_model

    return build_debug_model("qwen3_moe", tmp_path_factory.mktemp("ct") / "bf16")


FORMAT = {"int4-group": "pack-quantized", "int4-group-asym": "pack-quantized",
          "int8-channel": "pack-quantized", "int4-channel-asym": "pack-quantized",
          "nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "fp8-tensor": "float-quantized",
          "fp8-channel": "float-quantized", "fp8-block": "float-quantized"}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_release_converts_to_the_library_reference(bf16, tmp_path, scheme):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.checkpoint.summary import summarize
    from moeflow_testing.releases import ct_release

    src = ct_release(bf16, tmp_path / "release", scheme)
    stored = summarize(read_checkpoint(src))["formats"]
    assert stored[FORMAT[scheme]]["kinds"] == ["attention", "experts"]  # per-expert linears too
    result = convert_checkpoint(src, tmp_path / "out", workers=1)
    report = result["report"]
    assert report["passed"], report["failures"]
    fn = report["functional"]
    assert fn["logits_equal"] and fn["logits_max_abs_diff"] == 0.0 and not fn["unexpected"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    formats = {e.get("format") for e in manifest["source_tensors"].values()}
    assert FORMAT[scheme] in formats and manifest["dequantized"]


def test_decoded_weight_is_the_compressors(bf16, tmp_path):
    """One per-expert INT4 asymmetric weight: bit-identical to compressed-tensors' decompress."""
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file

    from moeflow.checkpoint.formats import logical_view, read
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow_testing.releases import ct_release, scheme

    src = ct_release(bf16, tmp_path / "release", "int4-group-asym")
    view = logical_view(read_checkpoint(src))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    got = read(view.tensors[name])
    stored = {}
    for shard in src.glob("*.safetensors"):
        stored.update({k.rpartition(".")[2]: v for k, v in load_file(str(shard)).items()
                       if k.startswith(name[: -len("weight")])})
    ref = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        stored, scheme("int4-group-asym"))["weight"]
    assert got.shape == (64, 32) and torch.equal(got, ref.float())
