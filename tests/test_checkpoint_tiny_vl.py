"""VL debug models ship vision special tokens, config ids and an image processor."""

import json

import pytest
from transformers import AutoImageProcessor, AutoTokenizer

from moeflow_testing.tiny import FAMILIES, build_debug_model

CORPUS = ["reverse: a b c\nanswer: c b a"] * 8


@pytest.mark.parametrize("fam", ["qwen3_vl_moe", "ernie4_5_vl_moe"])
def test_vl_tokens_and_processor(tmp_path, fam):
    out = build_debug_model(fam, tmp_path / fam, corpus=CORPUS)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    for attr, token in FAMILIES[fam].vision_tokens.items():
        assert cfg[attr] == tok.convert_tokens_to_ids(token)
        assert tok.tokenize(f"ab{token}cd").count(token) == 1  # never split: special
    assert (out / "preprocessor_config.json").is_file()
    assert type(AutoImageProcessor.from_pretrained(out)).__name__.endswith("ImageProcessorPil")


def test_text_family_has_no_vision_tokens(tmp_path):
    out = build_debug_model("qwen3_moe", tmp_path / "t", corpus=CORPUS)
    tok = AutoTokenizer.from_pretrained(out)
    assert "<|image_pad|>" not in tok.get_vocab()
    assert not (out / "preprocessor_config.json").exists()
