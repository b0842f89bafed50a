"""Compiled forwards (EngineConfig.compile, deploy.compile): the same tokens as `generate`,
every graph compiled by the warm-up (none while serving: decode steps, prompts alone and
together, prompts joining decodes), expert load still counted without the pads, and a compiled
forward that fails leaves the engine running eagerly."""

from __future__ import annotations

import logging

import pytest
import torch

from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.metrics import ExpertLoad
from moeflow_testing.serving import MIXED_PROMPTS, IdTokenizer
from moeflow_testing.tiny_auto import tiny_model

NEW = 6


def _refs(model, prompts):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _serve_staggered(engine, prompts):
    """One prompt, then a third of the rest while it decodes (they join its forward), then the
    others once those decode."""
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    errors: list[str] = []

    def submit(i):
        def sink(d, i=i):
            got[i].extend(d.token_ids)
            if d.error:
                errors.append(d.error)
        engine.submit(str(i), prompts[i], SamplingParams(max_tokens=NEW, ignore_eos=True), sink)
    third = 1 + (len(prompts) - 1) // 3
    submit(0)
    engine.run_until_idle(max_steps=1)
    for i in range(1, third):
        submit(i)
    engine.run_until_idle(max_steps=2)
    for i in range(third, len(prompts)):
        submit(i)
    engine.run_until_idle()
    assert not errors, errors
    return [got[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3_moe").eval().float()


@pytest.mark.slow  # compiling takes ~10-20 s on 2 cores
@pytest.mark.ci
def test_compiled_forwards_equal_generate_and_compile_only_at_warm_up(model):
    from torch._dynamo.utils import counters

    prompts = [[5, 6, 7, 8, 9]] + [[(5 * i + j) % 40 + 3 for j in range(6)] for i in range(6)] + MIXED_PROMPTS
    refs = _refs(model, prompts)
    experts = ExpertLoad(model, window_steps=1000)
    engine = Engine(model, IdTokenizer(), EngineConfig(compile=True), experts=experts)
    torch._dynamo.reset()
    engine.warm_up()
    assert engine.core.runner.compiled is not None and engine.core.runner.mixes is True  # the warm-up mixed
    assert int(experts.total.sum()) == 0  # the warm-up is not traffic
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2  # rows alone and rows together at least
    mixed: list[tuple[int, int]] = []
    mix = engine.core.runner.mixed
    engine.core.runner.mixed = lambda kv, fresh: (mixed.append((len(kv), len(fresh))), mix(kv, fresh))[1]
    assert _serve_staggered(engine, prompts) == refs
    assert mixed == [(1, 3)]  # the second wave (three 6-token prompts) joined the first prompt's decode
    assert counters["stats"]["unique_graphs"] == graphs  # no compile while serving
    assert engine.core.runner.compiled is not None
    # every real token was routed and counted once per MoE layer: prompts, then the decode
    # tokens (the last sampled token of each is never forwarded)
    tokens = sum(len(p) + NEW - 1 for p in prompts)
    top_k = model.config.num_experts_per_tok
    assert (experts.total.sum(dim=1) == tokens * top_k).all()


def test_a_failing_compiled_forward_leaves_the_engine_running_eagerly(model, caplog):
    refs = _refs(model, MIXED_PROMPTS)
    # the padded batches: compiled forwards run there (deploy.compile keeps a model off the paged cache)
    engine = Engine(model, IdTokenizer(), EngineConfig(paged_kv=False))
    calls: list[int] = []

    def broken(**inputs):  # as a compiler that cannot build its kernel raises, at the first call
        calls.append(inputs["input_ids"].shape[0])
        raise RuntimeError("no C++ compiler\nmore detail")
    engine.core.runner.compiled = broken
    with caplog.at_level(logging.WARNING, logger="moeflow.serving"):
        assert _serve_staggered(engine, MIXED_PROMPTS) == refs
    assert len(calls) == 1 and engine.core.runner.compiled is None
    assert any("compiled forward failed (RuntimeError: no C++ compiler)" in r.message for r in caplog.records)


def test_without_compile_the_warm_up_does_nothing(model):
    engine = Engine(model, IdTokenizer(), EngineConfig())
    engine.warm_up()
    assert engine.core.steps == 0 and engine.core.runner.compiled is None
