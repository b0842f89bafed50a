"""The reference-shape debug model (moeflow_testing/reference/): MXFP4 experts on disk convert
exactly, the cache reproduces a full forward, images go through transformers' processor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow.model import remote_code


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    from moeflow_testing.reference.build import build_model

    out = tmp_path_factory.mktemp("refmx") / "model"
    path = build_model(out, experts="mxfp4", n_routed_experts=32, num_experts_per_tok=4)
    remote_code.activate(path, trust=True)
    return path


def test_experts_stored_as_mxfp4(release):
    from safetensors import safe_open

    config = json.loads((release / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert key not in index
    with safe_open(str(release / index[key + "_blocks"]), "pt") as f:
        blocks, scales = f.get_tensor(key + "_blocks"), f.get_tensor(key + "_scales")
    # [E, out = 2 * 32, in = 32 latent -> 1 group, 16 bytes]
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (32, 64, 1, 16)
    assert tuple(scales.shape) == (32, 64, 1)


def test_convert_dequantises_to_the_reference(release, tmp_path):
    from moeflow.checkpoint.convert import convert_checkpoint

    result = convert_checkpoint(release, tmp_path / "conv", dtype="bf16", workers=1)
    report = result["report"]
    assert report["passed"], report["failures"]
    assert report["functional"]["logits_max_abs_diff"] == 0.0  # equal to transformers' decoder


def test_cached_decode_equals_full_forward(release):
    model = _loaded(release)
    ids = torch.tensor([[3, 9, 27, 81, 11, 5, 7]])
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        out = model(ids[:, :4], use_cache=True)
        out = model(ids[:, 4:6], past_key_values=out.past_key_values, use_cache=True)  # a chunk
        step = model(ids[:, 6:], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
    assert torch.allclose(full, step, atol=1e-5)


def test_image_through_the_processor(release):
    from PIL import Image
    from transformers import AutoTokenizer

    from moeflow.model.multimodal import load_processor

    model = _loaded(release)
    tok = AutoTokenizer.from_pretrained(str(release))
    proc = load_processor(release, tok)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=[Image.new("RGB", (32, 32), (200, 30, 30))], return_tensors="pt")
    slots = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert slots == int(inputs["image_grid_thw"].prod()) // 4  # one token per 2x2 merged patches
    with torch.no_grad():
        with_image = model(**inputs).logits
        other = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
        assert not torch.allclose(with_image, model(**other).logits)  # the pixels reach the logits


_MODELS: dict = {}


def _loaded(path: Path):
    """The release as the pipeline sees it after convert (bf16 experts), loaded once."""
    if path not in _MODELS:
        from moeflow.checkpoint.mxfp4_files import dequantized_copy
        from moeflow.model.models import load_model

        plain = dequantized_copy(path, path.parent / "plain")
        remote_code.activate(plain, trust=True)
        _MODELS[path] = load_model(plain, torch.float32).eval()
    return _MODELS[path]
