"""Image inputs for image-text MoE models: `image_url` chat parts through the
model's processor, M-RoPE positions per request, images never split by
chunked prefill; greedy output equals transformers `generate` on the
processor's inputs (Qwen3-VL-MoE and ERNIE-4.5-VL-MoE, base and adapter),
and over HTTP with the openai client against a live Ray Serve app."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import openai
import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.model.multimodal import decode_image, load_processor, prepare
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow_testing.serving import make_lora_adapter
from moeflow_testing.tiny import build_debug_model

NEW = 10
KEY = "mm-key"


def _image(seed: int, size=(32, 48)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def _data_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(n_images: int = 1) -> list[dict]:
    parts = [{"type": "text", "text": "look at"}]
    for _ in range(n_images):
        parts += [{"type": "image"}, {"type": "text", "text": " and"}]
    parts.append({"type": "text", "text": " say what it is"})
    return [{"role": "user", "content": parts}]


def _load(base):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32).eval()
    return model, tok, load_processor(base, tok)


def _generate(model, proc, text, images) -> list[int]:
    enc = proc(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module", params=["qwen3_vl_moe", "ernie4_5_vl_moe"])
def vl(request, tmp_path_factory):
    torch.set_num_threads(1)
    base = build_debug_model(request.param, tmp_path_factory.mktemp(request.param) / "base")
    model, tok, proc = _load(base)
    return {"family": request.param, "base": base, "model": model, "tok": tok, "proc": proc}


def _run(engine, requests) -> dict:
    """requests: {key: (ids, image or None)} -> {key: generated ids}; checks that
    no prefill chunk ever ends inside an image."""
    out = {k: [] for k in requests}
    seqs = {}
    for key, (ids, image) in requests.items():
        engine.submit(key, ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                      lambda d, k=key: out[k].extend(d.token_ids), image=image)
        seqs[key] = image
    engine.core._drain_inbox()
    while engine.core.waiting or engine.core.running:
        engine.core.step()
        for seq in engine.core.running:
            if seq.image is not None:
                assert not any(s < seq.num_cached < e for s, e in seq.image.spans), "image split"
        engine.core._drain_inbox()
    engine.run_until_idle()  # nothing left to run: emits the steps' outputs to the sinks
    return out


def test_image_chat_greedy_equals_generate_with_chunked_prefill(vl):
    model, tok, proc = vl["model"], vl["tok"], vl["proc"]
    text = tok.apply_chat_template(_messages(2), tokenize=False, add_generation_prompt=True)
    images = [_image(0), _image(1, (40, 24))]
    ids, image = prepare(proc, model, text, images)
    assert len(image.spans) == 2 and image.positions is not None and image.rope_delta < 0
    ref = _generate(model, proc, text, images)
    plain = tok("hello there friend").input_ids
    with torch.no_grad():
        ref_plain = model.generate(input_ids=torch.tensor([plain]), max_new_tokens=NEW,
                                   min_new_tokens=NEW, do_sample=False)[0, len(plain):].tolist()
    # budget 8 < an image's tokens: text is chunked around the images, each image taken whole;
    # the text-only request decodes in the same batches (M-RoPE offsets differ per row)
    for budget in (512, 8):
        engine = Engine(model, tok, EngineConfig(max_num_batched_tokens=budget))
        out = _run(engine, {"img": (ids, image), "txt": (plain, None)})
        assert out["img"] == ref, (budget, out["img"], ref)
        assert out["txt"] == ref_plain, budget


def test_the_image_matters(vl):
    """Another image gives other tokens: pixels reach the model (not just placeholders)."""
    model, tok, proc = vl["model"], vl["tok"], vl["proc"]
    text = tok.apply_chat_template(_messages(1), tokenize=False, add_generation_prompt=True)
    engine = Engine(model, tok, EngineConfig())
    reqs = {}
    for seed in (0, 7):
        reqs[seed] = prepare(proc, model, text, [_image(seed)])
    out = _run(engine, reqs)
    assert out[0] == _generate(model, proc, text, [_image(0)])
    assert out[7] == _generate(model, proc, text, [_image(7)])
    assert out[0] != out[7]


def test_adapter_with_images_equals_peft_generate(vl, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from moeflow.serving.adapters import AdapterRegistry, make_spec

    model, tok, proc = vl["model"], vl["tok"], vl["proc"]
    adapter = make_lora_adapter(vl["base"], tmp_path / "adapters" / "a1", seed=1)
    text = tok.apply_chat_template(_messages(1), tokenize=False, add_generation_prompt=True)
    images = [_image(3)]
    ref_model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(str(vl["base"]), dtype=torch.float32), str(adapter)).eval()
    ref = _generate(ref_model, proc, text, images)
    base_model = _load(vl["base"])[0]
    reg = AdapterRegistry(tmp_path / "adapters")
    reg.add(make_spec("a1", adapter))
    engine = Engine(base_model, tok, EngineConfig(max_num_batched_tokens=8), reg)
    ids, image = prepare(proc, base_model, text, images)
    out = {"a": [], "b": []}
    engine.submit("a", ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                  lambda d: out["a"].extend(d.token_ids), adapter="a1", image=image)
    engine.submit("b", ids, SamplingParams(max_tokens=NEW, ignore_eos=True),
                  lambda d: out["b"].extend(d.token_ids), image=image)
    engine.run_until_idle()
    assert out["a"] == ref
    assert out["b"] == _generate(model, proc, text, images)
    assert out["a"] != out["b"]


def test_decode_image_refuses_bad_uris():
    good = _data_uri(_image(0))
    assert decode_image(good, "m").size == (48, 32)
    cases = {
        "https://example.com/cat.png": "only data: URIs",
        "data:image/png;base64,@@@": "invalid base64",
        "data:text/plain;base64,aGVsbG8=": "not an image",
        "data:image/png;base64," + base64.b64encode(b"not a png").decode(): "not a readable image",
        "data:image/png,rawbytes": "expected data:image",
    }
    for url, message in cases.items():
        with pytest.raises(UserError, match=message) as err:
            decode_image(url, "messages[0].content[1].image_url")
        assert "messages[0].content[1].image_url" in str(err.value)


def test_model_without_image_processor_explains_why(tmp_path):
    """Llama-4's image processor needs torchvision (not installable here): images get a
    clear refusal naming the cause."""
    from transformers import AutoTokenizer

    base = build_debug_model("llama4", tmp_path / "llama4")
    with pytest.raises(UserError, match="image processor"):
        load_processor(base, AutoTokenizer.from_pretrained(str(base)))


# ------------------------------------------------------------------ HTTP, Ray Serve


@pytest.fixture(scope="module")
def vl_server(ray_local, tmp_path_factory):
    from ray import serve

    from moeflow.serving.app import ServeSettings, free_port, start

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vlserve")
    base = build_debug_model("qwen3_vl_moe", root / "tiny-vl")
    settings = ServeSettings(base_dir=str(base), api_key=KEY, engine={"max_num_batched_tokens": 8})
    url = start(settings, port=free_port())
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield {"client": client, "base": base}
    serve.shutdown()


def _chat_parts(uri: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "look at"}, {"type": "image_url", "image_url": {"url": uri}},
        {"type": "text", "text": " and say what it is"}]}]


@pytest.mark.integration
def test_openai_client_image_chat_over_ray_serve(vl_server):
    client = vl_server["client"]
    model, tok, proc = _load(vl_server["base"])
    text = tok.apply_chat_template(_messages(1), tokenize=False, add_generation_prompt=True)
    expected = {}
    for seed in (0, 5):
        expected[seed] = tok.decode(_generate(model, proc, text, [_image(seed)]), skip_special_tokens=True)
        resp = client.chat.completions.create(model="tiny-vl", messages=_chat_parts(_data_uri(_image(seed))),
                                              max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
        assert resp.choices[0].message.content == expected[seed]
        assert resp.usage.prompt_tokens == len(proc(text=[text], images=[_image(seed)]).input_ids[0])
    assert expected[0] != expected[5]
    stream = client.chat.completions.create(model="tiny-vl", messages=_chat_parts(_data_uri(_image(0))),
                                            max_tokens=NEW, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[0]
    # text-only chat still works on the image-text model
    plain = client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
    assert plain.usage.completion_tokens >= 1


@pytest.mark.integration
def test_bad_images_get_400_and_server_keeps_serving(vl_server):
    client = vl_server["client"]
    for uri, message in [("https://example.com/a.png", "only data: URIs"),
                         ("data:image/png;base64,@@", "invalid base64"),
                         ("data:image/png;base64," + base64.b64encode(b"junk").decode(), "not a readable image")]:
        with pytest.raises(openai.BadRequestError, match=message) as err:
            client.chat.completions.create(model="tiny-vl", messages=_chat_parts(uri), max_tokens=4)
        assert "messages[0].content[1].image_url" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model="tiny-vl", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])
    ok = client.chat.completions.create(model="tiny-vl", messages=_chat_parts(_data_uri(_image(1))), max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_expert_load_counts_text_and_image_tokens(vl):
    """Every routed token is counted once per router; ERNIE-VL routes image tokens to its
    vision experts and text tokens to its text experts (two routers in one layer)."""
    from moeflow.serving.metrics import ExpertLoad, ServingMetrics

    model, tok, proc = vl["model"], vl["tok"], vl["proc"]
    metrics = ServingMetrics()
    experts = ExpertLoad(model, registry=metrics.registry)
    text = tok.apply_chat_template(_messages(1), tokenize=False, add_generation_prompt=True)
    ids, image = prepare(proc, model, text, [_image(0)])
    engine = Engine(model, tok, EngineConfig(max_num_batched_tokens=8), metrics=metrics, experts=experts)
    _run(engine, {"r": (ids, image)})
    seen = len(ids) + NEW - 1  # the last sampled token is never fed back
    n_image = sum(e - s for s, e in image.spans)
    counts = torch.tensor(experts.snapshot()["counts"]).sum(dim=1).tolist()  # per router
    names = experts.snapshot()["routers"]
    top_k = {n: m.top_k for n, m in model.named_modules() if n in names}
    if vl["family"] == "ernie4_5_vl_moe":
        # image tokens and their start/end markers go to the vision experts (moe_mm_token_type_ids)
        vision = int(image.extra["moe_mm_token_type_ids"].sum())
        assert vision == n_image + 2
        expect = [(seen - vision) * top_k[n] if "text_moe" in n else vision * top_k[n] for n in names]
        experts.flush()
        assert 'layer="1.vision_moe"' in metrics.render(experts.registry).decode()
    else:
        expect = [seen * top_k[n] for n in names]
    assert counts == expect and len(names) >= 2


def test_llama4_serves_text_with_router_counts(tmp_path):
    """Llama-4 loads as its causal-LM text model (moeflow/model/models.py: the class finetune trains
    adapters on), serves text and refuses images with the reason; Llama4Router returns
    logits, not indices: its top_k choice is counted."""
    from moeflow.serving.app import ServeSettings, Service
    from moeflow.serving.errors import RequestError

    base = build_debug_model("llama4", tmp_path / "llama4")
    service = Service(ServeSettings(base_dir=str(base), engine_process=False))
    try:
        assert type(service.engine.base).__name__ == "Llama4ForCausalLM"
        with pytest.raises(RequestError, match="served as a text model"):
            service.chat_prompt(_chat_parts(_data_uri(_image(0))))
        ids, image = service.chat_prompt([{"role": "user", "content": "hello there"}])
        assert image is None
        done = []
        service.engine.submit("r", ids, SamplingParams(max_tokens=NEW, ignore_eos=True), done.append)
        for _ in range(600):
            if done and done[-1].finish_reason:
                break
            time.sleep(0.05)
        assert done[-1].finish_reason == "length"
        counts = torch.tensor(service.expert_load()["counts"])
        assert counts.shape == (2, 4)
        assert counts.sum(dim=1).tolist() == [len(ids) + NEW - 1] * 2  # top-1 routing
    finally:
        service.close()


def test_vision_tower_lora_in_batched_mode(tmp_path):
    """An adapter that also adapts the vision tower (its attention `qkv`): the batched-LoRA
    hook sees [patches, I] inputs there and applies the sequence's own adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    from moeflow.serving.adapters import AdapterRegistry, make_spec

    base = build_debug_model("qwen3_vl_moe", tmp_path / "vl")
    model, tok, proc = _load(base)
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32),
                          LoraConfig(r=4, target_modules=["q_proj", "qkv"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft.save_pretrained(str(tmp_path / "adapters" / "vis"))
    assert any(".visual." in n and "lora_A" in n for n, _ in peft.named_parameters())
    text = tok.apply_chat_template(_messages(1), tokenize=False, add_generation_prompt=True)
    ref = _generate(PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(
        str(base), dtype=torch.float32), str(tmp_path / "adapters" / "vis")).eval(), proc, text, [_image(2)])
    reg = AdapterRegistry(tmp_path / "adapters")
    reg.add(make_spec("vis", tmp_path / "adapters" / "vis"))
    engine = Engine(model, tok, EngineConfig(), reg)
    ids, image = prepare(proc, model, text, [_image(2)])
    out: list[int] = []
    engine.submit("v", ids, SamplingParams(max_tokens=NEW, ignore_eos=True), lambda d: out.extend(d.token_ids),
                  adapter="vis", image=image)
    engine.run_until_idle()
    assert engine.core.runner.lora_mode() == "batched"
    assert out == ref
