"""The shipped demo base (assets/demo-base): real HF layout, small, learned, reproducible."""

from __future__ import annotations

import json

import pytest

from moeflow.evaluation.probe import probe_model
from moeflow.evaluation.suite import GOLDEN_SUITE
from moeflow_testing.demo_base import ASSET, RECIPE, build, golden_prompts, heldout_docs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_shipped_base_is_a_sharded_hf_checkpoint_under_10_mb():
    index = json.loads((ASSET / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((ASSET / s).is_file() for s in shards)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "demo_base.json"):
        assert (ASSET / name).is_file(), name
    assert json.loads((ASSET / "config.json").read_text())["architectures"] == \
        ["Qwen3MoeForCausalLM"]
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 10 * 2**20


def test_shipped_base_has_learned_the_language_and_routes_unevenly():
    report = json.loads((ASSET / "demo_base.json").read_text())
    assert report["recipe"] == RECIPE  # the committed script made it
    probe = probe_model(ASSET, heldout_docs(), golden_prompts())
    assert probe["ppl_ratio"] == pytest.approx(report["ppl_ratio"], rel=1e-4)
    assert probe["ppl_ratio"] <= 0.5
    assert probe["max_load_skew"] >= 1.5


def test_golden_demo_text_is_the_held_out_language():
    lines = (GOLDEN_SUITE.parent / "golden" / "demo_text.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == heldout_docs()


@pytest.mark.slow
def test_build_is_deterministic(tmp_path):
    small = dict(steps=4, docs=300)
    build(tmp_path / "a", small, log=lambda *a, **k: None)
    build(tmp_path / "b", small, log=lambda *a, **k: None)
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards and all((tmp_path / "a" / s).read_bytes() == (tmp_path / "b" / s).read_bytes()
                          for s in shards)
