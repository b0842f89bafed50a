"""Per-layer functional check (the path for models too large to load whole),
forced on tiny models: passes on a faithful conversion, fails on a changed weight."""

import json
import shutil

import pytest
import torch

from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.checkpoint.layercheck import per_layer_check
from moeflow.checkpoint.st_io import read_header
from moeflow.checkpoint.verify import verify_converted
from moeflow_testing.tiny import build_debug_model

CORPUS = ["reverse: a b c\nanswer: c b a"] * 8


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("layercheck")
    src = build_debug_model("qwen3_moe", root / "src", corpus=CORPUS)
    result = convert_checkpoint(src, root / "out", verify=False)
    return root, src, result


def test_per_layer_forced_passes(converted):
    _, src, result = converted
    report = verify_converted(result["output_dir"], src, per_layer=True)
    assert report["passed"], report["failures"]
    layers = report["functional"]["per_layer"]
    assert layers["layers"] == 2 and layers["equal"] and layers["per_layer"] == [0.0, 0.0]
    assert report["functional"]["logits_equal"] is None  # whole-model logits not run


def test_per_layer_catches_changed_weight(converted):
    root, src, result = converted
    bad = root / "bad"
    shutil.copytree(result["output_dir"], bad)
    name = "model.layers.1.self_attn.o_proj.weight"
    info = read_header(bad / "model-layer-00001.safetensors")[0][name]
    with open(info.file, "r+b") as f:  # first element := 1.0 (bf16), far above the 0.02 init
        f.seek(info.start)
        f.write(torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    layers = per_layer_check(src, bad, manifest)
    assert layers["per_layer"][0] == 0.0 and layers["per_layer"][1] > 0
    assert layers["worst_layer"] == 1 and not layers["within_tolerance"]
    report = verify_converted(bad, src, per_layer=True)
    assert any("decoder layer 1" in f for f in report["failures"])
