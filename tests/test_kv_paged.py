"""The paged KV cache (issue 51; no Ray): the block pool's reference counts and prefix caching,
packed forwards equal `generate`, admission from free blocks and preemption when the pool runs
dry, rows joining and leaving without touching other rows' keys and values, the KV usage metric."""

from __future__ import annotations

import pytest
import torch

from moeflow.serving.block_pool import BlockPool, NoFreeBlocks
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow_testing.serving import MIXED_PROMPTS, IdTokenizer
from moeflow_testing.tiny_auto import tiny_model


def _refs(model, prompts, new):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _serve(engine, prompts, new, **params):
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    errors: list[str] = []

    def sink(d, i):
        got[i].extend(d.token_ids)
        if d.error:
            errors.append(d.error)
    for i, p in enumerate(prompts):
        engine.submit(str(i), p, SamplingParams(max_tokens=new, ignore_eos=True, **params),
                      lambda d, i=i: sink(d, i))
    engine.run_until_idle()
    assert not errors, errors
    return [got[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3_moe").eval().float()


def test_the_pool_counts_references_and_reuses_named_blocks_least_recently_freed_last():
    pool = BlockPool(num_blocks=6, block_size=2, prefix_caching=True)
    a, b = object(), object()
    tokens = [1, 2, 3, 4, 5]
    assert pool.admit(id(a), tokens, None, pool.hits(tokens, None)) == 0
    pool.grow(id(a), 5)  # 3 blocks
    assert pool.used == 3 and pool.num_free == 3
    pool.name_full(id(a), tokens, 5, None)  # blocks [1, 2] and [3, 4] named
    hit = pool.hits(tokens, None)
    assert hit == pool.table(id(a))[:2]
    assert pool.hits(tokens, "lora") == []  # an adapter's keys and values are its own
    assert pool.hits([1, 2, 3, 9, 5], None) == hit[:1]  # a chain: the second block differs
    assert pool.admit(id(b), tokens, None, hit) == 4  # shares the two named blocks
    assert pool.refs[hit[0]] == 2 and pool.used == 3
    pool.release(id(a))
    assert pool.refs[hit[0]] == 1 and pool.used == 2  # a's unnamed tail block is free again
    pool.release(id(b))
    assert pool.used == 0 and len(pool.cached) == 2  # named and free: still found by name
    assert pool.hits(tokens, None) == hit
    # a sequence that needs every block takes the unnamed ones first, then the least recently
    # freed named ones, which lose their names
    c = object()
    pool.admit(id(c), [7] * 12, None, [])
    pool.grow(id(c), 10)  # 5 blocks: 4 unnamed + the least recently freed named one
    assert pool.hits(tokens, None) == hit[:1]  # the chain's tail went first (freed first)
    with pytest.raises(NoFreeBlocks):
        pool.grow(id(c), 13)  # 7 blocks of 6
    assert len(pool.table(id(c))) == 5  # all or nothing


def test_a_hash_collision_is_a_miss_never_a_wrong_cache():
    pool = BlockPool(num_blocks=4, block_size=2, prefix_caching=True)
    a = object()
    pool.admit(id(a), [1, 2, 3], None, [])
    pool.grow(id(a), 3)
    pool.name_full(id(a), [1, 2, 3], 3, None)
    block = pool.table(id(a))[0]
    pool.by_hash[hash((None, None, (8, 9)))] = block  # another prompt's name points at this block
    assert pool.hits([8, 9, 1], None) == []  # its tokens are checked: a miss


def test_packed_forwards_equal_generate_chunked_or_whole(model):
    refs = _refs(model, MIXED_PROMPTS, 6)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA: heads grouped
    for cfg in ({}, {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4}, {"block_size": 3}):
        engine = Engine(model, IdTokenizer(), EngineConfig(**cfg))
        assert engine.core.kv is not None
        _serve(engine, [[3, 4]], 1)  # the pool's tensors are made at the first write
        cache = engine.core.kv.cache
        for t in cache.keys + cache.values:  # slots never written may hold anything: masked, never read
            t[:cache.pad].fill_(float("nan"))
        assert _serve(engine, MIXED_PROMPTS, 6) == refs, cfg
        assert engine.core.kv.pool.used == 0  # every block back in the pool


def test_a_dry_pool_waits_admissions_and_preempts_and_the_tokens_still_equal_generate(model):
    prompts = [[(5 * i + j) % 90 + 3 for j in range(8)] for i in range(3)]
    refs = _refs(model, prompts, 12)
    # 7 blocks of 4 tokens: the three 8-token prompts are admitted (2 blocks each), but 20 tokens
    # each need 5 blocks: the last admitted is preempted and computes its tokens again later
    engine = Engine(model, IdTokenizer(), EngineConfig(num_kv_blocks=7, block_size=4))
    assert _serve(engine, prompts, 12) == refs
    assert engine.core.preemptions > 0 and engine.core.kv.pool.used == 0
    # a prompt the whole pool cannot hold fails at once, alone
    engine = Engine(model, IdTokenizer(), EngineConfig(num_kv_blocks=2, block_size=4))
    out: list = []
    engine.submit("long", list(range(3, 12)), SamplingParams(max_tokens=2), out.append)
    engine.run_until_idle()
    assert out[-1].finish_reason == "error" and "cannot hold" in out[-1].error


def test_rows_joining_and_leaving_leave_the_other_rows_keys_where_they_are(model):
    engine = Engine(model, IdTokenizer(), EngineConfig())
    core = engine.core
    engine.submit("stay", MIXED_PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True), lambda d: None)
    engine.submit("go", MIXED_PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True), lambda d: None)
    for _ in range(2):
        engine.run_until_idle(max_steps=1)
    stay = next(s for s in core.running if s.req_id == "stay")
    table = list(core.kv.pool.table(id(stay)))
    slots = core.kv.slots(stay, stay.num_cached)
    keys = core.kv.cache.keys[0][slots].clone()  # [N, H, D]
    shapes: list[tuple[int, ...]] = []
    run = core.runner.run
    core.runner.run = lambda *a, **k: (shapes.append(tuple(k["input_ids"].shape)), run(*a, **k))[1]
    engine.submit("join", MIXED_PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True), lambda d: None)
    engine.run_until_idle(max_steps=1)  # "go" finished, "join" prefilled beside "stay"'s decode
    assert shapes == [(1, 1 + len(MIXED_PROMPTS[1]))]  # one packed forward, no pads
    assert core.kv.pool.table(id(stay))[:len(table)] == table
    assert torch.equal(core.kv.cache.keys[0][slots], keys)  # nothing moved
    engine.run_until_idle()


def test_kv_usage_is_blocks_used_over_blocks(model):
    from moeflow.serving.metrics import ServingMetrics

    engine = Engine(model, IdTokenizer(), EngineConfig(num_kv_blocks=10, block_size=4), None, ServingMetrics())
    seen: list[float] = []
    emit = engine.core.emit
    engine.core.emit = lambda step: (seen.append(step.stats.kv_usage) if step.stats else None, emit(step))
    engine.submit("a", list(range(3, 12)), SamplingParams(max_tokens=3, ignore_eos=True), lambda d: None)
    engine.run_until_idle()
    # 9 prompt tokens: 3 blocks; 11 tokens cached by the last step: still 3; then all free
    assert 0.3 in seen and seen[-1] == 0.0
    assert "moeflow_kv_cache_usage_perc 0.0" in engine.metrics.render().decode()


def test_prompt_logprobs_equal_the_padded_path(model):
    prompts = MIXED_PROMPTS[:2]
    got = {}
    for paged in (True, False):
        engine = Engine(model, IdTokenizer(), EngineConfig(paged_kv=paged, max_num_batched_tokens=4))
        out: list = []
        engine.submit("p", prompts[0], SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True), out.append)
        engine.run_until_idle()
        got[paged] = next(d.prompt_logprobs for d in out if d.prompt_logprobs)
    assert [t for t, _, _ in got[True]] == [t for t, _, _ in got[False]]
    for (_, a, _), (_, b, _) in zip(got[True][1:], got[False][1:]):
        assert abs(a - b) < 1e-4


def test_a_model_whose_packed_forward_differs_keeps_the_padded_batches(model, caplog):
    forward = model.forward

    def position_bias(*args, **kwargs):  # answers differently whenever the rows are packed
        out = forward(*args, **kwargs)
        if "moeflow_cache" in kwargs:
            out.logits = out.logits + 1e-2 * torch.randn_like(out.logits)
        return out
    model.forward = position_bias
    try:
        with caplog.at_level("INFO", logger="moeflow.serving"):
            engine = Engine(model, IdTokenizer(), EngineConfig())
        assert engine.core.kv is None
        assert any("not paged" in r.getMessage() for r in caplog.records)
        assert _serve(engine, MIXED_PROMPTS[:2], 4) == _refs(model, MIXED_PROMPTS[:2], 4)
    finally:
        del model.forward


def _serve_lengths(engine, prompts, lengths):
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.submit(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True),
                      lambda d, i=i: got[i].extend(d.token_ids))
    engine.run_until_idle()
    return [got[i] for i in range(len(prompts))]


def test_the_decode_view_appends_while_the_same_rows_decode_and_is_laid_anew_when_one_leaves(model, monkeypatch):
    """Rows that finish at different steps: the view appends between, is filled from the pool when
    a row leaves, and every row's tokens equal `generate`'s, with the view and without it."""
    from moeflow.serving import paged

    refs = _refs(model, MIXED_PROMPTS, 10)
    lengths = [4, 10, 7, 10]  # rows leave after 4 and 7 tokens
    modes: list[str | None] = []
    plan = paged.DecodeView.plan

    def spy(self, *a, **k):
        out = plan(self, *a, **k)
        modes.append(out[0])
        return out
    monkeypatch.setattr(paged.DecodeView, "plan", spy)
    for budget in (EngineConfig().decode_view_bytes, 0):
        engine = Engine(model, IdTokenizer(), EngineConfig(decode_view_bytes=budget))
        _serve(engine, [[3, 4]], 1)  # the pool's tensors are made at the first write
        modes.clear()  # (the engine's own check of the packed forward lays a view too)
        cache = engine.core.kv.cache
        for t in cache.keys + cache.values:  # unwritten slots may hold anything: never read unmasked
            t[:cache.pad].fill_(float("nan"))
        got = _serve_lengths(engine, MIXED_PROMPTS, lengths)
        assert got == [r[:n] for r, n in zip(refs, lengths)], budget
        if budget:
            # one prefill, then tokens 2-10 decoded: the view is filled at the first decode step
            # and after each departure (after tokens 4 and 7), appended to in between
            assert modes == ["fill", "append", "append"] * 3, modes
        else:
            assert cache.view is None and not modes


def test_the_decode_view_holds_each_rows_keys_as_the_pool_does(model):
    engine = Engine(model, IdTokenizer(), EngineConfig())
    core = engine.core
    for i, p in enumerate(MIXED_PROMPTS):
        engine.submit(str(i), p, SamplingParams(max_tokens=20, ignore_eos=True), lambda d: None)
    engine.run_until_idle(max_steps=6)  # a prefill, a fill, then appends
    view = core.kv.cache.view
    assert view is not None and view.ids == tuple(id(s) for s in core.running)
    for b, seq in enumerate(core.running):
        n = seq.num_cached
        assert view.lengths[b] == n
        slots = core.kv.slots(seq, n)
        for layer in range(len(core.kv.cache.keys)):
            pool_k = core.kv.cache.keys[layer][slots].transpose(0, 1)  # [H, n, D]
            assert torch.equal(view.k[layer][b, :, :n], pool_k)
            assert torch.equal(view.v[layer][b, :, :n], core.kv.cache.values[layer][slots].transpose(0, 1))
        mask = view.mask(torch.float32, torch.device("cpu"))[b, 0, 0]
        assert (mask[:n] == 0).all() and torch.isinf(mask[n:]).all()
    engine.run_until_idle()


def test_a_decode_view_over_its_budget_is_not_made(model):
    """The view is a copy of the decoding rows' blocks: past its budget each step gathers from the
    pool instead, and the tokens are the same."""
    refs = _refs(model, MIXED_PROMPTS, 6)
    engine = Engine(model, IdTokenizer(), EngineConfig(decode_view_bytes=1024))
    assert _serve(engine, MIXED_PROMPTS, 6) == refs
    assert engine.core.kv.cache.view is not None and engine.core.kv.cache.view.cap == 0  # never laid
