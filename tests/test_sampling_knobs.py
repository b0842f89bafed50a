"""vLLM's sampling knobs, each against transformers' own logits processor on the same logits:
top_k (TopKLogitsWarper), min_p (MinPLogitsWarper), repetition_penalty
(RepetitionPenaltyLogitsProcessor), min_tokens (MinNewTokensLengthLogitsProcessor);
presence/frequency penalties against OpenAI's formula (transformers has no processor for them).
Then through the HTTP API: the knobs change the output, `n` gives n choices, unknown fields
and OpenAI's cross-field rules are 400s naming the field, and /tokenize, /detokenize,
/version, GET /v1/models/{id} answer as vLLM's do."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from moeflow.core.errors import UserError
from moeflow.serving.sampling import (
    CPU_GROUP_LOGITS,
    TOP_P_FIRST,
    SamplingParams,
    distribution,
    draw,
    greedy_and_finite,
    make_generator,
    penalise,
    sample,
    sample_rows,
)

V = 50


def _logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def _probs(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1)


def _norm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()


def test_draw_follows_the_probabilities_and_never_picks_a_zero():
    """The inverse-CDF draw: 40,000 seeded draws from unnormalised probabilities land in
    proportion (each count within 5 standard deviations), a zero is never drawn, and one seed
    draws the same tokens again."""
    probs = torch.tensor([0.0, 1.5, 0.6, 0.0, 0.45, 0.3, 0.15, 0.0])  # sums to 3.0
    g = torch.Generator().manual_seed(11)
    n = 40_000
    counts = Counter(draw(probs, g) for _ in range(n))
    assert set(counts) == {1, 2, 4, 5, 6}
    for tok, p in enumerate((probs / probs.sum()).tolist()):
        assert abs(counts[tok] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5 + 1e-9, (tok, counts[tok], n * p)
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [draw(probs, a) for _ in range(50)] == [draw(probs, b) for _ in range(50)]


@pytest.mark.parametrize("vocab", [V, 4 * TOP_P_FIRST, CPU_GROUP_LOGITS // 4])  # the last: groups of 4 rows
def test_sample_rows_draws_what_each_row_draws_alone(vocab):
    """A step's sampled rows drawn together (`sample_rows`) give each seeded row the token `sample`
    gives it alone, under every knob and mix of knobs, peaked and flat logits (top_p's first
    tokens and its whole sort), in one group of rows or several."""
    rows = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9),
            SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3, min_p=0.05),
            SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01),
            SamplingParams(temperature=0.5, top_p=0.3)]
    for trial in range(60):
        spread = 3 if trial % 2 else 0.3
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(trial)) * spread
        together = sample_rows(rows, logits, [make_generator(100 * trial + i) for i in range(len(rows))])
        alone = [sample(p, logits[i], make_generator(100 * trial + i)) for i, p in enumerate(rows)]
        assert together == alone, trial


def test_draw_when_the_uniform_number_rounds_up_to_the_sum(monkeypatch):
    """u x the sum rounded up to the sum: the last token with mass, not a zero after it."""
    probs = torch.tensor([0.3, 0.7, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=k.get("dtype", torch.float32)))
    assert draw(probs, None) == 1


@pytest.mark.parametrize("peak", [8.0, 0.05])  # most mass in the first TOP_P_FIRST tokens; spread past them
def test_top_p_among_the_first_tokens_equals_the_whole_sort(peak):
    """top_p looks among the TOP_P_FIRST most likely tokens first and sorts the whole vocabulary
    only when they hold less than top_p: the kept probabilities equal a whole sort's either way."""
    v = 4 * TOP_P_FIRST
    logits = torch.randn(v, generator=torch.Generator().manual_seed(3)) * peak
    params = SamplingParams(temperature=1.0, top_p=0.9)
    probs = torch.softmax(logits, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
    keep[0] = True
    want = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    got = distribution(params, logits)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    first = float(torch.topk(probs, TOP_P_FIRST).values.sum())
    assert (first >= 0.9) == (peak > 1.0)  # both paths are taken


def test_greedy_and_finite_fails_a_row_whose_largest_logit_is_not_finite():
    """NaN anywhere (even last), +inf anywhere, or a row of -inf fails the row; a -inf beside
    finite logits (a masked token) and huge finite logits do not; the argmax is each row's."""
    rows = torch.randn(7, V)
    rows[1, 3] = float("inf")
    rows[2, 7] = float("-inf")
    rows[3, V - 1] = float("nan")
    rows[4] = 3e38
    rows[5, 9] = 50.0
    rows[6] = float("-inf")
    greedy, finite = greedy_and_finite(rows)
    assert finite == [True, False, True, False, True, True, False]
    assert greedy[0] == int(torch.argmax(rows[0])) and greedy[2] == int(torch.argmax(rows[2])) and greedy[5] == 9


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_equals_transformers(k):
    logits = _logits(k)
    p = SamplingParams(temperature=0.7, top_k=k)
    hf = TemperatureLogitsWarper(0.7)(None, logits[None].clone())
    hf = TopKLogitsWarper(k)(None, hf)[0]
    assert torch.allclose(_norm(distribution(p, logits)), _probs(hf), atol=1e-6)
    assert int((distribution(p, logits) > 0).sum()) == k


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_equals_transformers(min_p):
    logits = _logits(3)
    p = SamplingParams(temperature=1.3, min_p=min_p)
    hf = TemperatureLogitsWarper(1.3)(None, logits[None].clone())
    hf = MinPLogitsWarper(min_p)(None, hf)[0]
    assert torch.allclose(_norm(distribution(p, logits)), _probs(hf), atol=1e-6)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = _logits(4)
    tokens = [3, 7, 7, 11, 40, 3, 2]  # prompt and output: vLLM penalises both, as transformers does
    p = SamplingParams(temperature=0, repetition_penalty=penalty)
    ours = penalise(p, logits, tokens, num_prompt=4)
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), logits[None].clone())[0]
    assert torch.allclose(ours, hf, atol=1e-6)
    assert torch.equal(logits, _logits(4))  # the raw logits are kept (logprobs are of those)


def test_min_tokens_equals_transformers():
    logits = _logits(5)
    eos = {2, 9}
    p = SamplingParams(temperature=0, max_tokens=8, min_tokens=3)
    for generated in (0, 2, 3):
        tokens = [5, 6, 7, 8] + [1] * generated
        ours = penalise(p, logits, tokens, num_prompt=4, eos_ids=eos)
        hf = MinNewTokensLengthLogitsProcessor(4, 3, sorted(eos))(torch.tensor([tokens]), logits[None].clone())[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(hf)), generated
        assert torch.allclose(ours[torch.isfinite(ours)], hf[torch.isfinite(hf)])


def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = _logits(6)
    tokens = [1, 2, 3] + [4, 4, 4, 5, 1]
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    ours = penalise(p, logits, tokens, num_prompt=3)
    want = logits.clone()
    for tok, count in Counter(tokens[3:]).items():  # output tokens only
        want[tok] -= count * 0.25 + 0.5
    assert torch.allclose(ours, want)


def test_bounds_are_checked_as_computed():
    for bad in ({"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"presence_penalty": 2.5},
                {"frequency_penalty": -3.0}, {"min_tokens": 9, "max_tokens": 8}):
        with pytest.raises(UserError, match=next(iter(bad))):
            SamplingParams(**bad).check()


# ---------------------------------------------------------------- through the API


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from moeflow.serving.app import ServeSettings, free_port
    from moeflow_testing.serving import LocalServer, make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("knobs")
    base = build_debug_model("qwen3_moe", root / "m")
    make_lora_adapter(base, root / "a1", seed=1)
    with LocalServer(ServeSettings(base_dir=str(base), served_model_name="m", adapters={"a1": str(root / "a1")}),
                     free_port()) as server:
        yield server.url


BODY = {"model": "m", "prompt": "reverse: abc\nanswer:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


@pytest.mark.integration
def test_knobs_change_greedy_output_and_n_gives_n_choices(api):
    plain = _post(api, "/v1/completions", BODY).json()["choices"][0]["text"]
    rep = _post(api, "/v1/completions", dict(BODY, repetition_penalty=2.0, frequency_penalty=2.0)).json()
    assert rep["choices"][0]["text"] != plain  # penalties apply to greedy decoding too
    eos = _post(api, "/v1/completions", dict(BODY, ignore_eos=False, min_tokens=12)).json()
    assert eos["usage"]["completion_tokens"] == 12
    n = _post(api, "/v1/completions", dict(BODY, temperature=1.0, top_k=20, min_p=0.05, n=3, seed=7,
                                           prompt=["a", "b"])).json()
    assert [c["index"] for c in n["choices"]] == [0, 1, 2, 3, 4, 5]
    assert len({c["text"] for c in n["choices"][:3]}) > 1  # seeds s, s+1, s+2
    again = _post(api, "/v1/completions", dict(BODY, temperature=1.0, top_k=20, min_p=0.05, n=3, seed=7,
                                               prompt=["a", "b"])).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in n["choices"]]
    chat = _post(api, "/v1/chat/completions", {"model": "a1", "n": 2, "max_tokens": 4, "temperature": 1.0,
                                                "seed": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and [c["index"] for c in chat.json()["choices"]] == [0, 1]
    with httpx.stream("POST", api + "/v1/chat/completions", timeout=60,
                      json={"model": "m", "n": 2, "max_tokens": 3, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as r:
        text = "".join(r.iter_lines())
    assert r.status_code == 200 and '"index": 1' in text and "[DONE]" in text


@pytest.mark.integration
@pytest.mark.parametrize("path,extra,field", [
    ("/v1/completions", {"guided_json": {}}, "guided_json"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"min_tokens": 20}, "min_tokens"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"n": 40, "prompt": ["a", "b"]}, "n"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"bad_words": ["x"]}, "bad_words"),
])
def test_unknown_fields_and_cross_field_rules_are_400_naming_the_field(api, path, extra, field):
    body = dict(BODY) if path == "/v1/completions" else {
        "model": "m", "max_tokens": 12, "messages": [{"role": "user", "content": "hi"}]}
    r = _post(api, path, dict(body, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"], r.text


@pytest.mark.integration
def test_tokenize_detokenize_version_and_one_model(api):
    tok = _post(api, "/tokenize", {"model": "m", "prompt": "reverse: abc"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    assert _post(api, "/detokenize", {"model": "m", "tokens": tok["tokens"]}).json() == {"prompt": "reverse: abc"}
    chat = _post(api, "/tokenize", {"model": "a1", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0
    assert _post(api, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert _post(api, "/detokenize", {"model": "m", "tokens": [10 ** 9]}).status_code == 400
    assert httpx.get(api + "/version").json()["version"]
    one = httpx.get(api + "/v1/models/a1").json()
    assert one["id"] == "a1" and one["parent"] == "m"
    missing = httpx.get(api + "/v1/models/zzz")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
