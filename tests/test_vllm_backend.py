"""`deploy.backend: vllm`: the Ray Serve LLM config of a run, validated against Ray's own
LLMConfig model on CPU (vLLM is not installed here), for the demo model (attention LoRA as
LoRA, fused expert LoRA as LoRA from its per-expert export, or merged) and for DeepSeek-V3
on 2 x 8 x H100 (TP 8, EP 16)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import typer
import yaml
from typer.testing import CliRunner

from moeflow.core.config import to_yaml, validate
from moeflow.core.errors import UserError
from moeflow.serving import vllm_backend as V
from tasks.base import StageContext
from workflows.commands.deploy import register

ROOT = Path(__file__).resolve().parents[1]
LORA_URI = "s3://moeflow-test/adapters"


def _plan(tmp_path: Path, model_dir: Path, **sections) -> dict:
    """The real plan stage's record for `model_dir`."""
    from tasks.plan import run

    raw = {"model": {"path": "/ckpt/demo-model", "dtype": "float32"}, "hardware": "cpu-local",
           "data": {"seq_len": 64}, "lora": {"rank": 8}}
    raw.update(sections)
    out = tmp_path / "plan"
    out.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(stage="plan", config=validate(raw), out_dir=out,
                       inputs={"convert": {"output_dir": str(model_dir)}})
    return run(ctx)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint, an attention adapter and an expert (target_parameters) one."""
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    root = tmp_path_factory.mktemp("vllm")
    model = build_debug_model("qwen3_moe", root / "model")
    attn = make_lora_adapter(model, root / "attn", rank=8)
    experts = make_lora_adapter(model, root / "experts", rank=4, experts=True)
    return {"root": root, "model": Path(model), "attn": attn, "experts": experts}


def test_llmconfig_is_pinned_and_a_move_fails_clearly(monkeypatch):
    cls = V.llm_config_class()
    assert cls.__module__ == V.LLMCONFIG_MODULE and "engine_kwargs" in cls.model_fields
    monkeypatch.setattr(V, "LLMCONFIG_MODULE", "ray.llm._internal.serve.moved_away")
    with pytest.raises(UserError, match="no LLMConfig at ray.llm._internal.serve.moved_away"):
        V.llm_config_class()


def test_adapter_decisions_state_why(demo):
    adapters = {"demo": str(demo["attn"]), "experts": str(demo["experts"])}
    dec = {d.name: d for d in V.decide_adapters(adapters, expert_parallel=True, lora_uri=LORA_URI)}
    assert dec["demo"].served == "lora" and dec["demo"].uri == f"{LORA_URI}/demo"
    assert dec["experts"].served == "merged" and "expert parallelism" in dec["experts"].why
    # without EP, fused expert LoRA is served as LoRA, from its per-expert export (build writes it)
    (experts,) = V.decide_adapters({"experts": str(demo["experts"])}, False, LORA_URI)
    assert experts.served == "lora" and "exported per expert" in experts.why
    with pytest.raises(UserError, match="deploy.lora_uri: .*only from s3/gs/abfss/azure.*unset"):
        V.decide_adapters({"demo": str(demo["attn"])}, False, None)
    with pytest.raises(UserError, match="'/mnt/a' is not one"):
        V.decide_adapters({"demo": str(demo["attn"])}, False, "/mnt/a")
    # expert LoRA on per-expert modules: vLLM runs it, but not under expert parallelism
    mod = demo["root"] / "mod"
    mod.mkdir(exist_ok=True)
    (mod / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["experts.0.w1"]}))
    assert V.decide_adapters({"m": str(mod)}, True, LORA_URI)[0].served == "merged"
    assert V.decide_adapters({"m": str(mod)}, False, LORA_URI)[0].served == "lora"
    with pytest.raises(UserError, match="no adapter_config.json"):
        V.adapter_kind(demo["root"])


def test_demo_run_dry_run_config_validates(tmp_path, demo):
    """The deploy stage (dry run) on the demo model: TP/EP/DP from the plan, LoRA + merged."""
    from tasks.deploy import run

    plan = _plan(tmp_path, demo["model"], plan={"batch": 4})
    vplan = plan["plan"]["serving"]["vllm"]
    cfg = validate({"model": {"path": "/ckpt/demo-model", "dtype": "float32"},
                    "deploy": {"backend": "vllm", "dry_run": True, "lora_uri": LORA_URI,
                               "max_num_seqs": 8}})
    out = tmp_path / "deploy"
    out.mkdir()
    ft = {"adapter_dir": str(demo["attn"]), "adapter_name": "demo",
          "adapters": {"experts": {"adapter_dir": str(demo["experts"]), "tenant": True}}}
    tuned = tmp_path / "serving.yaml"  # the serving stage's choice; deploy.max_num_seqs set: it wins
    tuned.write_text("max_num_seqs: 32\nmax_num_batched_tokens: 96\n")
    ctx = StageContext(stage="deploy", config=cfg, out_dir=out,
                       inputs={"convert": {"output_dir": str(demo["model"])}, "plan": plan,
                               "finetune": ft, "regress": {"passed": True},
                               "serving": {"serving_yaml": str(tuned)}})
    rec = run(ctx)
    assert rec["deployed"] is False and rec["backend"] == "vllm"
    conf = yaml.safe_load(Path(rec["serve_config"]).read_text())
    (base,) = V.validate_serve_config(conf)  # Ray's LLMConfig model
    kw = base.engine_kwargs
    assert kw["tensor_parallel_size"] == vplan["tensor_parallel"] == vplan["tensor_parallel_size"]
    assert kw["enable_expert_parallel"] == (vplan["expert_parallel"] > 1)
    assert kw["pipeline_parallel_size"] == vplan["pipeline_parallel"] and kw["max_num_seqs"] == 8
    assert kw["max_num_batched_tokens"] == 96  # the serving stage's serving.yaml, as the local backend
    assert kw["enable_lora"] and kw["max_lora_rank"] == 8 and kw["max_loras"] == cfg.deploy.max_loras
    assert base.model_id == "demo-model" and base.lora_config.dynamic_lora_loading_path == LORA_URI
    # the fused expert adapter goes up as its per-expert export (what vLLM's MoE LoRA loads)
    export = out / "vllm-lora" / "experts"
    assert rec["uploads"] == {str(demo["attn"]): f"{LORA_URI}/demo",
                              str(export.resolve()): f"{LORA_URI}/experts"}
    conf = json.loads((export / "adapter_config.json").read_text())
    assert not conf["target_parameters"] and "gate_proj" in conf["target_modules"]
    assert any("demo: served as demo-model:demo" in n for n in rec["notes"])
    assert any("experts: served as demo-model:experts" in n and "exported per expert" in n for n in rec["notes"])
    with pytest.raises(UserError, match="regress"):
        run(StageContext(stage="deploy", config=cfg, out_dir=out,
                         inputs={**ctx.inputs, "regress": {"passed": False}}))


def test_deepseek_v3_on_2x8_h100_tp8_ep16(tmp_path):
    """DeepSeek-V3 planned for vLLM on 2 nodes of 8 x H100 with TP 8, EP 16: FP8 weights
    (bf16 does not fit), one engine spanning both nodes (engine DP 2)."""
    model = tmp_path / "deepseek-v3"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "configs/models/deepseek-v3.json").read_text())
    plan = _plan(tmp_path, model, hardware={"spec": "h100-80g-x8", "nodes": 2},
                 model={"path": "/models/DeepSeek-V3", "dtype": "bfloat16"},
                 plan={"mode": "inference", "runtime": "vllm", "batch": 32, "context": 8192,
                       "weight_dtype": "fp8"},
                 parallel={"tensor_parallel": 8, "expert_parallel": 16})
    vplan = plan["plan"]["serving"]["vllm"]
    assert (vplan["tensor_parallel"], vplan["expert_parallel"], vplan["data_parallel"]) == (8, 16, 2)
    assert vplan["weight_dtype"] == "fp8" and "bf16" in vplan["why_dtype"]
    cfg = validate({"model": {"path": "/models/DeepSeek-V3"}, "deploy": {"backend": "vllm"}})
    built = V.build(cfg, str(model), plan["plan"]["serving"], {}, tmp_path)
    (obj,) = V.validate_serve_config(built["serve_config"])
    app = built["serve_config"]["applications"][0]
    assert app["import_path"] == V.DP_OPENAI_APP
    kw = obj.engine_kwargs
    assert (kw["tensor_parallel_size"], kw["data_parallel_size"], kw["enable_expert_parallel"]) == (8, 2, True)
    assert obj.accelerator_type == "H100" and obj.deployment_config["num_replicas"] == 1
    assert "enable_lora" not in kw and "max_num_seqs" in kw
    # the published checkpoint is FP8 already: vLLM reads its quantization_config
    assert "quantization" not in kw and any("checkpoint's own fp8" in n for n in built["notes"])
    cfg_json = json.loads((model / "config.json").read_text())
    del cfg_json["quantization_config"]  # a bf16 checkpoint: vLLM quantises it as it loads
    (model / "config.json").write_text(json.dumps(cfg_json))
    built = V.build(cfg, str(model), plan["plan"]["serving"], {}, tmp_path)
    assert V.validate_serve_config(built["serve_config"])[0].engine_kwargs["quantization"] == "fp8"


def test_cli_dry_run_of_a_pipeline_run(tmp_path, demo):
    """`moeflow deploy --run RID --backend vllm --dry-run` reads the run's records from MLflow."""
    from moeflow.core import tracking as T

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    cfg = validate({"model": {"path": "/ckpt/demo-model", "dtype": "float32"},
                    "tracking": {"uri": uri}})
    parent = client.create_run(exp, tags={T.KIND: "pipeline"}).info.run_id
    client.log_text(parent, to_yaml(cfg), "config.yaml")
    records = {"convert": {"output_dir": str(demo["model"])},
               "plan": _plan(tmp_path, demo["model"]),
               "finetune": {"adapter_dir": str(demo["attn"]), "adapter_name": "demo"}}
    for stage, record in records.items():
        out = tmp_path / f"rec-{stage}"
        out.mkdir()
        (out / "result.json").write_text(json.dumps(record))
        child = client.create_run(exp, tags={T.PARENT: parent, T.STAGE: stage, T.OUT_DIR: str(out)}).info.run_id
        client.set_tag(parent, T.STAGE_RUN_PREFIX + stage, child)
        client.set_tag(parent, T.STATE_PREFIX + stage, "done")
    target = tmp_path / "serve.yaml"
    app = typer.Typer()
    register(app)
    args = ["deploy", "--run", parent, "--backend", "vllm", "--dry-run", "--out", str(target),
            "--tracking-uri", uri]
    res = CliRunner().invoke(app, args)
    assert isinstance(res.exception, UserError) and "deploy.lora_uri" in str(res.exception)
    assert not target.exists()
    res = CliRunner().invoke(app, args + ["--lora-uri", LORA_URI])
    assert res.exit_code == 0, res.output
    assert "vllm plan: TP" in res.output and "demo: served as demo-model:demo" in res.output
    (obj,) = V.validate_serve_config(yaml.safe_load(target.read_text()))
    assert obj.engine_kwargs["enable_lora"] and obj.model_id == "demo-model"


def test_with_the_workdir_in_a_store_replicas_load_checkpoints_from_it(tmp_path, demo, monkeypatch):
    """Base and merged checkpoints are named by store URI (Ray Serve LLM's cloud mirror), never
    by a path on the deploying node; the merged one goes up to the stage's output in the store
    (a real S3-compatible server) before the app would start."""
    from moeflow.core import storage
    from tasks.deploy import run
    from tests.s3server import BUCKET, s3_server

    plan = _plan(tmp_path, demo["model"], plan={"batch": 4})
    cfg = validate({"model": {"path": "/ckpt/demo-model", "dtype": "float32"},
                    "deploy": {"backend": "vllm", "dry_run": True, "lora_uri": LORA_URI, "merge": True}})
    out = tmp_path / "deploy"
    out.mkdir()
    work = f"s3://{BUCKET}/work/run1"
    ft = {"adapter_dir": str(demo["experts"]), "adapter_name": "experts",
          "adapters": {"demo": {"adapter_dir": str(demo["attn"]), "tenant": True}}}
    ctx = StageContext(stage="deploy", config=cfg, out_dir=out, store_dir=f"{work}/deploy-1",
                       stored={str(demo["model"]): f"{work}/convert-1/model"},
                       inputs={"convert": {"output_dir": str(demo["model"])}, "plan": plan,
                               "finetune": ft, "regress": {"passed": True}})
    rec = run(ctx)
    objs = V.validate_serve_config(yaml.safe_load(Path(rec["serve_config"]).read_text()))
    base, merged = objs[0].model_loading_config, objs[1].model_loading_config
    assert base.model_source.bucket_uri == f"{work}/convert-1/model"
    assert merged.model_source.bucket_uri == f"{work}/deploy-1/merged/experts"
    assert V.model_source(str(tmp_path / "elsewhere")) == str((tmp_path / "elsewhere").resolve())
    monkeypatch.setenv("MOEFLOW_SCRATCH", str(tmp_path / "scratch"))
    with s3_server() as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert V.upload_merged({"adapters": rec["adapters"]}, out, f"{work}/deploy-1") == \
            [f"{work}/deploy-1/merged/experts"]
        files = storage.read_manifest(f"{work}/deploy-1/merged/experts")[0]["files"]
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)


def test_adapter_tiers_reach_vllm_and_pinning_a_lora_adapter_is_refused(tmp_path, demo):
    """deploy.max_cpu_loras is vLLM's max_cpu_loras and Ray Serve LLM's adapters per replica
    (Ray's LLMConfig validates them); deploy.pinned_adapters of an adapter served as LoRA is
    refused in one line naming the field, before any adapter is merged (Ray Serve LLM cannot
    pin); a pinned adapter served merged is a model of its own and accepted."""
    serving = _plan(tmp_path, demo["model"])["plan"]["serving"]
    adapters = {"demo": str(demo["attn"]), "experts": str(demo["experts"])}

    def build(out: str, merge: str | None = None, **deploy):
        cfg = validate({"model": {"path": "/ckpt/demo-model", "dtype": "float32"},
                        "deploy": {"backend": "vllm", "lora_uri": LORA_URI, "max_loras": 2, **deploy}})
        return V.build(cfg, str(demo["model"]), serving, adapters, tmp_path / out, merge=merge)

    (base,) = V.validate_serve_config(build("tiers", max_cpu_loras=12)["serve_config"])
    assert base.engine_kwargs["max_loras"] == 2 and base.engine_kwargs["max_cpu_loras"] == 12
    assert base.lora_config.max_num_adapters_per_replica == 12
    (base,) = V.validate_serve_config(build("default")["serve_config"])
    assert base.engine_kwargs["max_cpu_loras"] == 8  # unset: 4 x max_loras, as on the local backend
    with pytest.raises(UserError, match=r"^deploy.pinned_adapters: the vllm backend cannot pin demo \(served as LoRA"):
        build("pin-lora", merge="experts", pinned_adapters=["demo"])
    assert not (tmp_path / "pin-lora").exists()  # refused before the merge of "experts" ran
    with pytest.raises(UserError, match=r"^deploy.pinned_adapters: 'nope' is not a served adapter"):
        build("pin-unknown", pinned_adapters=["nope"])
    built = build("pin-merged", merge="experts", pinned_adapters=["experts"])
    base, merged = V.validate_serve_config(built["serve_config"])
    assert merged.model_id == "experts" and "max_cpu_loras" not in merged.engine_kwargs
    assert any(n.startswith("experts: pinned, and resident") for n in built["notes"])
    with pytest.raises(UserError, match=r"deploy.max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        V.engine_kwargs(serving["vllm"], {**V.engine_settings(validate({"model": {"path": "/m"}})),
                                          "max_loras": 2}, "float32", None, [8], 0.9, 1)
