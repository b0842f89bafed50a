"""The finetune stage at tensor_parallel=2 (2 gloo Ray Train workers, tiny Qwen3-MoE):
the base loads TP-sharded (every rank's parameter bytes equal the plan's), LoRA (attention
and experts) trains on the shards (moeflow.training.tp_lora), checkpoints and the final adapter are gathered to
the standard TP=1 PEFT layout. That adapter, on one device, reproduces the TP-trained
model's logits and serves the same completions in regress's runner, in the serving
engine and in plain PEFT `generate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_finetune_stage import PLAN, make_assets, make_config, make_ctx, start_run

TP2 = {**PLAN, "tensor_parallel": 2, "data_parallel": 1}
PROMPTS = ["add 3 4 =", "reverse abc =", "copy hello ="]
NEW = 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("ftp"))


def test_tp2_plan_bytes_split_the_model(assets):
    from moeflow.training.driver import planned_bytes

    whole = planned_bytes(PLAN, assets["converted"], "float32", 2)
    tp = planned_bytes(TP2, assets["converted"], "float32", 2)
    assert tp[0] < whole[0] and tp[1] < whole[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tp2_adapter_loads_and_serves_like_one_device(assets, tmp_path, ray_local):
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeflow.evaluation.runners import HFRunner
    from moeflow.serving.adapters import AdapterRegistry, make_spec
    from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
    from moeflow.serving.metrics import ExpertLoad, ServingMetrics
    from moeflow.training.driver import planned_bytes
    from tasks.finetune import run

    cfg = make_config(assets, tmp_path, lora={"target_modules": ["attention", "experts"]},
                      finetune={"max_steps": 4, "checkpoint_every": 2, "max_eval_examples": 2})
    run_id = start_run(cfg.tracking.uri, tmp_path)
    rec = run(make_ctx(cfg, assets, tmp_path / "out", run_id, plan=TP2))
    params = MlflowClient(tracking_uri=cfg.tracking.uri).get_run(run_id).data.params
    assert params["experts_implementation"] == "split_lora"  # TP-sharded experts train split
    m = rec["metrics"]
    planned = planned_bytes(TP2, assets["converted"], "float32", 2)
    for r in range(2):  # TP-sharded as planned, exactly
        assert m[f"plan/rank{r}/measured_bytes"] == m[f"plan/rank{r}/planned_bytes"] == planned[r]
    assert m["step"] == 4

    adapter = Path(rec["adapter_dir"])
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["base_model_name_or_path"] == str(assets["original"])
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    q_b = next(v for k, v in tensors.items() if k.endswith("layers.0.self_attn.q_proj.lora_B.weight"))
    o_a = next(v for k, v in tensors.items() if k.endswith("layers.0.self_attn.o_proj.lora_A.weight"))
    assert q_b.shape == (64, 4) and o_a.shape == (4, 64)  # whole, as a TP=1 adapter
    # expert LoRA (8 experts, moe_intermediate 32, hidden 64): PEFT's [r·E, in] / [out, r·E]
    experts = {k: v for k, v in tensors.items() if ".layers.0.mlp.experts." in k}
    assert sorted(tuple(v.shape) for v in experts.values()) == [(32, 32), (32, 64), (64, 32),
                                                                 (64, 32)], experts.keys()
    assert all(v.abs().sum() > 0 for v in experts.values())  # B trained too

    tok = AutoTokenizer.from_pretrained(assets["original"])
    base = AutoModelForCausalLM.from_pretrained(assets["original"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    probe = load_file(rec["probe_path"])  # logits of the TP-sharded model at the end of training
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
        with model.disable_adapter():
            base_logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)
    assert (base_logits - probe["logits"]).abs().max() > 1e-3  # the adapter changed something

    def until_eos(ids: list[int]) -> list[int]:
        return ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids

    want = []  # plain PEFT greedy generate on one device, to the first EOS
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        want.append(until_eos(out[0, ids.shape[1]:].tolist()))

    runner = HFRunner(assets["original"])  # regress's runner
    runner.attach_adapter(adapter)
    assert [d["output_ids"] for d in runner.generate_detail(PROMPTS, NEW)] == want

    engine_model = AutoModelForCausalLM.from_pretrained(assets["original"], dtype=torch.float32)
    reg = AdapterRegistry(tmp_path / "served")  # deploy's engine
    reg.add(make_spec("tp2", str(adapter)))
    metrics = ServingMetrics()
    engine = Engine(engine_model, tok, EngineConfig(), reg, metrics,
                    ExpertLoad(engine_model, window_steps=4, registry=metrics.registry))
    served: dict[int, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        served[i] = []
        engine.submit(f"r{i}", tok(p).input_ids, SamplingParams(max_tokens=NEW),
                      lambda d, i=i: served[i].extend(d.token_ids), adapter="tp2")
    engine.run_until_idle()
    assert [until_eos(served[i]) for i in range(len(PROMPTS))] == want


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tp2_run_killed_after_a_checkpoint_resumes_to_the_same_adapter(assets, tmp_path, ray_local):
    """A TP=2 run with attention and expert LoRA whose rank-1 worker is killed once Ray Train
    has registered a checkpoint resumes from it (each rank takes its piece of the whole
    adapter and AdamW moments) and ends on the adapter an uninterrupted run trains."""
    import threading
    import time

    from safetensors.torch import load_file

    from tasks.finetune import run
    from tests.test_finetune_slow import _kill_rank1_after

    def train(out: Path, kill: bool) -> tuple[dict, dict]:
        cfg = make_config(assets, tmp_path, lora={"target_modules": ["attention", "experts"]},
                          finetune={"max_steps": 40, "checkpoint_every": 4, "max_failures": 2,
                                    "max_eval_examples": 2})
        killed: dict = {}
        killer = threading.Thread(target=_kill_rank1_after, args=(out, killed, time.time() + 900))
        if kill:
            killer.start()
        rec = run(make_ctx(cfg, assets, out, plan=TP2))
        if kill:
            killer.join()
            assert killed, "the worker was never killed"
        return rec, killed

    whole, _ = train(tmp_path / "whole", kill=False)
    resumed, killed = train(tmp_path / "resumed", kill=True)
    m = resumed["metrics"]
    assert m["step"] == 40 and m.get("restarts") == 1, m
    assert 4 <= m["resumed_from_step"] <= killed["step"] and m["resumed_from_step"] % 4 == 0
    a = load_file(str(Path(whole["adapter_dir"]) / "adapter_model.safetensors"))
    b = load_file(str(Path(resumed["adapter_dir"]) / "adapter_model.safetensors"))
    assert set(a) == set(b) and any("experts" in k for k in a)
    for k in a:
        assert a[k].shape == b[k].shape, k
        rel = float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-20))
        assert rel < 1e-5, (k, rel)
    assert abs(whole["metrics"]["train_loss"] - m["train_loss"]) <= 1e-5 * abs(m["train_loss"])
