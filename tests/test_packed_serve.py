"""Serving a quantised base kept as stored (`convert.dtype: keep`): the local engine loads it
through moeflow.model.models.load_model, routed experts packed, and its greedy completions, base
and adapter, equal transformers' `generate` over the bf16-dequantised base in float32."""

from __future__ import annotations

import openai
import pytest
import torch

from moeflow.serving.app import ServeSettings, free_port, start
from moeflow_testing.serving import make_lora_adapter

PROMPTS = ["hello world", "the quick brown"]
NEW = 6


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    from moeflow.checkpoint.convert import convert_checkpoint
    from moeflow_testing.releases import ct_release
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("packed-serve")
    release = ct_release(build_debug_model("qwen3_moe", root / "qwen"), root / "int4", "int4-group")
    convert_checkpoint(release, root / "kept", dtype="keep", workers=1)
    convert_checkpoint(release, root / "plain", dtype="fp32", workers=1)  # the dequantised base
    adapter = make_lora_adapter(root / "plain", root / "adapters" / "a1", seed=1)
    return {"kept": root / "kept", "plain": root / "plain", "adapter": adapter}


def _reference(base, adapter_dir) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter_dir:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p).input_ids
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        out[p] = tok.decode(gen[0, len(ids):], skip_special_tokens=True)
    return out


def test_engine_serves_the_packed_base_and_its_adapter(ray_local, kept):
    from ray import serve

    refs = {"kept": _reference(kept["plain"], None), "a1": _reference(kept["plain"], kept["adapter"])}
    settings = ServeSettings(base_dir=str(kept["kept"]), adapters={"a1": str(kept["adapter"])},
                             dtype="float32", engine={"max_num_batched_tokens": 32})
    url = start(settings, port=free_port())
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for model in ("kept", "a1"):
            for p in PROMPTS:
                r = client.completions.create(model=model, prompt=p, max_tokens=NEW, temperature=0)
                assert r.choices[0].text == refs[model][p], (model, p)
        assert refs["kept"] != refs["a1"]  # the adapter changes the completions it is checked on
    finally:
        serve.shutdown()
