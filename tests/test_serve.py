"""The live Ray Serve app through the official `openai` client: base + two adapters,
greedy outputs equal to transformers `generate`, chat, streaming, runtime adapter
load/unload with path safety, the error codes, metrics and expert load."""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from moeflow.serving.app import ServeSettings, free_port, start
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model

pytestmark = pytest.mark.integration

KEY = "test-key-123"
PROMPTS = ["reverse: abc\nanswer:", "Hello, how are you?"]
CHAT = [{"role": "user", "content": "reverse: kqzm"}]
NEW = 8


def _reference(base, adapter_dir, tok, chat_ids) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter_dir:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    out = {}
    for key, ids in [(p, tok(p).input_ids) for p in PROMPTS] + [("chat", chat_ids)]:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        out[key] = tok.decode(gen[0, len(ids):], skip_special_tokens=True)
    return out


@pytest.fixture(scope="module")
def server(ray_local, tmp_path_factory):
    """One Serve app for the module: tiny Qwen3-MoE, adapters a1/a2, a3 loadable at run time."""
    from ray import serve
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("serve")
    base = build_debug_model("qwen3_moe", root / "tiny-moe")
    adapters = {n: make_lora_adapter(base, root / "adapters" / n, seed=i + 1) for i, n in
                enumerate(("a1", "a2", "a3"))}
    tok = AutoTokenizer.from_pretrained(str(base))
    chat_ids = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
    refs = {name: _reference(base, adapters.get(name), tok, chat_ids) for name in ("tiny-moe", "a1", "a2", "a3")}
    settings = ServeSettings(base_dir=str(base), adapters={"a1": str(adapters["a1"]), "a2": str(adapters["a2"])},
                             adapter_root=str(root / "adapters"), api_key=KEY,
                             engine={"max_loras": 2, "max_num_batched_tokens": 32})
    url = start(settings, port=free_port())
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield {"url": url, "client": client, "refs": refs, "root": root, "base": base}
    serve.shutdown()


def _complete(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0, **kw)


def test_models_lists_base_and_adapters_with_parent(server):
    models = {m.id: m for m in server["client"].models.list().data}
    assert set(models) == {"tiny-moe", "a1", "a2"}
    assert models["a1"].parent == "tiny-moe" and models["tiny-moe"].parent is None


def test_greedy_completions_equal_generate_per_adapter(server):
    client, refs = server["client"], server["refs"]
    texts = {}
    for model in ("tiny-moe", "a1", "a2", "tiny-moe:a2"):
        for prompt in PROMPTS:
            r = _complete(client, model, prompt)
            name = model.split(":")[-1]
            assert r.choices[0].text == refs[name][prompt], (model, prompt)
            assert r.model == name and r.usage.completion_tokens <= NEW
            texts[name, prompt] = r.choices[0].text
    assert len({texts[m, PROMPTS[0]] for m in ("tiny-moe", "a1", "a2")}) == 3


def test_concurrent_mixed_adapter_requests(server):
    client, refs = server["client"], server["refs"]
    jobs = [(m, p) for m in ("tiny-moe", "a1", "a2") for p in PROMPTS] * 2
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _complete(client, *job).choices[0].text, jobs))
    for (m, p), text in zip(jobs, results):
        assert text == refs[m][p], (m, p)


def test_chat_and_streaming(server):
    client, refs = server["client"], server["refs"]
    r = client.chat.completions.create(model="a1", messages=CHAT, max_tokens=NEW, temperature=0)
    assert r.choices[0].message.content == refs["a1"]["chat"] and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="a1", messages=CHAT, max_tokens=NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == refs["a1"]["chat"]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    parts = list(client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                           stream=True))
    assert len(parts) > 1 and "".join(c.choices[0].text for c in parts) == refs["a2"][PROMPTS[0]]
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


def test_echo_logprobs_for_lm_eval(server):
    r = server["client"].completions.create(model="tiny-moe", prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                            echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPTS[0])
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])  # distinct ids may decode alike


def test_bad_requests_get_codes_and_server_keeps_serving(server):
    url, client = server["url"], server["client"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{url}/v1/models").status_code == 401
    with pytest.raises(openai.NotFoundError, match="a1, a2"):
        _complete(client, "nope", "x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        _complete(client, "a1", "hello " * 600)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="a1", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="images are not supported: model tiny-moe is served as a text model"):
        client.chat.completions.create(model="a1", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", json={"model": "a1", "prompt": "x", "temperature": "hot"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(f"{url}/v1/completions", json={"model": "a1", "prompt": [999999]}, headers=auth)
    assert r.status_code == 400
    assert _complete(client, "a1", PROMPTS[0]).choices[0].text == server["refs"]["a1"][PROMPTS[0]]


def test_runtime_adapter_load_unload_and_path_safety(server):
    url, client, root = server["url"], server["client"], server["root"]
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(server["base"])},
                   headers=auth)
    assert r.status_code == 400 and "outside the adapter root" in r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(root / "adapters/a3")},
                   headers=auth)
    assert r.status_code == 200, r.text
    assert "a3" in {m.id for m in client.models.list().data}
    # max_loras=2: using a3, a1, a2 in turn evicts and reloads, output unchanged
    for name in ("a3", "a1", "a2", "a3"):
        assert _complete(client, name, PROMPTS[1]).choices[0].text == server["refs"][name][PROMPTS[1]]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=auth)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a3", "x")
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=auth)
    assert r.status_code == 404
    # an adapter made for another base: refused before PEFT touches the serving model
    wrong = root / "adapters" / "wrong"
    shutil.copytree(root / "adapters" / "a3", wrong)
    tensors = load_file(wrong / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], 32)
    save_file(tensors, wrong / "adapter_model.safetensors")
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "wrong", "lora_path": "wrong"}, headers=auth)
    assert r.status_code == 400 and "q_proj" in r.text
    assert _complete(client, "a1", PROMPTS[1]).choices[0].text == server["refs"]["a1"][PROMPTS[1]]


def test_metrics_and_expert_load_after_traffic(server):
    url = server["url"]
    _complete(server["client"], "a2", PROMPTS[0])
    text = httpx.get(f"{url}/metrics").text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "num_requests_running", "num_requests_waiting", "prompt_tokens_total",
                 "generation_tokens_total"):
        assert f'moeflow_{name}{{model_name="a2"}}' in text, name
    load = httpx.get(f"{url}/v1/expert_load", headers={"Authorization": f"Bearer {KEY}"}).json()
    counts = torch.tensor(load["counts"])
    assert counts.shape == (2, 8) and int(counts.sum()) > 0
    assert counts[0].sum() == counts[1].sum()  # every token passes every MoE layer
    assert 'moeflow_expert_balancedness{layer="0"}' in httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/health").text == "ok"
