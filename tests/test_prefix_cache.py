"""Prefix caching (moeflow/serving/block_pool.py, EngineConfig.enable_prefix_caching): prompts
that share a prefix of full blocks prefill only the rest, and the greedy tokens equal those of
an engine without the cache; an adapter's prompts never reuse the base's blocks; a model whose
cache has sliding-window layers keeps prefilling every prompt."""

from __future__ import annotations

import random

import pytest
import torch

from moeflow.serving.adapters import AdapterRegistry, make_spec
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.metrics import ServingMetrics
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("prefix")
    base = build_debug_model("qwen3_moe", root / "base")
    return {"base": base, "tok": AutoTokenizer.from_pretrained(str(base)),
            "a1": make_lora_adapter(base, root / "adapters" / "a1", seed=1)}


def _engine(world, **cfg) -> Engine:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(world["base"]), dtype=torch.float32)
    reg = AdapterRegistry()
    reg.add(make_spec("a1", world["a1"]))
    return Engine(model, world["tok"], EngineConfig(**cfg), reg, ServingMetrics())


def _prompts(n: int, prefix: int, suffix: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(3, vocab) for _ in range(suffix)] for _ in range(n)]


def _serve(engine: Engine, prompts: list[list[int]], adapters: list[str | None]) -> tuple[list, list[int]]:
    """One request at a time (each may reuse the ones before); its tokens and the prompt tokens
    its forwards computed."""
    computed: list[int] = []
    run = engine.core.runner.run
    engine.core.runner.run = lambda *a, **k: (computed.append(k["input_ids"].shape[1])
                                              if k["input_ids"].shape[1] > 1 else None, run(*a, **k))[1]
    outs = []
    for i, (ids, adapter) in enumerate(zip(prompts, adapters)):
        out: list[int] = []
        engine.submit(f"r{i}", ids, SamplingParams(max_tokens=8, ignore_eos=True),
                      lambda d, out=out: out.extend(d.token_ids), adapter=adapter)
        engine.run_until_idle()
        outs.append(out)
    return outs, computed


def test_a_shared_prefix_is_prefilled_once_and_tokens_equal_the_uncached_engine(tiny):
    vocab = tiny["tok"].vocab_size
    prompts = _prompts(4, prefix=40, suffix=5, vocab=vocab)  # 45 tokens: 2 full blocks of 16 shared
    adapters = [None, None, None, "a1"]
    ref, full = _serve(_engine(tiny), prompts, adapters)
    engine = _engine(tiny, enable_prefix_caching=True, block_size=16)
    got, computed = _serve(engine, prompts, adapters)
    assert got == ref
    assert full == [45] * 4
    # the base's prompts after the first start from its 2 blocks; the adapter's cannot (LoRA
    # changes the keys and values): its blocks are its own
    assert computed == [45, 13, 13, 45]
    assert engine.core.kv.pool.hit_tokens == 64
    again, computed = _serve(engine, [prompts[3]], ["a1"])
    assert again == [ref[3]] and computed == [13]
    text = engine.metrics.render().decode()
    assert "moeflow_prefix_cache_hits_total 96.0" in text  # 3 hits of 32 tokens
    assert "moeflow_prefix_cache_queries_total 225.0" in text  # 5 prompts of 45 tokens


def test_a_sliding_window_model_prefills_every_prompt(tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_debug_model("gpt_oss", tmp_path / "gpt_oss")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    prompts = _prompts(2, prefix=40, suffix=5, vocab=model.config.vocab_size)
    with caplog.at_level("INFO", logger="moeflow.serving"):
        engine = Engine(model, AutoTokenizer.from_pretrained(str(base)), EngineConfig(enable_prefix_caching=True))
        _, computed = _serve(engine, prompts, [None, None])
    assert computed == [45, 45] and engine.core.kv is None
    assert any("not paged" in r.getMessage() and "prefix caching off" in r.getMessage() for r in caplog.records)
