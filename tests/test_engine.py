"""Engine unit tests (no Ray): greedy output equals transformers `generate` for the
base and each adapter in mixed batches, chunked prefill, continuous batching,
LRU adapter slots, expert-LoRA fallback, adapter path safety, expert load."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.serving.adapters import AdapterRegistry, make_spec, read_adapter_dir
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.metrics import ExpertLoad, ServingMetrics
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model

PROMPTS = ["reverse: abc\nanswer:", "Hello, how are you? I am fine. reverse: kqzm\nanswer: m", "x"]
NEW = 10


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny Qwen3-MoE + two attention adapters + one expert adapter, with `generate` references."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("engine")
    base = build_debug_model("qwen3_moe", root / "base")
    paths = {"a1": make_lora_adapter(base, root / "adapters" / "a1", seed=1),
             "a2": make_lora_adapter(base, root / "adapters" / "a2", seed=2),
             "ax": make_lora_adapter(base, root / "adapters" / "ax", seed=3, experts=True)}
    tok = AutoTokenizer.from_pretrained(str(base))
    refs = {}
    for name in (None, "a1", "a2", "ax"):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        if name:
            model = PeftModel.from_pretrained(model, str(paths[name]))
        model.eval()
        outs = []
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
            outs.append(out[0, ids.shape[1]:].tolist())
        refs[name] = outs
    return {"base": base, "paths": paths, "tok": tok, "refs": refs, "root": root}


def make_engine(world, names=("a1", "a2"), **cfg):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(world["base"]), dtype=torch.float32)
    reg = AdapterRegistry(world["root"] / "adapters")
    for n in names:
        reg.add(make_spec(n, world["paths"][n]))
    metrics = ServingMetrics()
    experts = ExpertLoad(model, window_steps=4, registry=metrics.registry)
    return Engine(model, world["tok"], EngineConfig(**cfg), reg, metrics, experts)


def submit_all(engine, world, adapters, max_tokens=NEW, **params):
    """Submit every prompt for every adapter; returns {(adapter, i): [token ids]}."""
    out = {}
    for a in adapters:
        for i, p in enumerate(PROMPTS):
            out[(a, i)] = []
            engine.submit(f"{a}-{i}", world["tok"](p).input_ids,
                          SamplingParams(max_tokens=max_tokens, **params),
                          lambda d, k=(a, i): out[k].extend(d.token_ids), adapter=a)
    return out


def test_mixed_adapter_batch_with_chunked_prefill_equals_generate(world):
    engine = make_engine(world, max_num_batched_tokens=8, long_prefill_token_threshold=3)
    out = submit_all(engine, world, [None, "a1", "a2"])
    engine.run_until_idle()
    for (a, i), ids in out.items():
        assert ids == world["refs"][a][i], (a, i)
    # the adapters really change the output, so the equality above is not vacuous
    assert world["refs"]["a1"] != world["refs"][None] != world["refs"]["a2"] != world["refs"]["a1"]
    # plain attention LoRA: resident in the per-row slot stacks without PEFT layers
    runner = engine.core.runner
    assert sorted(engine.core.slots.resident()) == ["a1", "a2"] == sorted(runner.direct)
    assert runner.peft is None and runner.lora_mode() == "batched"


def test_expert_lora_falls_back_to_per_adapter_forwards(world):
    engine = make_engine(world, names=("a1", "ax"), max_num_batched_tokens=64)
    out = submit_all(engine, world, [None, "a1", "ax"])
    engine.run_until_idle()
    assert not engine.core.slots.spec("ax").mixable
    assert engine.core.runner.lora_mode() == "peft" and not engine.core.runner.direct  # PEFT took a1 over
    for (a, i), ids in out.items():
        assert ids == world["refs"][a][i], (a, i)


def test_continuous_batching_requests_join_and_leave_between_steps(world):
    engine = make_engine(world, max_num_batched_tokens=64)
    long_out, short_out = [], []
    tok = world["tok"]
    engine.submit("long", tok(PROMPTS[0]).input_ids, SamplingParams(max_tokens=30, ignore_eos=True),
                  lambda d: long_out.extend(d.token_ids))
    for _ in range(3):
        engine.run_until_idle(max_steps=1)
    assert len(long_out) == 3
    engine.submit("short", tok(PROMPTS[2]).input_ids, SamplingParams(max_tokens=NEW),
                  lambda d: short_out.extend(d.token_ids), adapter="a1")
    engine.run_until_idle(max_steps=1)
    # a1 is read into host memory off the step (adapter_tiers.py): "long" decodes meanwhile,
    # and "short" joins the running batch mid-flight once it is read
    while "short" not in engine.core.last_scheduled and len(long_out) < 25:
        time.sleep(0.01)
        engine.run_until_idle(max_steps=1)
    assert set(engine.core.last_scheduled) == {"long", "short"}
    while short_out != world["refs"]["a1"][2] or len(engine.core.running) != 1:
        engine.run_until_idle(max_steps=1)
        assert len(long_out) < 30, "short request should finish while the long one still decodes"
    engine.run_until_idle()
    assert len(long_out) == 30 and long_out[:NEW] == world["refs"][None][0][:NEW]


def test_a_late_arrival_joins_the_next_step_beside_the_decodes(world):
    """Issue 33's mixed steps over the paged cache (issue 51): a request arriving while others
    decode is prefilled in the very next step, in the same forward as every running decode
    (they never pause for it): one packed forward of the decodes' tokens and the arrivals'
    whole prompts side by side, no padding (tests/test_engine_kv.py covers the padded batches
    of caches that cannot be paged)."""
    engine = make_engine(world, names=(), max_num_batched_tokens=256)
    tok = world["tok"]
    outs: dict[str, list[int]] = {r: [] for r in ("d1", "d2", "late1", "late2")}
    for r in ("d1", "d2"):
        engine.submit(r, tok(PROMPTS[0]).input_ids, SamplingParams(max_tokens=12),
                      lambda d, r=r: outs[r].extend(d.token_ids))
    engine.run_until_idle(max_steps=3)
    forwards: list[tuple[int, ...]] = []
    run = engine.core.runner.run
    engine.core.runner.run = lambda *a, **k: (forwards.append(tuple(k["input_ids"].shape)), run(*a, **k))[1]
    before = len(outs["d1"])
    for i, r in enumerate(("late1", "late2")):
        engine.submit(r, tok(PROMPTS[1 + i]).input_ids, SamplingParams(max_tokens=NEW),
                      lambda d, r=r: outs[r].extend(d.token_ids))
    engine.run_until_idle(max_steps=1)
    assert set(engine.core.last_scheduled) == {"d1", "d2", "late1", "late2"}
    n1, n2 = len(tok(PROMPTS[1]).input_ids), len(tok(PROMPTS[2]).input_ids)
    assert engine.core.last_scheduled["late1"] == n1  # its whole prompt
    assert len(outs["d1"]) == before + 1 and len(outs["late1"]) == 1 and len(outs["late2"]) == 1
    assert forwards == [(1, 2 + n1 + n2)]  # two decode tokens and both prompts, packed
    forwards.clear()
    engine.run_until_idle(max_steps=1)
    assert forwards == [(1, 4)]  # one decode forward for the old and the new rows
    engine.run_until_idle()
    assert outs["d1"][:NEW] == world["refs"][None][0] and outs["late2"] == world["refs"][None][2]
    assert outs["late1"] == world["refs"][None][1]


def test_chunked_prefill_respects_budget_and_keeps_decoding(world):
    tok = world["tok"]
    long_ids = tok(" ".join(PROMPTS * 6)).input_ids
    for chunked, expect_steps in ((True, None), (False, 1)):
        engine = make_engine(world, max_num_batched_tokens=16, enable_chunked_prefill=chunked)
        got = []
        engine.submit("dec", tok(PROMPTS[0]).input_ids, SamplingParams(max_tokens=64, ignore_eos=True),
                      lambda d: got.extend(d.token_ids))
        engine.run_until_idle(max_steps=2)
        engine.submit("long", long_ids, SamplingParams(max_tokens=2), lambda d: None)
        prefill_steps, decode_during = 0, 0
        while True:
            engine.run_until_idle(max_steps=1)
            sched = engine.core.last_scheduled
            assert sum(sched.values()) <= 16 or not chunked
            prefill_steps += "long" in sched
            decode_during += sched.get("dec", 0)
            if not any(s.req_id == "long" and s.is_prefill for s in engine.core.waiting + engine.core.running):
                break
        if chunked:
            assert prefill_steps >= len(long_ids) // 16 and decode_during == prefill_steps
        else:
            assert prefill_steps == expect_steps
        engine.run_until_idle()
        assert got[:NEW] == world["refs"][None][0]


def test_lru_keeps_at_most_max_loras(world):
    engine = make_engine(world, max_loras=1)
    for name in ("a1", "a2", "a1"):
        out = []
        engine.submit(name, world["tok"](PROMPTS[0]).input_ids, SamplingParams(max_tokens=NEW),
                      lambda d: out.extend(d.token_ids), adapter=name)
        engine.run_until_idle()
        assert out == world["refs"][name][0]
        assert engine.core.slots.resident() == [name]
    assert engine.core.slots.evictions == 2
    engine.call(lambda: engine.core.remove_adapter("a1")).result()  # the last resident one: LoRA stripped
    assert engine.core.runner.peft is None and engine.core.registry.names() == ["a2"]
    for name in (None, "a2"):
        out = []
        engine.submit("after", world["tok"](PROMPTS[1]).input_ids, SamplingParams(max_tokens=NEW),
                      lambda d: out.extend(d.token_ids), adapter=name)
        engine.run_until_idle()
        assert out == world["refs"][name][1]


def test_sampling_seed_stop_and_validation(world):
    engine = make_engine(world)
    ids = world["tok"](PROMPTS[0]).input_ids
    runs = []
    for _ in range(2):
        out = []
        engine.submit("s", ids, SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7),
                      lambda d: out.append(d))
        engine.run_until_idle()
        runs.append([t for d in out for t in d.token_ids])
    assert runs[0] == runs[1]
    full = world["tok"].decode(world["refs"][None][0], skip_special_tokens=True)
    stop = full[3:5]
    deltas = []
    engine.submit("stop", ids, SamplingParams(max_tokens=NEW, stop=[stop]), lambda d: deltas.append(d))
    engine.run_until_idle()
    assert "".join(d.text for d in deltas) == full[:full.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    with pytest.raises(UserError, match="max_tokens"):
        engine.submit("bad", ids, SamplingParams(max_tokens=0), lambda d: None)
    with pytest.raises(UserError, match="maximum context length"):
        engine.submit("bad", ids * 200, SamplingParams(max_tokens=4), lambda d: None)


def test_min_tokens_holds_back_stop_strings(world):
    """vLLM's rule: a stop string counts only once more than min_tokens tokens are out, and only
    in the text the newest token completes; one that the first min_tokens tokens complete is
    passed over and the output goes on to the next match (or its length)."""
    engine = make_engine(world, names=())
    tok, ids = world["tok"], world["tok"](PROMPTS[1]).input_ids
    free = []
    engine.submit("free", ids, SamplingParams(max_tokens=24, ignore_eos=True), free.append)
    engine.run_until_idle()
    out = [t for d in free for t in d.token_ids]
    full = tok.decode(out, skip_special_tokens=True)
    ends = [len(tok.decode(out[:i + 1], skip_special_tokens=True)) for i in range(len(out))]
    stop = full[3:5]

    def completed_by(pos: int) -> int:  # tokens out when the match at `pos` is complete
        return next(i + 1 for i, end in enumerate(ends) if end >= pos + len(stop))
    first = completed_by(full.index(stop))
    for min_tokens in (0, first):
        later = [p for p in range(len(full)) if full.startswith(stop, p) and completed_by(p) > min_tokens]
        deltas = []
        engine.submit(f"min{min_tokens}", ids, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop],
                                                              min_tokens=min_tokens), deltas.append)
        engine.run_until_idle()
        text = "".join(d.text for d in deltas)
        if later:
            assert (text, deltas[-1].finish_reason) == (full[:later[0]], "stop"), min_tokens
        else:
            assert (text, deltas[-1].finish_reason) == (full, "length"), min_tokens
    assert text != full[:full.index(stop)]  # min_tokens changed the answer: the check is not vacuous


def test_expert_load_counts_every_routed_token(world, caplog):
    engine = make_engine(world)
    engine.experts.threshold = 1.01  # any real routing is "imbalanced": exercise the warning path
    ids = world["tok"](PROMPTS[1]).input_ids
    engine.submit("e", ids, SamplingParams(max_tokens=5, ignore_eos=True), lambda d: None)
    engine.run_until_idle()
    snap = engine.experts.snapshot()
    counts = torch.tensor(snap["counts"])  # [layers, experts]
    assert counts.shape == (2, 8)
    tokens = len(ids) + 5 - 1  # the last sampled token is never fed back
    assert counts.sum(dim=1).tolist() == [tokens * 2] * 2  # top-2 routing
    engine.experts.flush()
    text = engine.metrics.render(engine.experts.registry).decode()
    assert 'moeflow_generation_tokens_total{model_name="base"} 5.0' in text
    assert 'moeflow_expert_imbalance_total{layer="1"}' in text and "moeflow_expert_balancedness" in text
    assert any("expert load imbalance" in r.getMessage() for r in caplog.records)


def test_adapter_path_safety(world, tmp_path):
    reg = AdapterRegistry(world["root"] / "adapters")
    assert reg.resolve("a1") == world["paths"]["a1"].resolve()
    with pytest.raises(UserError, match="outside the adapter root"):
        reg.resolve(str(world["root"] / "base"))
    with pytest.raises(UserError, match="outside the adapter root"):
        reg.resolve("../base")
    link = world["root"] / "adapters" / "escape"
    if not link.exists():
        os.symlink(world["root"] / "base", link)
    with pytest.raises(UserError, match="outside the adapter root"):
        reg.resolve("escape")
    with pytest.raises(UserError, match="only models:/"):
        AdapterRegistry(None).resolve(str(world["paths"]["a1"]))
    bad = tmp_path / "pickled"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (bad / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="pickle"):
        read_adapter_dir(bad)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_other_families_sliding_window_and_mla(family, tmp_path):
    """GPT-OSS has sliding-window layers (cache capped at the window), DeepSeek-V3 MLA
    caches: batched decodes of different lengths still equal `generate`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_debug_model(family, tmp_path / family)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    prompts = [" ".join(PROMPTS * 3), PROMPTS[0], PROMPTS[2]]  # longer than GPT-OSS's window of 16
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        refs.append(model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist())
    experts = ExpertLoad(model)
    engine = Engine(model, tok, EngineConfig(max_num_batched_tokens=16), experts=experts)
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(str(i), tok(p).input_ids, SamplingParams(max_tokens=20),
                      lambda d, i=i: out[i].extend(d.token_ids))
    engine.run_until_idle()
    assert [out[i] for i in range(len(prompts))] == refs
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert experts.layer_ids == moe_layers and int(experts.total.sum()) > 0


def _collect(engine, world, names, **params):
    """Submit PROMPTS[0] once per name; returns {name: [deltas]}."""
    out = {n: [] for n in names}
    for n in names:
        engine.submit(n, world["tok"](PROMPTS[0]).input_ids, SamplingParams(max_tokens=NEW, **params),
                      out[n].append)
    return out


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("fault", ["raises", "nan_logits"])
def test_a_fault_in_one_row_fails_only_that_request(world, fault, paged):
    engine = make_engine(world, names=(), paged_kv=paged)
    runner = engine.core.runner
    real = runner.packed if paged else runner.decode_batch

    def flaky(*args):  # the row of request "bad" breaks the forward it is in
        seqs = [s for s, _ in args[0]] if paged else args[0].seqs
        bad = [i for i, s in enumerate(seqs) if s.req_id == "bad"]
        if bad and fault == "raises":
            raise RuntimeError("kernel fault")
        got = real(*args)
        # packed: (kept logits [K, V], each row's index there or None); decode_batch: logits [B, V]
        logits, at = got if paged else (got, range(len(seqs)))
        if bad and at[bad[0]] is not None:
            logits = logits.clone()  # packed's logits are made in inference mode: copied to change
            logits[at[bad[0]]] = torch.full_like(logits[at[bad[0]]], float("nan"))
            return (logits, at) if paged else logits
        return got

    if paged:
        runner.packed = flaky
    else:
        runner.decode_batch = flaky
    out = _collect(engine, world, ["good1", "bad", "good2", "good3"])
    engine.run_until_idle()
    assert not engine.core.running and not engine.core.waiting and engine.dead is None
    assert out["bad"][-1].finish_reason == "error"
    assert ("non-finite" if fault == "nan_logits" else "kernel fault") in out["bad"][-1].error
    for name in ("good1", "good2", "good3"):
        assert [t for d in out[name] for t in d.token_ids] == world["refs"][None][0], name
    if paged:  # every block went back to the pool
        assert engine.core.kv.pool.used == 0


def test_a_sampling_fault_in_one_row_fails_only_that_request(world, monkeypatch):
    """The sampled rows of a step are drawn together; when that fails, each is drawn alone, so
    only the request whose draw fails ends in error and the others sample as they would alone."""
    from moeflow.serving import step_sample

    engine = make_engine(world, names=())
    knobs = dict(temperature=1.0, top_p=0.9, ignore_eos=True)
    want = {}
    for n in ("good1", "good2"):
        alone = _collect(engine, world, [n], seed=len(n) + int(n[-1]), **knobs)
        engine.run_until_idle()
        want[n] = [t for d in alone[n] for t in d.token_ids]
    real = step_sample.sample

    def batch_fails(*args):
        raise RuntimeError("batched draw fault")

    def one_fails(params, logits, generator):
        if params.seed == 99:
            raise RuntimeError("draw fault")
        return real(params, logits, generator)

    monkeypatch.setattr(step_sample, "sample_rows", batch_fails)
    monkeypatch.setattr(step_sample, "sample", one_fails)
    out = {n: [] for n in ("good1", "bad", "good2")}
    for n in out:
        engine.submit(n, world["tok"](PROMPTS[0]).input_ids,
                      SamplingParams(max_tokens=NEW, seed=99 if n == "bad" else len(n) + int(n[-1]), **knobs),
                      out[n].append)
    engine.run_until_idle()
    assert out["bad"][-1].finish_reason == "error" and "draw fault" in out["bad"][-1].error
    for n in ("good1", "good2"):
        assert [t for d in out[n] for t in d.token_ids] == want[n] and out[n][-1].finish_reason == "length"
    assert engine.dead is None


def test_an_engine_that_keeps_failing_turns_unhealthy_and_answers_everyone(world):
    from moeflow.serving.engine import EngineDead

    engine = make_engine(world, names=(), failures_before_unhealthy=4)

    def broken(*_a, **_k):
        raise RuntimeError("device lost")

    engine.core.runner.run = broken
    out = _collect(engine, world, [f"r{i}" for i in range(10)])  # all queued before the engine can die
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while not all(d and d[-1].finish_reason for d in out.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(d[-1].finish_reason == "error" for d in out.values())
        assert engine.dead and "device lost" in engine.dead
        with pytest.raises(EngineDead):
            engine.health()
        with pytest.raises(EngineDead):
            engine.submit("late", [1, 2, 3], SamplingParams(max_tokens=2), lambda d: None)
        assert not engine.core.running and not engine.core.waiting
    finally:
        engine.stop()


def test_idle_engine_thread_sleeps_and_queue_limits_refuse(world):
    import psutil

    from moeflow.serving.engine import EngineBusy

    engine = make_engine(world, names=(), max_waiting_seqs=2)
    ids = world["tok"](PROMPTS[0]).input_ids
    engine.submit("q1", ids, SamplingParams(max_tokens=2), lambda d: None)
    engine.submit("q2", ids, SamplingParams(max_tokens=2), lambda d: None)
    with pytest.raises(EngineBusy):
        engine.submit("q3", ids, SamplingParams(max_tokens=2), lambda d: None)
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while (engine.core.running or engine.core.waiting or engine.limits.queued_seqs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.limits.queued_seqs == 0 and engine.limits.queued_tokens == 0
        thread = next(t for t in psutil.Process().threads() if t.id == engine.core._thread.native_id)
        time.sleep(1.0)
        after = next(t for t in psutil.Process().threads() if t.id == engine.core._thread.native_id)
        assert (after.user_time + after.system_time) - (thread.user_time + thread.system_time) < 0.05
    finally:
        engine.stop()


def test_sampling_params_are_checked_as_computed():
    from moeflow.serving.sampling import sample

    for bad in (dict(top_p=0), dict(temperature=float("nan")), dict(stop=[""]), dict(seed=2 ** 64),
                dict(max_tokens=True), dict(logprobs=21), dict(temperature=-1)):
        with pytest.raises(UserError):
            SamplingParams(**bad).check()
    logits = torch.randn(64)
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1.0, top_p=1e-46)):
        params.check()
        assert sample(params, logits, torch.Generator().manual_seed(0)) == int(logits.argmax())
    for seed in (-(2 ** 63), 2 ** 64 - 1):
        SamplingParams(seed=seed).check()
