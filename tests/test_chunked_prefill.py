"""Chunked prefill within a per-step token budget (issue 51; no Ray): decodes first, then prompt
chunks in what is left of the budget; a chunk is charged its tokens and its attention, so a long
prompt's chunks shrink as its context grows; the greedy tokens of a long prompt are the same
chunked over many steps as prefilled whole, on the paged cache and on the padded batches; the
setting is a `deploy:` field that reaches the local engine and never vLLM's arguments."""

from __future__ import annotations

import pytest
import torch

from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.request import Sequence
from moeflow.serving.scheduler import GATHER_ROWS, Scheduler, attention_fit, charge
from moeflow_testing.serving import IdTokenizer
from moeflow_testing.tiny_auto import tiny_model


def _seq(name: str, prompt: int, cached: int = 0, out: int = 0) -> Sequence:
    seq = Sequence(name, "base", None, list(range(3, 3 + prompt)) + [7] * out, prompt, SamplingParams())
    seq.num_cached = cached if not out else prompt + out - 1  # a decoding sequence: its last token next
    return seq


def test_decodes_go_first_and_prompts_take_at_most_what_is_left_of_the_budget():
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64, prefill_keys_per_token=None))
    decoding = [_seq(f"d{i}", 8, out=2) for i in range(10)]
    long = _seq("long", 1000)
    sched.running = [long] + decoding  # the prompt was admitted first: decodes still go first
    decodes, chunks = sched.schedule()
    assert decodes == decoding
    assert chunks == [(long, 32)]  # 54 left, capped at the default threshold: 64, at most half the budget
    sched.config.long_prefill_token_threshold = 100
    assert sched.schedule()[1] == [(long, 54)]  # 64 - 10 decodes
    sched.running = decoding[:4] + [_seq("short", 20), long, _seq("other", 30)]
    _, chunks = sched.schedule()
    assert [(s.req_id, n) for s, n in chunks] == [("short", 20), ("long", 40)]  # nothing left for "other"


def test_a_budget_smaller_than_the_prompt_splits_it_over_steps_each_within_the_budget():
    sched = Scheduler(EngineConfig(max_num_batched_tokens=48, long_prefill_token_threshold=48,
                                   prefill_keys_per_token=None))
    long, decoding = _seq("long", 200), [_seq(f"d{i}", 4, out=1) for i in range(8)]
    sched.running = [long] + decoding
    steps = []
    while long.is_prefill:
        decodes, chunks = sched.schedule()
        assert len(decodes) + sum(n for _, n in chunks) <= 48
        steps.append(chunks[0][1])
        long.num_cached += chunks[0][1]
    assert steps == [40] * 5  # 48 - 8 decodes each step, 200 tokens


def test_a_chunk_is_charged_its_tokens_and_its_attention_so_it_shrinks_as_its_context_grows():
    # a token each, plus (query-key pairs + the gathered keys as GATHER_ROWS queries) / 1,024, rounded up
    assert GATHER_ROWS == 8
    assert charge(0, 64, 1024) == 64 + 3  # (64 x 65 / 2 + 8 x 64) / 1,024 = 2.5
    assert charge(4000, 31, 1024) == 31 + 154  # (31 x 4,000 + 31 x 32 / 2 + 8 x 4,031) / 1,024 = 153.1
    assert charge(4000, 31, None) == 31  # vLLM's plain count
    for cached in (0, 100, 1000, 4000, 20000):
        for budget in (1, 128, 496):
            n = attention_fit(cached, budget, 1024)
            assert charge(cached, n, 1024) <= budget < charge(cached, n + 1, 1024) or n == budget == 1, (cached, n)
    assert attention_fit(17000, 128, 1024) == 0  # gathering 17,000 keys alone costs more than 128
    cfg = EngineConfig(max_num_batched_tokens=512)  # the defaults: 512 keys a token, threshold 64
    sched = Scheduler(cfg)
    long = _seq("long", 40000)
    sched.running = [long] + [_seq(f"d{i}", 32, out=1) for i in range(16)]
    sizes = {}
    for cached in (0, 1024, 2048, 4000, 8000, 20000):
        long.num_cached = cached
        sizes[cached] = sched.schedule()[1][0][1]
    # every chunk charges at most the threshold, 64 (its step then costs <= ~1.3x the decodes'):
    # fewer tokens as the context grows, never below 512 // 64
    assert sizes == {0: 59, 1024: 15, 2048: 8, 4000: 8, 8000: 8, 20000: 8}
    assert all(charge(c, n, 512) <= 64 for c, n in sizes.items() if n > 8)
    long.num_cached = 600
    sched.running.append(_seq("short", 10))
    assert [(s.req_id, n) for s, n in sched.schedule()[1]] == [("long", 24), ("short", 10)]  # both within 496
    cfg.prefill_keys_per_token = None
    assert sched.schedule()[1][0][1] == 64  # the threshold alone


def test_a_prompt_with_no_decodes_beside_it_takes_the_whole_budget():
    """The charge and the default cap protect the decodes beside a chunk; with none running a
    long prompt is chunked by vLLM's plain count, up to the budget, at any context."""
    cfg = EngineConfig(max_num_batched_tokens=512)
    sched = Scheduler(cfg)
    long = _seq("long", 40000)
    sched.running = [long]
    for cached in (0, 4000, 20000):
        long.num_cached = cached
        assert sched.schedule()[1] == [(long, 512)]
    sched.running = [long, _seq("short", 10)]  # prompts only: still nobody to stall
    assert [(s.req_id, n) for s, n in sched.schedule()[1]] == [("long", 512)]
    sched.running = [_seq("short", 10), long]
    assert [(s.req_id, n) for s, n in sched.schedule()[1]] == [("short", 10), ("long", 502)]
    sched.running.append(_seq("d", 32, out=1))  # one decode: the charge is back
    assert [(s.req_id, n) for s, n in sched.schedule()[1]] == [("short", 10), ("long", 8)]
    cfg.long_prefill_token_threshold = 100  # a cap the deployment set holds with no decodes too
    sched.running = [long]
    assert sched.schedule()[1] == [(long, 100)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3_moe").eval().float()


def _greedy(model, prompt: list[int], new: int, **cfg) -> tuple[list[int], list[int]]:
    """The greedy tokens of one prompt among two decoding streams, and the long prompt's chunk per step."""
    engine = Engine(model, IdTokenizer(), EngineConfig(max_num_seqs=4, **cfg))
    core, chunks = engine.core, []
    step = core.step

    def spy() -> bool:  # each step's chunk of the long prompt while it is prefilled (last_scheduled)
        prefill = any(s.req_id == "long" and s.is_prefill for s in core.sched.running + core.sched.waiting)
        ran = step()
        if ran and prefill:
            chunks.append(core.last_scheduled.get("long", 0))
        return ran
    core.step = spy  # type: ignore[method-assign]
    got: list[int] = []
    for i in range(2):
        engine.submit(f"s{i}", [5 + i, 9, 11], SamplingParams(max_tokens=new + 4, ignore_eos=True), lambda d: None)
    engine.run_until_idle(max_steps=2)  # the two streams are decoding when the long prompt arrives
    engine.submit("long", prompt, SamplingParams(max_tokens=new, ignore_eos=True), lambda d: got.extend(d.token_ids))
    engine.run_until_idle()
    return got, [n for n in chunks if n]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "padded"])
def test_a_long_prompt_chunked_gives_the_tokens_it_gives_whole(model, paged):
    prompt = [(7 * i) % 500 + 3 for i in range(300)]
    ids = torch.tensor([prompt])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    whole, steps = _greedy(model, prompt, 8, paged_kv=paged, enable_chunked_prefill=False)
    assert steps == [300] and whole == want
    # a 64-token budget (2 decodes + a chunk charging at most 62 a step), a token charged per 128
    # query-key pairs: the chunks shrink as the context grows (49 tokens first, 13 at ~280), and the
    # tokens are the same
    chunked, steps = _greedy(model, prompt, 8, paged_kv=paged, max_num_batched_tokens=64,
                             long_prefill_token_threshold=62, prefill_keys_per_token=128)
    assert chunked == want
    assert sum(steps) == 300 and len(steps) > 5 and steps[0] > steps[-2] >= 4, steps


def test_deploy_prefill_keys_per_token_reaches_the_local_engine_and_never_vllm(tmp_path):
    """`deploy.prefill_keys_per_token` (and a serving.yaml's) reaches the replica's EngineConfig
    through the settings `moeflow serve` builds; the vLLM render's engine arguments leave it out
    (vLLM has no such argument); one default for both; a bad value is one clear error."""
    from moeflow.core.config import validate
    from moeflow.core.errors import UserError
    from moeflow.core.sections.deploy import DeploySection
    from moeflow.serving.deployment import decide, engine_settings
    from moeflow.serving.launch import settings_for
    from moeflow.serving.vllm_backend import engine_kwargs
    from moeflow_testing.tiny import build_debug_model

    def config(**deploy):
        return validate({"model": {"path": str(tmp_path / "model")},
                         "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}, "deploy": deploy})

    assert DeploySection().prefill_keys_per_token == EngineConfig().prefill_keys_per_token
    base = build_debug_model("qwen3_moe", tmp_path / "model")
    cfg = config(prefill_keys_per_token=64)
    settings = settings_for(cfg, decide(cfg, {"convert": {"output_dir": str(base)}}), None)
    assert EngineConfig(**settings.engine).prefill_keys_per_token == 64
    assert EngineConfig(**engine_settings(config(prefill_keys_per_token=None))).prefill_keys_per_token is None
    (tmp_path / "serving.yaml").write_text("engine:\n  prefill_keys_per_token: 32\n")
    assert engine_settings(config(serving_config=str(tmp_path / "serving.yaml")))["prefill_keys_per_token"] == 32
    plan = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "enable_expert_parallel": False,
            "data_parallel_size": 1}
    kw = engine_kwargs(plan, engine_settings(cfg), "auto", None, [], 0.9)
    assert kw["max_num_batched_tokens"] == 512 and "prefill_keys_per_token" not in kw
    with pytest.raises(UserError, match="prefill_keys_per_token"):
        config(prefill_keys_per_token=0)
