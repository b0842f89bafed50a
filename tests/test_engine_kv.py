"""The engine's KV cache and output path (no Ray): the paged cache and the padded batches equal
`generate` for plain, sliding-window and hybrid (linear-attention / state-space) caches (the
paged cache's own tests: tests/test_kv_paged.py); a stable padded batch is
never re-laid; rows leaving and joining keep every other row exact; incremental
detokenisation equals a full decode; pads of a batched prefill are not counted as expert load."""

from __future__ import annotations

import random

import pytest
import torch

from moeflow.serving import kv_plan
from moeflow.serving.detokenize import Detokenizer
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.kv_cache import KVBatch, batchable
from moeflow.serving.metrics import ExpertLoad
from moeflow.serving.request import Sequence
from moeflow_testing.serving import MIXED_PROMPTS, IdTokenizer
from moeflow_testing.tiny_auto import tiny_model

PROMPTS = MIXED_PROMPTS
NEW = 6
_Tok = IdTokenizer


def _refs(model, prompts, new=NEW):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _serve(engine, prompts, new=NEW, stagger=False):
    got = {i: [] for i in range(len(prompts))}
    errors = []

    def sink(d, i):
        got[i].extend(d.token_ids)
        if d.error:
            errors.append(d.error)
    for i, p in enumerate(prompts):
        engine.submit(str(i), p, SamplingParams(max_tokens=new + (i if stagger else 0), ignore_eos=True),
                      lambda d, i=i: sink(d, i))
    engine.run_until_idle()
    assert not errors, errors
    return [got[i] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "qwen3_next"])
def family(request):
    """A plain-attention family, one with sliding-window layers, one hybrid (linear attention)."""
    torch.manual_seed(0)  # (never torch.set_grad_enabled(False) here: it would leak into other tests)
    model = tiny_model(request.param).eval().float()
    return request.param, model


def test_mixed_lengths_equal_generate_for_every_cache_kind(family):
    name, model = family
    refs = _refs(model, PROMPTS)
    for cfg in ({"max_num_batched_tokens": 512},  # all prompts prefilled together, one decode batch
                {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4}):  # chunked, joins
        for paged in (True, False):  # the paged cache where the model's can be paged; padded batches
            engine = Engine(model, _Tok(), EngineConfig(**cfg, paged_kv=paged))
            assert _serve(engine, PROMPTS) == refs, (name, cfg, paged)
            # only plain full-attention layers are paged (read from the cache the model builds)
            assert (engine.core.kv is not None) is (paged and name == "qwen3_moe")
    # the batching decision comes from the cache the model itself builds (no family table)
    assert engine.core.runner.kv_batchable is (name != "qwen3_next")
    # padded decode steps take a ready 4-D mask only over plain full-attention layers under SDPA
    # (sliding layers need transformers' own mask); a hybrid cache decodes its rows alone, unpadded
    assert engine.core.runner.mask4d is {"qwen3_moe": True, "gpt_oss": False, "qwen3_next": None}[name]


def test_a_ready_decode_mask_is_taken_only_where_it_gives_the_same_logits():
    """Eager attention adds its mask as a float bias, so a boolean one would be wrong: the
    engine keeps the 2-D mask there (and the answers equal generate's either way)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    refs = _refs(model, PROMPTS)
    model.set_attn_implementation("eager")
    engine = Engine(model, _Tok(), EngineConfig(paged_kv=False, max_num_batched_tokens=512))
    assert _serve(engine, PROMPTS) == refs
    assert engine.core.runner.mask4d is False
    model.set_attn_implementation("sdpa")
    engine = Engine(model, _Tok(), EngineConfig(paged_kv=False, max_num_batched_tokens=512))
    forwards = []
    run = engine.core.runner.run
    engine.core.runner.run = lambda *a, **k: (forwards.append(k["attention_mask"].dim()), run(*a, **k))[1]
    assert _serve(engine, PROMPTS) == refs
    assert engine.core.runner.mask4d is True
    # the first padded decode is checked once (2-D, then 4-D), every later decode passes 4-D
    first = forwards.index(4)
    assert forwards[first - 1] == 2 and 2 not in forwards[first:]

    # a model whose forward reads the 2-D mask for more than attention answers differently given
    # the 4-D one: the check sees it and the engine keeps the 2-D mask
    forward = model.forward

    def reads_the_mask(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs["attention_mask"].dim() == 4:
            out.logits = out.logits + 1e-2 * torch.randn_like(out.logits)
        return out
    model.forward = reads_the_mask
    try:
        engine = Engine(model, _Tok(), EngineConfig(paged_kv=False, max_num_batched_tokens=512))
        assert _serve(engine, PROMPTS) == refs
        assert engine.core.runner.mask4d is False
    finally:
        del model.forward


def _counting(engine) -> list[tuple[int, int]]:
    """Record (rows, new tokens per row) of every forward the engine's runner makes."""
    shapes: list[tuple[int, int]] = []
    run = engine.core.runner.run
    engine.core.runner.run = lambda *a, **k: (shapes.append(tuple(k["input_ids"].shape)), run(*a, **k))[1]
    return shapes


def test_prompts_arriving_while_others_decode_join_their_forward(family):
    """Over plain full-attention layers; not over sliding-window ones (a window counts the
    joined rows' masked columns), and a hybrid cache is never batched: apart, still exact."""
    name, model = family
    six = [[(7 * i + j) % 50 + 3 for j in range(6)] for i in range(11)]  # 6-token prompts
    prompts = [PROMPTS[0]] + six  # a 5-token prompt, then 3 and 8 arrivals
    refs = [_refs(model, [p], 8)[0] for p in prompts]
    engine = Engine(model, _Tok(), EngineConfig(paged_kv=False, max_num_batched_tokens=512))
    shapes = _counting(engine)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def submit(i):
        engine.submit(str(i), prompts[i], SamplingParams(max_tokens=8, ignore_eos=True),
                      lambda d, i=i: got[i].extend(d.token_ids))
        engine.core._drain_inbox()
    submit(0)
    engine.core.step()  # the first prompt alone: learns the cache kind
    for i in (1, 2, 3):
        submit(i)
    engine.core.step()  # row 0 decodes (5 pads), prompts 1-3 (18 tokens) join: checked once against the rows apart
    if name != "qwen3_moe":
        assert engine.core.runner.mixes is None
        engine.run_until_idle()
        assert [got[i] for i in range(4)] == refs[:4]
        return
    assert engine.core.runner.mixes is True
    assert len({id(s.kv) for s in engine.core.running}) == 1  # one batch of all four rows
    engine.core.step()
    for i in range(4, 12):
        submit(i)
    del shapes[:]
    engine.core.step()  # four decoding rows (20 pads) and eight new prompts (48 tokens): one forward
    assert shapes == [(12, 6)]
    assert len({id(s.kv) for s in engine.core.running}) == 1
    engine.run_until_idle()
    assert [got[i] for i in range(len(prompts))] == refs


def test_a_model_whose_mixed_forward_differs_runs_the_rows_apart():
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    prompts = [PROMPTS[0], [3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4], [5, 6, 7, 8, 9, 10]]  # 3 arrivals that may mix
    refs = _refs(model, prompts)
    forward = model.forward

    def reads_the_mask(*args, **kwargs):  # answers differently whenever prompts ride with a cache
        out = forward(*args, **kwargs)
        ids = kwargs["input_ids"]
        if ids.shape[0] > 1 and ids.shape[1] > 1 and kwargs.get("cache") is not None:
            out.logits = out.logits + 1e-2 * torch.randn_like(out.logits)
        return out
    model.forward = reads_the_mask
    try:
        engine = Engine(model, _Tok(), EngineConfig(paged_kv=False, max_num_batched_tokens=512))
        got = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):  # one arrives, then the others while it decodes
            engine.submit(str(i), p, SamplingParams(max_tokens=NEW, ignore_eos=True),
                          lambda d, i=i: got[i].extend(d.token_ids))
            engine.core._drain_inbox()
            if i == 0:
                engine.core.step()
        engine.run_until_idle()
        assert [got[i] for i in range(len(prompts))] == refs
        assert engine.core.runner.mixes is False
    finally:
        del model.forward


def test_a_mix_must_fit_the_step_budget_and_compatible_widths():
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), use_cache=True)
    seqs = [Sequence(str(i), "base", None, [1, 2, 3], 3, SamplingParams(), lambda d: None, None) for i in range(2)]
    kv = KVBatch(out.cache, torch.ones(2, 3, dtype=torch.long), seqs, True)
    fresh = [Sequence(str(i), "base", None, list(range(1, 11)), 10, SamplingParams(), lambda d: None, None)
             for i in range(2, 4)]
    key, yes = (lambda s: None), (lambda kv: True)
    four = fresh * 2  # four 10-token prompts (the same two, for planning)
    pairs, batches, groups = kv_plan.mixes([kv], [four], key, 60, yes)  # (2 + 4) x 10 tokens fit
    assert pairs == [(kv, four)] and batches == [] and groups == []
    pairs, batches, groups = kv_plan.mixes([kv], [four], key, 59, yes)  # one padded token too many
    assert pairs == [] and batches == [kv] and groups == [four]
    long = [Sequence("9", "base", None, list(range(1, 101)), 100, SamplingParams(), lambda d: None, None)]
    assert kv_plan.mixes([kv], [long * 8], key, 4096, yes)[0] == []  # 3 cached columns against 100: apart
    assert kv_plan.mixes([kv], [four], key, 4096, lambda kv: False)[0] == []  # the runner says no
    # 2 decode rows gain 9 pads each = 18 padded tokens: more than half of one or two
    # 10-token prompts, at most half of four
    assert kv_plan.mixes([kv], [fresh[:1]], key, 4096, yes)[0] == []
    assert kv_plan.mixes([kv], [fresh], key, 4096, yes)[0] == []
    assert kv_plan.mixes([kv], [fresh * 2], key, 4096, yes)[0] == [(kv, fresh * 2)]


def test_a_mixed_step_counts_only_real_tokens_as_expert_load():
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    experts = ExpertLoad(model, window_steps=1000)
    engine = Engine(model, _Tok(), EngineConfig(paged_kv=False), experts=experts)
    engine.submit("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), lambda d: None)
    engine.core._drain_inbox()
    engine.core.step()
    before = experts.total.sum(dim=1).clone()  # [layers]
    for r in "bcd":
        engine.submit(r, list(range(3, 8)), SamplingParams(max_tokens=4, ignore_eos=True), lambda d: None)
    engine.core._drain_inbox()
    engine.core.step()  # 1 decode token + 3 x 5 prompt tokens in a [4, 5] forward (and the one-time check)
    assert engine.core.runner.mixes is True
    top_k = model.config.num_experts_per_tok
    assert ((experts.total.sum(dim=1) - before) == (1 + 15) * top_k).all()


def test_rows_leaving_and_joining_keep_the_others_exact(family):
    _, model = family
    prompts = PROMPTS + [[7, 7, 7, 7]]
    refs = [_refs(model, [p], NEW + i)[0] for i, p in enumerate(prompts)]
    engine = Engine(model, _Tok(), EngineConfig(max_num_batched_tokens=16, long_prefill_token_threshold=8,
                                                 max_num_seqs=3))  # rows finish one by one, others join
    assert _serve(engine, prompts, stagger=True) == refs


def test_a_stable_decode_batch_is_never_relaid():
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    engine = Engine(model, _Tok(), EngineConfig(paged_kv=False))
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True), lambda d: None)
    engine.core._drain_inbox()
    engine.core.step()  # solo prefill of the first (learns the cache kind), then the rest together
    engine.core.step()
    batches = []
    while engine.core.running:
        engine.core.step()
        kinds = {id(s.kv) for s in engine.core.running}
        batches.append(kinds)
    steady = [b for b in batches[1:-1] if b]
    assert steady and all(len(b) == 1 for b in steady)  # one batch for all rows
    assert len({next(iter(b)) for b in steady}) == 1  # the same KVBatch object step after step


def test_batchable_reads_the_cache_the_model_builds():
    torch.manual_seed(0)
    for name, expected in (("qwen3_moe", True), ("qwen3_next", False)):
        model = tiny_model(name).eval().float()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
        assert batchable(out.cache) is expected, name


def test_select_and_merge_round_trip_right_aligned():
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    caches = []
    for p in ([1, 2, 3], [4, 5, 6, 7, 8]):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([p]), use_cache=True)
        caches.append(KVBatch(out.cache, torch.ones(1, len(p), dtype=torch.long), [p], True))
    merged = KVBatch.merge(caches)
    assert merged.width == 5 and merged.mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    first = merged.select([0])  # leading all-pad columns dropped again
    assert first.width == 3
    for a, b in zip(first.cache.layers, caches[0].cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_padded_prefill_counts_only_real_tokens_as_expert_load():
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().float()
    experts = ExpertLoad(model, window_steps=1000)
    engine = Engine(model, _Tok(), EngineConfig(paged_kv=False), experts=experts)
    _serve(engine, [[1, 2, 3]], new=1)  # solo: learns the cache kind
    before = experts.total.sum(dim=1).clone()  # [layers]
    _serve(engine, [[1, 2], list(range(3, 40))], new=1)  # one padded forward of 2 x 37
    top_k = model.config.num_experts_per_tok
    assert ((experts.total.sum(dim=1) - before) == (2 + 37) * top_k).all()


def test_detokenizer_streams_what_a_full_decode_gives(tmp_path):
    from transformers import AutoTokenizer

    from moeflow_testing.tiny import build_debug_model

    tok = AutoTokenizer.from_pretrained(str(build_debug_model("qwen3_moe", tmp_path / "m")))
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        d = Detokenizer(tok, [])
        assert d.stream is not None  # the fast path is the one under test
        text = ""
        for j, t in enumerate(ids):
            d.add(t, final=j == len(ids) - 1)
            text += d.take(final=j == len(ids) - 1)
        assert text == tok.decode(ids, skip_special_tokens=True)
    # a stop string split across tokens ends the text before it, whatever the chunking
    ids = tok("hello world, stop here").input_ids
    d = Detokenizer(tok, [", stop"])
    hit = any(d.add(t, final=False) for t in ids)
    assert hit and d.text == "hello world"


def test_detokenizer_never_repeats_sent_text_when_the_full_decode_differs(tmp_path):
    """A decoder whose full decode rewrites earlier text: the stream keeps what it sent and
    ends with what the stream itself decoded (no repeated or lost characters)."""
    from transformers import AutoTokenizer

    from moeflow_testing.tiny import build_debug_model

    tok = AutoTokenizer.from_pretrained(str(build_debug_model("qwen3_moe", tmp_path / "m")))
    ids = tok("hello world again").input_ids
    d = Detokenizer(tok, [])
    sent = "".join(d.take(final=False) for t in ids[:-1] if d.add(t, final=False) or True)
    assert sent and sent == tok.decode(ids[:-1], skip_special_tokens=True)[:len(sent)]
    real = tok.decode
    tok.decode = lambda *a, **k: "HELLO" + real(*a, **k)  # rewrites the start
    try:
        d.add(ids[-1], final=True)
        assert sent + d.take(final=True) == real(ids, skip_special_tokens=True)
    finally:
        tok.decode = real
