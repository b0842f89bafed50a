"""The layer-streamed forward (moeflow.quant.streamed): the fully-loaded model's logits, one
decoder layer resident at a time."""

from __future__ import annotations

import pytest
import torch

from moeflow.checkpoint.convert import convert_checkpoint
from moeflow.model.models import load_model
from moeflow.quant.streamed import StreamedModel
from tests.quant_assets import tiny

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["the quick brown fox jumps over the lazy dog", "experts are chosen per token",
         "hello"]


def _batches(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.pad_token = tok.pad_token or tok.eos_token
    return [tok(TEXTS[:2], return_tensors="pt", padding=True), tok(TEXTS[2:], return_tensors="pt")]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_streamed_logits_equal_the_loaded_model(tmp_path, family):
    """Converted checkpoint (one file per layer), padded and unpadded batches: the streamed
    logits equal from_pretrained's at every real position."""
    conv = tmp_path / "conv"
    convert_checkpoint(tiny(family), conv, dtype="keep")
    batches = _batches(conv)
    full = load_model(conv, torch.float32).eval()
    streamed = StreamedModel(conv, torch.float32, "cpu")
    built = []
    got = streamed.logits(batches, on_layer=lambda i, layer: built.append(i) or [])
    assert built == list(range(streamed.num_layers))  # each layer read once for both batches
    for batch, logits in zip(batches, got):
        with torch.no_grad():
            want = full(**batch).logits  # [B, T, V]
        real = batch["attention_mask"].bool()  # [B, T]
        assert logits.shape == want.shape
        torch.testing.assert_close(logits[real], want[real], rtol=1e-4, atol=1e-4)


def test_streamed_holds_one_layer(tmp_path):
    """No more than one decoder layer is materialised at a time: each is released
    (garbage) before the next is read."""
    import weakref

    conv = tmp_path / "conv"
    convert_checkpoint(tiny("qwen3_moe"), conv, dtype="keep")
    streamed = StreamedModel(conv, torch.float32, "cpu")
    alive: list = []

    def watch(i, layer):
        assert not [r for r in alive if r() is not None], f"layer {i} built while another is alive"
        alive.append(weakref.ref(layer))
        return []
    streamed.logits(_batches(conv)[:1], on_layer=watch)
    assert len(alive) == streamed.num_layers


def small_device_spec(path, gb: float):
    """A hardware spec whose device holds `gb` GB (cpu-local's figures otherwise)."""
    import yaml

    from moeflow.core.hardware import HARDWARE_DIR

    raw = yaml.safe_load((HARDWARE_DIR / "cpu-local.yaml").read_text())
    path.write_text(yaml.safe_dump(dict(raw, name="cpu-small", memory_per_device_gb=gb)))
    return path


def test_operators_profile_streams_when_the_model_exceeds_a_device(tmp_path):
    """The stage's load profile: streamed on a device smaller than the model (auto), loaded
    whole on cpu-local; the counts and tokens are the same."""
    import json

    from moeflow.core.config import validate
    from tasks.base import StageContext
    from tasks.operators import profile_load
    from tests.operators_assets import TEXTS, skewed_checkpoint

    conv = skewed_checkpoint("qwen3_moe", tmp_path / "ckpt")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS * 3))
    loads = {}
    for hw in ("cpu-local", str(small_device_spec(tmp_path / "small.yaml", 1e-4))):
        raw = {"model": {"path": str(conv), "dtype": "float32"}, "hardware": hw,
               "operators": {"calibration_file": str(calib)}}
        out = tmp_path / f"out-{len(loads)}"
        out.mkdir()
        ctx = StageContext(stage="operators", config=validate(raw), inputs={}, out_dir=out)
        loads[hw == "cpu-local"] = profile_load(ctx, str(conv))[0]
    streamed, whole = loads[False], loads[True]
    assert streamed["streamed"] and not whole["streamed"]
    assert streamed["counts"] == whole["counts"] and streamed["tokens"] == whole["tokens"]
    assert streamed["hot_experts"] == whole["hot_experts"]


def test_peak_memory_counts_what_the_work_held_above_its_start():
    """The meter sees a 64 MB tensor held and released inside the block, and not one held
    and released before it (a reused process's earlier peak is not this work's)."""
    from moeflow.core.memmeter import PeakMemory

    before = torch.ones(16 * 2**20)  # 64 MB, released before the start
    del before
    meter = PeakMemory().start()
    if meter.peak() is None:
        pytest.skip("no resident-set high-water mark to reset here (not Linux)")
    assert meter.peak() < 16 * 2**20
    held = torch.ones(16 * 2**20)
    del held
    assert 60 * 2**20 <= meter.peak() < 96 * 2**20  # 64 MB, less pages freed since the start
    assert "VmHWM" in meter.record()["measure"]
