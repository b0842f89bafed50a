"""The deployment decision (moeflow.serving.deployment.decide): which checkpoint, which adapters,
merged or not, in what precision -- pure (config + stage records in, a frozen Deployment out),
the one copy the deploy stage, `moeflow deploy` / `serve` and the vLLM backend use."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from moeflow.core.config import validate
from moeflow.core.errors import UserError
from moeflow.serving.deployment import decide

CONVERT = {"output_dir": "/w/convert"}
FINETUNE = {"adapter_dir": "/w/ft/adapter", "adapter_name": "demo",
            "adapters": {"demo": {"adapter_dir": "/w/ft/adapter", "tenant": False},
                         "rev": {"adapter_dir": "/w/ft/rev", "tenant": True}}}


def _cfg(**deploy):
    return validate({"model": {"path": "/ckpt/Qwen3-tiny", "dtype": "bfloat16"}, "deploy": deploy})


def test_a_run_serves_its_converted_checkpoint_and_every_adapter_in_order():
    ops = {"experts_implementation": {"training": "grouped_mm", "serving": "eager"}, "ep_size": 2}
    dep = decide(_cfg(adapters={"extra": "models:/x/3"}),
                 {"convert": CONVERT, "finetune": FINETUNE, "operators": ops})
    assert (dep.backend, dep.checkpoint, dep.weights) == ("local", "/w/convert", "converted")
    assert dep.adapter == ("demo", "/w/ft/adapter")
    assert list(dep.adapters.items()) == [("demo", "/w/ft/adapter"), ("rev", "/w/ft/rev"),
                                          ("extra", "models:/x/3")]
    assert dep.merge is None and dep.mode == "shared" and dep.merged_dirs == {}
    assert dep.served_model_name == "Qwen3-tiny"  # the original's name, not "convert"
    assert (dep.dtype, dep.merge_dtype) == ("auto", "bfloat16")
    assert (dep.experts_implementation, dep.ep_size) == ("eager", 2)
    bare = decide(_cfg(served_model_name="svc"), {"convert": CONVERT})
    assert bare.adapter is None and bare.adapters == {} and bare.served_model_name == "svc"
    assert (bare.experts_implementation, bare.ep_size) == (None, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bare.checkpoint = "/elsewhere"  # type: ignore[misc]  # frozen: the point of the check


def test_a_registered_adapter_without_a_dir_is_served_by_its_version():
    ft = {"adapter_name": "demo", "registered_model": "demo-adapter", "model_version": "4"}
    assert decide(_cfg(), {"convert": CONVERT, "finetune": ft}).adapters == {"demo": "models:/demo-adapter/4"}
    with pytest.raises(UserError, match="adapter 'demo': models:/demo-adapter/4 — the vllm backend"):
        decide(_cfg(backend="vllm"), {"convert": CONVERT, "finetune": ft})
    with pytest.raises(UserError, match="deploy.adapters.x: models:/x/3 — the vllm backend reads"):
        decide(_cfg(backend="vllm", adapters={"x": "models:/x/3"}), {"convert": CONVERT})


def test_one_name_with_two_sources_is_refused_the_same_source_is_not():
    same = decide(_cfg(adapters={"demo": "/w/ft/adapter"}), {"convert": CONVERT, "finetune": FINETUNE})
    assert same.adapters["demo"] == "/w/ft/adapter"
    with pytest.raises(UserError, match=r"deploy.adapters.demo: /other -- the run's adapter 'demo' is /w/ft/adapter"):
        decide(_cfg(adapters={"demo": "/other"}), {"convert": CONVERT, "finetune": FINETUNE})


def test_merge_names_the_fine_tuned_adapter_or_fails():
    ft = dict(FINETUNE, merged_dir="/w/ft/merged")
    for backend in ("local", "vllm"):
        dep = decide(_cfg(merge=True, backend=backend), {"convert": CONVERT, "finetune": ft})
        assert dep.merge == "demo" and dep.mode == "merged" and dep.merged_dirs == {"demo": "/w/ft/merged"}
        with pytest.raises(UserError, match="deploy.merge: there is no fine-tuned adapter to merge"):
            decide(_cfg(merge=True, backend=backend, adapters={"a": "/a"}), {"convert": CONVERT})
    # `moeflow serve CONFIG --merge NAME`: no run, the named adapter
    assert decide(_cfg(merge=True, adapters={"a": "/a"}), {}, merge="a").merge == "a"


def test_calibrated_weights_need_a_checkpoint_the_server_can_load():
    cal = {"checkpoint": "/w/cal/quantized", "scheme": "int8"}
    with pytest.raises(UserError, match="int8 is not loadable by transformers"):
        decide(_cfg(weights="calibrated"), {"convert": CONVERT, "calibrate": cal})
    vllm = decide(_cfg(weights="calibrated", backend="vllm"), {"convert": CONVERT, "calibrate": cal})
    assert (vllm.checkpoint, vllm.weights) == ("/w/cal/quantized", "calibrated")  # vLLM runs W8A8
    fp8 = decide(_cfg(weights="calibrated"), {"convert": CONVERT,
                                              "calibrate": {"checkpoint": "/q", "scheme": "fp8"}})
    assert fp8.checkpoint == "/q"
    for backend in ("local", "vllm"):
        with pytest.raises(UserError, match="needs the calibrate stage's result"):
            decide(_cfg(weights="calibrated", backend=backend), {"convert": CONVERT})
    # the serving stage tunes the local engine on the converted checkpoint whatever deploy says
    assert decide(_cfg(backend="vllm"), {"convert": CONVERT}, backend="local").backend == "local"


def test_without_a_run_model_path_is_served_as_given():
    dep = decide(_cfg(weights="calibrated", adapters={"a": "/a"}), {})
    assert (dep.checkpoint, dep.weights, dep.adapters) == ("/ckpt/Qwen3-tiny", "model", {"a": "/a"})


def test_serving_yaml_and_lora_uri_explicit_config_first_then_the_run():
    runs = {"convert": CONVERT, "serving": {"serving_yaml": "/w/serving/serving.yaml"},
            "finetune": dict(FINETUNE, lora_uri="s3://b/w/run/lora")}
    dep = decide(_cfg(), runs)
    assert (dep.serving_yaml, dep.lora_uri) == ("/w/serving/serving.yaml", "s3://b/w/run/lora")
    mine = decide(_cfg(serving_config="/mine.yaml", lora_uri="s3://mine"), runs)
    assert (mine.serving_yaml, mine.lora_uri) == ("/mine.yaml", "s3://mine")


def test_the_decision_loads_no_ray_mlflow_or_torch():
    code = ("import sys; from moeflow.core.config import validate; "
            "from moeflow.serving.deployment import decide; "
            "d = decide(validate({'model': {'path': '/m'}}), {'convert': {'output_dir': '/c'}, "
            "'finetune': {'adapter_dir': '/a'}}); "
            "print(d.checkpoint, sorted(m for m in ('ray', 'mlflow', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/c", "[]"]
