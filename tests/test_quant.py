"""Quantisation (compressed-tensors), the layer-by-layer compare engine, `moeflow compare`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.quant.schemes import (
    SCHEMES,
    dequantize_weight,
    get_scheme,
    quantization_config,
    quantize_weight,
    scheme_of_config,
)
from tests.conftest import BIN, cli_env
from tests.quant_assets import edited, noisy, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text_samples():
    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.golden import golden_samples

    return golden_samples(load_suite(None), tiny("qwen3_moe"), limit=12)


def _quantize(scheme: str, src=None, out=None, tmp=None):
    from moeflow.quant.quantize import default_ignore, quantize_checkpoint
    from moeflow.quant.source import ModelSource

    src = src or tiny("qwen3_moe")
    return quantize_checkpoint(src, out or tmp / f"q-{scheme}", get_scheme(scheme),
                               default_ignore(ModelSource(src)))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_scheme_round_trip_and_config(name):
    scheme = SCHEMES[name]
    w = torch.randn(256, 256) * 0.02
    state = quantize_weight(w, scheme)
    back = dequantize_weight(state, scheme)
    assert back.shape == w.shape
    assert torch.nn.functional.cosine_similarity(back.flatten(), w.flatten(), dim=0) > 0.99
    assert scheme_of_config({"quantization_config": quantization_config(scheme, ["lm_head"])}) is scheme


def test_block_scheme_refuses_an_indivisible_layer_and_leaves_nothing(tmp_path):
    with pytest.raises(UserError, match=r"not divisible by the fp8-block block 128x128"):
        _quantize("fp8-block", tmp=tmp_path)
    assert not (tmp_path / "q-fp8-block").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q-")]  # no temp left


@pytest.mark.parametrize("scheme", ["fp8", "w8a16"])
def test_native_schemes_load_in_transformers_and_generate(tmp_path, scheme, text_samples):
    """The checkpoint loads with AutoModelForCausalLM, generates, keeps the ignore list,
    and moeflow's layer-by-layer engine reproduces transformers' own logits of it."""
    from transformers import AutoModelForCausalLM

    from moeflow.quant import metrics as M
    from moeflow.quant.compare import compare_checkpoints

    rec = _quantize(scheme, tmp=tmp_path)
    out = tmp_path / f"q-{scheme}"
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and "lm_head" in cfg["ignore"]
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.weight_scale" in names
    assert "model.layers.0.mlp.experts.0.down_proj.weight_scale" in names
    for kept in ("lm_head.weight_scale", "model.embed_tokens.weight_scale",
                 "model.layers.0.mlp.gate.weight_scale"):
        assert kept not in names
    assert rec["native_load"] and rec["quantized_modules"] > 0

    base = AutoModelForCausalLM.from_pretrained(str(tiny("qwen3_moe")), dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = text_samples[0]["input_ids"]
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
    stats = M.empty()
    with torch.no_grad():
        for s in text_samples:
            M.accumulate(stats, base(**s).logits, model(**s).logits)
    native = M.finish(stats)
    engine = compare_checkpoints(tiny("qwen3_moe"), out, text_samples)
    assert native["cosine"] > 0.99
    assert engine["final"]["logits_cosine"] == pytest.approx(native["cosine"], abs=1e-6)
    logits = next(r for r in engine["layers"] if r["kind"] == "logits")
    assert logits["propagated"]["max_abs"] == pytest.approx(native["max_abs"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("scheme", ["fp8-block", "int8"])
def test_moeflow_runs_the_schemes_transformers_cannot_load(tmp_path, scheme):
    """fp8-block and int8 are written in compressed-tensors format and run by moeflow's
    own dequantising reader (a 128-divisible model for the block scheme)."""
    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.compare import compare_checkpoints
    from moeflow.quant.golden import golden_samples

    src = tiny("qwen3_moe", hidden_size=128, head_dim=32, num_key_value_heads=4,
               moe_intermediate_size=128)
    rec = _quantize(scheme, src=src, tmp=tmp_path)
    assert rec["native_load"] is False
    samples = golden_samples(load_suite(None), src, limit=6)
    result = compare_checkpoints(src, tmp_path / f"q-{scheme}", samples)
    assert result["final"]["logits_cosine"] > 0.99
    attn = next(r for r in result["layers"] if r["kind"] == "attention")
    assert 0.99 < attn["cosine"] < 1.0  # really quantised, and close


def test_damaged_text_layer_is_named_first_divergent(tmp_path, text_samples):
    from moeflow.quant.compare import compare_checkpoints

    bad = edited(tiny("qwen3_moe"), tmp_path / "bad", "model.layers.1.self_attn.o_proj.weight",
                 noisy())
    result = compare_checkpoints(tiny("qwen3_moe"), bad, text_samples)
    assert result["first_divergent"] == "model.layers.1.self_attn"
    rows = {r["name"]: r for r in result["layers"]}
    assert rows["model.layers.0.self_attn"]["status"] == "pass"
    assert rows["model.layers.0.mlp"]["cosine"] == 1.0
    assert rows["model.layers.1.self_attn"]["status"] == "error"
    # isolated: the next layer, fed the baseline's input, is clean; propagated: it is not
    assert rows["model.layers.1.mlp"]["router_topk_overlap"] == 1.0
    assert rows["logits"]["propagated"]["cosine"] < 0.999


def test_damaged_vl_layer_is_named_with_images_in_the_golden_set(tmp_path):
    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.compare import compare_checkpoints
    from moeflow.quant.golden import golden_samples

    src = tiny("qwen3_vl_moe")
    samples = golden_samples(load_suite(None), src, limit=12)
    assert any("pixel_values" in s for s in samples)
    bad = edited(src, tmp_path / "bad", "model.language_model.layers.1.self_attn.o_proj.weight",
                 noisy())
    result = compare_checkpoints(src, bad, samples)
    assert result["first_divergent"] == "model.language_model.layers.1.self_attn"
    vision = [r for r in result["layers"] if r["kind"] == "vision"]
    assert vision and all(r["status"] == "pass" for r in vision)
    first = [r["name"] for r in result["layers"]].index(result["first_divergent"])
    assert all(r["status"] != "error" for r in result["layers"][:first])


def _cli(tmp_path, *args):
    return subprocess.run([str(BIN / "moeflow"), *args], capture_output=True, text=True,
                          env=cli_env(tmp_path, OMP_NUM_THREADS="1"), timeout=300)


def test_compare_cli_names_the_layer_and_refuses_bad_input(tmp_path):
    bad = edited(tiny("qwen3_moe"), tmp_path / "bad", "model.layers.0.mlp.experts.3.down_proj.weight",
                 noisy(20.0))
    res = _cli(tmp_path, "compare", str(tiny("qwen3_moe")), str(bad), "--samples", "8", "--json")
    assert res.returncode == 1, res.stderr
    assert json.loads(res.stdout)["first_divergent"] == "model.layers.0.mlp"

    res = _cli(tmp_path, "compare", str(tiny("qwen3_moe")), str(tiny("mixtral")))
    assert res.returncode == 2 and "not the same architecture" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_compare_refuses_different_shapes_of_one_architecture():
    from moeflow.quant.compare import check_same_architecture

    with pytest.raises(UserError, match=r"hidden_size is 64 in .* but 128 in"):
        check_same_architecture(tiny("qwen3_moe"), tiny("qwen3_moe", hidden_size=128, head_dim=32,
                                                        num_key_value_heads=4,
                                                        moe_intermediate_size=128))


def test_golden_set_without_usable_samples_is_refused(tmp_path):
    """Only image records and a text model: nothing to compare -> one line naming the suite."""
    import shutil

    from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
    from moeflow.quant.golden import golden_samples

    shutil.copytree(GOLDEN_SUITE.parent / "golden", tmp_path / "golden")
    suite = tmp_path / "images.yaml"
    suite.write_text("name: images\ntasks:\n  - name: image_colors\n    type: multimodal\n"
                     "    file: golden/image_colors.jsonl\n")
    with pytest.raises(UserError, match=r"images.yaml: no samples"):
        golden_samples(load_suite(suite), tiny("qwen3_moe"))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "q"
    _quantize("fp8", out=out)
    return out


def test_shard_statistics_merge_exactly(text_samples, fp8_checkpoint):
    """Ray shards return sufficient statistics; merged they equal one pass over the whole set."""
    from moeflow.quant.compare import compare_stats, finish, merge_stats

    # the candidate differs everywhere: the model's own fp8 quantisation
    whole = finish(compare_stats(tiny("qwen3_moe"), fp8_checkpoint, text_samples))
    parts = [compare_stats(tiny("qwen3_moe"), fp8_checkpoint, text_samples[k::3]) for k in range(3)]
    merged = finish(merge_stats(parts))
    assert merged["first_divergent"] == whole["first_divergent"]
    for a, b in zip(whole["layers"], merged["layers"]):
        assert a["name"] == b["name"] and a["status"] == b["status"]
        assert a["cosine"] == pytest.approx(b["cosine"], abs=1e-12)
        assert a["max_abs"] == b["max_abs"] and a["router_topk_overlap"] == b["router_topk_overlap"]
    assert merged["final"] == pytest.approx(whole["final"])



def test_compare_runs_where_ray_put_the_task(text_samples, fp8_checkpoint, monkeypatch):
    """With no device given, the compare asks moeflow.core.devices (the GPU Ray granted, else CPU),
    and every layer and hidden state it runs is on that device."""
    import torch

    from moeflow.quant import compare

    asked, seen = [], set()
    monkeypatch.setattr(compare, "local_device", lambda *a: asked.append(1) or torch.device("cpu"))
    run_layer = compare._run_layer

    def spy(layer, parts, hidden, call, mlp_input=None):
        seen.add((next(layer.parameters()).device.type, hidden.device.type))
        return run_layer(layer, parts, hidden, call, mlp_input)
    monkeypatch.setattr(compare, "_run_layer", spy)
    compare.compare_stats(tiny("qwen3_moe"), fp8_checkpoint, text_samples[:2])
    assert asked and seen == {("cpu", "cpu")}


def test_an_image_text_checkpoint_without_its_processor_is_calibrated_on_text(tmp_path):
    """A release shipped without preprocessor_config.json (aria in the family matrix): the
    golden set leaves its image records out, as regress skips its image tasks, instead of
    failing calibrate."""
    import shutil

    from moeflow.evaluation.suite import load_suite
    from moeflow.quant.golden import golden_samples

    src = tmp_path / "vl"
    shutil.copytree(tiny("qwen3_vl_moe"), src)
    (src / "preprocessor_config.json").unlink()
    notes: list[str] = []
    samples = golden_samples(load_suite(None), src, limit=12, note=notes.append)
    assert samples and not any("pixel_values" in s for s in samples)
    assert len(notes) == 1 and "image records left out" in notes[0] and "preprocessor_config" in notes[0]


def test_linears_stored_in_another_layout_are_named_in_the_ignore_list(tmp_path):
    """Bailing-hybrid stores its attention in a layout transformers splits at load: the
    quantiser keeps those weights in source precision, and the config must say so, or
    compressed-tensors builds the modules quantised with random scales (NaN logits, seen
    in regress of the full family matrix)."""
    from moeflow.model.models import load_model

    src = tiny("bailing_hybrid")
    rec = _quantize("fp8", src=src, tmp=tmp_path)
    assert rec["kept_by_layout"] > 0
    ignore = json.loads((tmp_path / "q-fp8" / "config.json").read_text())["quantization_config"]["ignore"]
    assert any("attn" in n or "attention" in n for n in ignore)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 2, 4]])
    with torch.no_grad():
        base = load_model(src, torch.float32).eval()(input_ids=ids).logits
        quant = load_model(tmp_path / "q-fp8", torch.float32).eval()(input_ids=ids).logits
    assert torch.isfinite(quant).all()
    assert torch.nn.functional.cosine_similarity(base.flatten(), quant.flatten(), dim=0) > 0.99


def test_the_text_decoder_is_found_past_a_vision_encoder_that_is_a_decoder_too():
    """DeepSeek-OCR-2's vision encoder is a rotary decoder met first in the module tree: the
    layer-by-layer compare captured its layers, which a text prompt never runs (calibrate
    failed with an IndexError in the full family matrix)."""
    from moeflow.quant.source import ModelSource

    src = ModelSource(tiny("deepseek_ocr2"))
    assert src.layers_prefix == "model.language_model.layers"
