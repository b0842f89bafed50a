"""Runners on tiny real checkpoints: in-process, Ray-sharded, PEFT adapters, images.

The tiny base model and its adapters come from tests/eval_assets.py (built once
per process); the regress tests reuse them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.evaluation.record import flat_metrics
from moeflow.evaluation.runners import HFRunner, evaluate
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
from tests.eval_assets import assets

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def golden_base():
    a = assets()
    return evaluate(load_suite(), a["base"], [None, a["good"]])


def test_golden_suite_on_text_model_is_deterministic(golden_base):
    base, good = golden_base
    metrics = flat_metrics(base)
    for key in ("eval/reverse_nll/bits_per_byte", "eval/reverse_em/exact_match",
                "eval/reverse_format/regex_match", "eval/next_letter/acc",
                "eval/plain_text/bits_per_byte", "eval/next_letter/acc_stderr"):
        assert key in metrics
    assert not any(k.startswith("eval/image_colors") for k in metrics)
    assert "needs images" in base["tasks"]["image_colors"]["skipped"]
    assert "text-only" in base["tasks"]["image_colors"]["skipped"]
    assert base["tasks"]["reverse_nll"]["dataset"]["sha256"] == load_suite().task("reverse_nll").sha256
    # same inputs -> identical metrics and per-sample outputs (fresh model load)
    again = evaluate(load_suite(), assets()["base"], [None, assets()["good"]])
    assert again[0]["tasks"] == base["tasks"] and again[1]["tasks"] == good["tasks"]
    # the adapter trained on the demo task lowers its bits per byte
    assert (flat_metrics(good)["eval/reverse_nll/bits_per_byte"]
            < metrics["eval/reverse_nll/bits_per_byte"] - 0.1)


def test_loglikelihood_matches_a_single_unpadded_forward():
    runner = HFRunner(assets()["base"], batch_size=4)
    pairs = [("reverse: abc\nanswer:", " cba"), ("hello", " world, how are you"), ("", "plain text")]
    got = runner.loglikelihood(pairs)
    tok = runner.tokenizer
    for (ctx, cont), (ll, n) in zip(pairs, got):
        c_ids = tok(ctx).input_ids if ctx else [tok.eos_token_id]
        x_ids = tok(cont).input_ids
        ids = torch.tensor([c_ids + x_ids])  # [1, T]
        with torch.no_grad():
            logp = torch.log_softmax(runner.model(input_ids=ids).logits[0], -1)  # [T, V]
        want = sum(float(logp[len(c_ids) - 1 + i, t]) for i, t in enumerate(x_ids))
        assert n == len(x_ids) and ll == pytest.approx(want, abs=1e-4)


def test_adapters_change_the_model(golden_base):
    a = assets()
    rand = evaluate(load_suite(), a["base"], [a["random"]])[0]
    base = flat_metrics(golden_base[0])
    assert flat_metrics(rand)["eval/plain_text/bits_per_byte"] > base["eval/plain_text/bits_per_byte"] + 0.3
    with pytest.raises(UserError, match="not a PEFT adapter dir"):
        evaluate(load_suite(), a["base"], [a["root"]])


def test_base_entry_after_an_adapter_is_the_base(tmp_path):
    """`None` after an adapter was evaluated with that adapter still active."""
    golden = GOLDEN_SUITE.parent / "golden"
    (tmp_path / "s.yaml").write_text(
        "name: small\ntasks:\n"
        f"  - {{name: text, type: perplexity, file: {golden}/plain_text.jsonl, limit: 4}}\n")
    suite, a = load_suite(tmp_path / "s.yaml"), assets()
    alone, = evaluate(suite, a["base"], [None])
    rand, after = evaluate(suite, a["base"], [a["random"], None])
    assert after["tasks"] == alone["tasks"] and after["adapter"] is None
    assert rand["tasks"]["text"]["metrics"] != alone["tasks"]["text"]["metrics"]


def test_required_multimodal_task_on_text_model_is_an_error(tmp_path):
    text = (GOLDEN_SUITE.read_text().replace("type: multimodal", "type: multimodal\n    required: true")
            .replace("file: golden/", f"file: {GOLDEN_SUITE.parent}/golden/"))
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(UserError, match="task image_colors is required but .* text-only"):
        evaluate(load_suite(tmp_path / "s.yaml"), assets()["base"])


def test_ray_shards_give_the_in_process_metrics(ray_local, golden_base):
    a = assets()
    sharded = evaluate(load_suite(), a["base"], [None, a["good"]], shards=2)
    for local, remote in zip(golden_base, sharded):
        assert remote["settings"]["shards"] == 2
        lm, rm = flat_metrics(local), flat_metrics(remote)
        assert lm.keys() == rm.keys()
        for key in lm:  # batches differ between shardings: equal up to float rounding
            assert rm[key] == pytest.approx(lm[key], rel=1e-5, abs=1e-6), key
        assert ([s["output"] for s in remote["tasks"]["reverse_em"]["samples"]]
                == [s["output"] for s in local["tasks"]["reverse_em"]["samples"]])
    again = evaluate(load_suite(), a["base"], [None, a["good"]], shards=2)
    assert [r["tasks"] for r in again] == [r["tasks"] for r in sharded]


# ---------------------------------------------------------------- multimodal

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_vl_model(out: Path, monkeypatch) -> Path:
    """Tiny Qwen3-VL-MoE with vision special tokens and a (PIL) image processor.

    The debug tokenizer has no vision tokens and tiny.py writes no
    preprocessor_config.json yet, so add both here, as a real Qwen3-VL
    checkpoint ships them.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import moeflow_testing.tiny as tiny

    extra = [t for t in VISION_TOKENS if t not in tiny.SPECIAL_TOKENS]
    monkeypatch.setattr(tiny, "SPECIAL_TOKENS", tiny.SPECIAL_TOKENS + extra)
    # the BPE trainer gives special tokens the first ids, in list order
    ids = {t: tiny.SPECIAL_TOKENS.index(t) for t in VISION_TOKENS}
    model = tiny.build_debug_model(
        "qwen3_vl_moe", out, dtype="float32", image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    assert [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS] == list(ids.values())
    Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                             min_pixels=16 * 16, max_pixels=64 * 64).save_pretrained(model)
    return model


def test_multimodal_task_on_qwen3_vl_moe(tmp_path, monkeypatch):
    if "qwen3_vl_moe" not in __import__("moeflow_testing.tiny", fromlist=["FAMILIES"]).FAMILIES:
        pytest.skip("moeflow_testing.tiny has no qwen3_vl_moe debug model")
    model = build_vl_model(tmp_path / "vl", monkeypatch)
    golden = GOLDEN_SUITE.parent / "golden"
    (tmp_path / "s.yaml").write_text(
        "name: mm\ntasks:\n"
        f"  - {{name: image_colors, type: multimodal, file: {golden}/image_colors.jsonl, limit: 4}}\n"
        f"  - {{name: text, type: perplexity, file: {golden}/plain_text.jsonl, limit: 4}}\n")
    suite = load_suite(tmp_path / "s.yaml")
    first, second = evaluate(suite, model)[0], evaluate(suite, model)[0]
    assert first["tasks"] == second["tasks"]
    task = first["tasks"]["image_colors"]
    assert task["n"] == 4 and 0.0 <= task["metrics"]["acc"]["value"] <= 1.0
    lls = task["samples"][0]["logliks"]
    assert len(lls) == 4 and all(ll < 0 for ll in lls) and len(set(lls)) == 4
    # the image matters: another image gives other choice scores
    runner = HFRunner(model)
    rec = dict(suite.task("image_colors").records[0])
    blue = dict(rec, image_path=str(golden / "images" / "blue_circle.png"))
    assert runner.image_choice_logliks(rec) != runner.image_choice_logliks(blue)
    assert "metrics" in first["tasks"]["text"]


def test_processor_prompt_is_the_qwen_vl_rule(tmp_path, monkeypatch):
    """The processor-built image prompt (moeflow.model.multimodal.load_processor) is
    exactly what the hand-written Qwen-VL rule built before: vision_start, grid.prod() /
    merge**2 image pads, vision_end, the question; image tokens typed 1. So Qwen3-VL
    scores are unchanged."""
    from PIL import Image

    model = build_vl_model(tmp_path / "vl", monkeypatch)
    runner = HFRunner(model)
    cfg = runner.model.config
    golden = GOLDEN_SUITE.parent / "golden"
    with Image.open(golden / "images" / "blue_circle.png") as img:
        image = img.convert("RGB")
    prompt = runner._image_prompt(image, "what color is it?")
    merge = runner.processor.image_processor.merge_size
    n_img = int(prompt["image_grid_thw"][0].prod()) // merge ** 2
    q_ids = runner.tokenizer("what color is it?", add_special_tokens=False).input_ids
    want = ([cfg.vision_start_token_id] + [cfg.image_token_id] * n_img
            + [cfg.vision_end_token_id] + q_ids)
    assert prompt["input_ids"][0].tolist() == want
    assert prompt["mm_token_type_ids"][0].tolist() == [0] + [1] * n_img + [0] * (1 + len(q_ids))
    pixels = runner.processor.image_processor(images=[image], return_tensors="pt")
    assert torch.equal(prompt["pixel_values"], pixels["pixel_values"])
