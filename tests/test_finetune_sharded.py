"""The finetune stage executing sharded plans: FSDP=2, and EP=2 inside FSDP=2
(attention LoRA), over 2 gloo Ray Train workers on a tiny qwen3_moe.

The base is loaded per the plan (transformers DistributedConfig: FSDP2 and
expert parallelism), every rank's loaded parameter bytes must equal the plan's,
and the adapter saved from the sharded run must load on the ORIGINAL checkpoint
and reproduce the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow.core.errors import UserError
from tests.test_finetune_stage import PLAN, make_assets, make_config, make_ctx, start_run

FSDP2 = {**PLAN, "fsdp": 2}
EP2_FSDP2 = {**PLAN, "fsdp": 2, "expert_parallel": 2}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("fts"))


def test_planned_bytes_differ_between_plans(assets):
    from moeflow.training.driver import planned_bytes

    whole = planned_bytes(PLAN, assets["converted"], "float32", 2)
    fsdp = planned_bytes(FSDP2, assets["converted"], "float32", 2)
    ep = planned_bytes(EP2_FSDP2, assets["converted"], "float32", 2)
    assert whole[0] == whole[1] and sum(fsdp) == whole[0]  # FSDP2 splits the model in two
    assert sum(ep) == whole[0]


@pytest.mark.parametrize("plan, lora, match", [
    ({**FSDP2, "fsdp": 4, "num_workers": 4, "data_parallel": 4, "expert_parallel": 8},
     None, "expert_parallel=8 must divide fsdp=4"),
    ({**FSDP2, "num_workers": 4, "data_parallel": 4}, None, "no HSDP"),
    (EP2_FSDP2, {"target_modules": ["attention", "experts"]}, "expert LoRA on an EP-sharded"),
])
def test_unsupported_sharded_plans_refused(assets, tmp_path, plan, lora, match):
    from tasks.finetune import run

    cfg = make_config(assets, tmp_path, **({"lora": lora} if lora else {}))
    with pytest.raises(UserError, match=match):
        run(make_ctx(cfg, assets, tmp_path / "out", plan=plan))
    assert not (tmp_path / "out" / "adapter").exists()


def planner_record(assets: dict, tmp: Path, parallel: dict) -> dict:
    """The plan stage's `plan` record on cpu-local for explicit degrees."""
    import tasks.plan
    from moeflow.core.config import validate
    from tasks.base import StageContext

    raw = {"model": {"path": str(assets["original"]), "dtype": "float32"},
           "hardware": "cpu-local", "data": {"seq_len": 64}, "lora": {"rank": 4},
           "parallel": parallel}
    out = tmp / "plan"
    out.mkdir(parents=True)
    return tasks.plan.run(StageContext(stage="plan", config=validate(raw), out_dir=out,
                                       inputs={"convert": {"output_dir": str(assets["converted"])}})
                          )["plan"]


@pytest.mark.slow
@pytest.mark.parametrize("plan, targets", [
    (FSDP2, ["attention"]), ("planner-ep2", ["attention"]), (FSDP2, ["attention", "experts"])],
    ids=["fsdp2", "planner-ep2-fsdp2", "fsdp2-expert-lora"])
def test_sharded_plan_trains_a_loadable_adapter(assets, tmp_path, ray_local, plan, targets):
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moeflow.training.driver import planned_bytes
    from tasks.finetune import run

    if plan == "planner-ep2":  # what the plan stage tells finetune on this machine
        plan = planner_record(assets, tmp_path, {"expert_parallel": 2})
        assert (plan["expert_parallel"], plan["fsdp"], plan["num_workers"]) == (2, 2, 2)
    cfg = make_config(assets, tmp_path, lora={"target_modules": targets},
                      finetune={"max_steps": 4, "checkpoint_every": 2})
    run_id = start_run(cfg.tracking.uri, tmp_path)
    rec = run(make_ctx(cfg, assets, tmp_path / "out", run_id, plan=plan))
    m = rec["metrics"]
    planned = planned_bytes(plan, assets["converted"], "float32", 2)
    for r in range(2):  # the plan against reality, exactly
        assert m[f"plan/rank{r}/measured_bytes"] == m[f"plan/rank{r}/planned_bytes"] == planned[r]
    assert m["step"] == 4 and m["comm_bytes_per_step"] == m["lora_bytes"]
    assert m["peak_rss_bytes"] > sum(planned)
    if "memory_per_device_gb" in plan:  # the estimate is logged next to the measurement
        assert m["plan_peak_bytes"] == plan["memory_per_device_gb"] * 1e9
    logged = MlflowClient(tracking_uri=cfg.tracking.uri).get_run(run_id).data.metrics
    assert logged["plan/rank1/measured_bytes"] == planned[1] and "peak_rss_bytes" in logged

    adapter = Path(rec["adapter_dir"])
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(assets["original"])
    base = AutoModelForCausalLM.from_pretrained(assets["original"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    probe = load_file(rec["probe_path"])
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
        with model.disable_adapter():
            base_logits = model(input_ids=probe["input_ids"]).logits  # [1, S, V]
    torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=1e-4)
    assert (base_logits - probe["logits"]).abs().max() > 1e-3
