"""The rehearsal's serving and deploy stages (benchmarks/rehearse_serving.py): a float32
Qwen3-MoE of 4x one 150 MB device (cluster/hardware/cpu-budget-node8.yaml: 8 of them on a node,
as a CPU vLLM engine stays on one node) is planned on vLLM (deploy.backend auto) within the
budget per device, deployed through the vllm backend in the plan's TP / PP layout on Ray, each
vLLM worker's peak measured (its share, never the whole model), its greedy completions equal to
the local engine's on one device; and the vLLM plan's CPU rules (one node per engine, EP in TP,
the experts' padded width, tight devices). The vLLM deployment needs `make setup-vllm` (skips
naming it) and is slow (about 10 minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeflow.serving import vllm_run

# the rehearsal's engine (deploy.max_num_batched_tokens 512, max_num_seqs 2) and its checkpoint
# files of 10 MB (benchmarks/rehearse_serving.py SHARD), as moeflow.parallel.vllm_plan.vllm_engine reads them
ENGINE = {"max_num_batched_tokens": 512, "max_num_seqs": 2, "checkpoint_file_bytes": 9_859_040}


def _spec(tmp_path: Path, layers: int):
    """The served family's ModelSpec from its config.json alone (no weights written)."""
    from transformers import Qwen3MoeConfig

    from benchmarks.rehearse_serving import SERVED
    from moeflow.model.params import spec_from_path

    Qwen3MoeConfig(num_hidden_layers=layers, vocab_size=1024, **SERVED).save_pretrained(tmp_path)
    return spec_from_path(tmp_path)


NODE2 = Path(__file__).resolve().parents[1] / "cluster" / "hardware" / "cpu-budget.yaml"  # 2 devices a node


def test_the_vllm_plan_holds_float32_where_deploy_serves_float32(tmp_path):
    """deploy.dtype float32: vLLM holds float32 weights and KV cache, and the plan sizes them so
    (planning bf16 would put half the bytes on each device)."""
    from benchmarks.rehearse_serving import BUDGET_SPEC, SERVED_LAYERS
    from moeflow.core.hardware import load_hardware
    from moeflow.parallel.memory import Workload
    from moeflow.parallel.vllm_plan import vllm_serving_plan

    spec, hw = _spec(tmp_path, SERVED_LAYERS), load_hardware(str(BUDGET_SPEC))
    work = Workload(mode="inference", batch=2, context=512)
    wide = vllm_serving_plan(spec, hw, work, served_dtype="float32", engine=ENGINE)
    narrow = vllm_serving_plan(spec, hw, work, engine=ENGINE)
    assert wide["weight_dtype"] == "fp32" and narrow["weight_dtype"] == "bf16"
    assert "deploy.dtype float32" in wide["why_dtype"]
    assert wide["memory_per_device_gb"] * 1e9 <= hw.memory_bytes
    # float32 KV: twice the bytes of the bf16 plan's, per token on a device of the same layout
    assert wide["kv_cache_bytes_per_device"] > 0
    assert max(wide["tensor_parallel"], wide["pipeline_parallel"]) >= 2


def test_the_vllm_plan_counts_what_a_cpu_worker_holds_while_it_loads(tmp_path):
    """On a CPU device a vLLM worker also holds one layer's experts twice while its kernels
    repack them, and the pages of the checkpoint file it reads; activations are the engine's
    step (max_num_batched_tokens), not plan.prefill_chunk. Where that puts a layout over the
    device, the plan takes the next one; on a GPU neither is the device's memory."""
    from moeflow.core.hardware import load_hardware
    from moeflow.parallel.memory import Plan, Workload
    from moeflow.parallel.vllm_plan import vllm_serving_plan, worker_parts

    # 6 layers (186 MB): a TP2 engine on one node of cpu-budget's 2 devices
    spec, hw = _spec(tmp_path, 6), load_hardware(str(NODE2))
    work = Workload(mode="inference", batch=2, context=512, weight_dtype="fp32", kv_dtype="fp32",
                    act_dtype="fp32")
    parts = worker_parts(spec, hw, Plan(tp=2), work, ENGINE)
    # one layer's 16 experts (gate, up, down of 384 x 384) in float32, half on each TP rank
    assert parts["expert_repack"] == 16 * 3 * 384 * 384 * 4 / 2
    assert parts["checkpoint_file"] == ENGINE["checkpoint_file_bytes"]
    # no checkpoint on disk: convert's layout, one file per decoder layer (the whole layer)
    whole = worker_parts(spec, hw, Plan(tp=2), work, dict(ENGINE, checkpoint_file_bytes=0))
    assert whole["checkpoint_file"] > 2 * parts["expert_repack"]
    assert worker_parts(spec, load_hardware("h100-80g-x8"), Plan(tp=2), work, ENGINE) == {}
    v = vllm_serving_plan(spec, hw, work, served_dtype="float32", engine=ENGINE)
    assert v["tensor_parallel"] == 2 and v["memory_parts_mb"]["activations"] < 12  # 512 tokens a step
    assert set(parts) <= set(v["memory_parts_mb"])
    assert parts["expert_padding"] == 0  # 384 / 2 = 192 wide: a multiple of vLLM's 32
    # at TP8 each rank's experts are 48 wide, which vLLM's CPU kernels keep 64 wide (a third more)
    tp8 = worker_parts(spec, hw, Plan(tp=8), work, ENGINE)
    assert tp8["expert_padding"] == pytest.approx(6 * 16 * 3 * 384 * 48 * 4 / 3)
    assert tp8["expert_repack"] == pytest.approx(16 * 3 * 384 * 64 * 4)
    assert worker_parts(spec, hw, Plan(tp=8, ep=8), work, ENGINE)["expert_padding"] == 0  # EP: whole widths
    # a layer file per read puts TP2 over 150 MB: a node of 4 such devices takes a 4-way layout
    big = dict(ENGINE, checkpoint_file_bytes=0)
    assert vllm_serving_plan(spec, hw, work, served_dtype="float32", engine=big) is None
    node4 = hw.model_copy(update={"devices_per_node": 4, "hbd_size": 4})
    four = vllm_serving_plan(spec, node4, work, served_dtype="float32", engine=big)
    assert four["devices_per_replica"] == 4 and four["memory_per_device_gb"] * 1e9 <= hw.memory_bytes


def test_a_cpu_engine_stays_on_one_node_and_keeps_ep_inside_tp(tmp_path):
    """Ray Serve LLM runs vLLM's CPU build with its multiprocessing executor: one engine's workers
    share a node. The rehearsal's 4x model then has no vLLM plan on cpu-budget's nodes of 2, however
    many; on a node of 8 it has one whose engine fits that node, EP within TP (no engine DP). GPU
    specs keep engines across nodes."""
    from benchmarks.rehearse_serving import BUDGET_SPEC, SERVED_LAYERS
    from moeflow.core.hardware import load_hardware
    from moeflow.parallel.memory import Plan, Workload
    from moeflow.parallel.rules import WHY_CPU_ENGINE_DP, vllm_reason
    from moeflow.parallel.vllm_plan import vllm_serving_plan

    spec = _spec(tmp_path, SERVED_LAYERS)
    work = Workload(mode="inference", batch=2, context=512)
    node2, node8 = load_hardware(str(NODE2)), load_hardware(str(BUDGET_SPEC))
    assert node8.devices_per_node == 8 and node8.memory_bytes == node2.memory_bytes
    for nodes in (1, 4, 8):
        why: list[str] = []
        assert vllm_serving_plan(spec, node2.with_nodes(nodes), work, served_dtype="float32", engine=ENGINE,
                                 reasons=why) is None
        # the reason names the setting that fixes it: nodes of 5 devices or more
        assert "nodes of 5 or more devices would hold one (the hardware spec's devices_per_node, 2 here)" in why[0]
    v = vllm_serving_plan(spec, node8, work, served_dtype="float32", engine=ENGINE)
    assert v is not None and v["devices_per_replica"] <= 8 and v["data_parallel_size"] == 1
    assert v["expert_parallel"] <= v["tensor_parallel"] and v["memory_per_device_gb"] * 1e9 <= node8.memory_bytes
    infer = Workload(mode="inference")
    assert "multiprocessing executor" in vllm_reason(Plan(tp=2, pp=4), infer, node2.with_nodes(4))
    assert vllm_reason(Plan(tp=2, pp=4), infer, node8) is None
    assert vllm_reason(Plan(tp=2, ep=8, dp=4), infer, node8) == WHY_CPU_ENGINE_DP
    gpu = load_hardware("h100-80g-x8").with_nodes(2)
    assert vllm_reason(Plan(tp=8, pp=2), infer, gpu) is None
    assert vllm_reason(Plan(tp=8, ep=16, dp=2), infer, gpu) is None


def test_tight_cpu_workers_get_a_fixed_mmap_threshold(tmp_path, monkeypatch):
    """On a device under 4x the vLLM plan's figure, the workers run with glibc's mmap threshold
    fixed (their load temporaries go back to the OS); a roomy device and a GPU keep the default."""
    from benchmarks.rehearse_serving import BUDGET_SPEC, SERVED_LAYERS
    from moeflow.core.hardware import load_hardware
    from moeflow.parallel.memory import Workload
    from moeflow.parallel.vllm_plan import vllm_serving_plan

    spec, work = _spec(tmp_path, SERVED_LAYERS), Workload(mode="inference", batch=2, context=512)
    tight = vllm_serving_plan(spec, load_hardware(str(BUDGET_SPEC)), work, served_dtype="float32", engine=ENGINE)
    roomy = vllm_serving_plan(spec, load_hardware("cpu-local"), work, served_dtype="float32", engine=ENGINE)
    assert tight["tight_cpu"] is True and roomy["tight_cpu"] is False
    monkeypatch.setattr(vllm_run, "vllm_missing", lambda: None)
    assert vllm_run.runtime_env("cpu", tight=True)["env_vars"].items() >= vllm_run.TIGHT_ENV.items()
    for device, flag in (("cpu", False), ("gpu", True)):
        assert not set(vllm_run.runtime_env(device, tight=flag)["env_vars"]) & set(vllm_run.TIGHT_ENV)


def test_a_cpu_pipeline_engine_names_moeflows_worker_extension():
    """vLLM's CPU build runs an eager pipeline stage after the first only with the buffer
    moeflow.serving.vllm_worker makes: the vllm backend names it for CPU engines with PP > 1 (a
    caller's own extension, such as the rehearsal's meter, is kept: it carries the same fix)."""
    import os

    from moeflow.core.sections.deploy import DeploySection
    from moeflow.serving.vllm_backend import llm_config
    from moeflow.serving.vllm_worker import EXTENSION

    plan = {"num_replicas": 1}
    deploy = DeploySection()

    def kwargs(device: str, pp: int, **extra) -> dict:
        kw = {"tensor_parallel_size": 2, "pipeline_parallel_size": pp, "gpu_memory_utilization": 0.9, **extra}
        return llm_config("m", "/m", plan, kw, deploy, None, False, device=device)["engine_kwargs"]

    assert kwargs("cpu", 4)["worker_extension_cls"] == EXTENSION
    assert "worker_extension_cls" not in kwargs("cpu", 1)
    assert "worker_extension_cls" not in kwargs("gpu", 4)
    assert kwargs("cpu", 2, worker_extension_cls="x.Meter")["worker_extension_cls"] == "x.Meter"
    # vLLM's workers import it from this repository (the vLLM environment has no moeflow)
    repo = str(Path(__file__).resolve().parents[1])
    env = {"py_executable": "python", "env_vars": {}}
    app = {"args": {"llm_configs": [{"engine_kwargs": kwargs("cpu", 4)}]}}
    assert vllm_run.app_runtime_env(env, app, "cpu")["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == repo
    plain = {"args": {"llm_configs": [{"engine_kwargs": kwargs("cpu", 1)}]}}
    assert "PYTHONPATH" not in vllm_run.app_runtime_env(env, plain, "cpu")["env_vars"]
    module, _, name = EXTENSION.rpartition(".")
    import importlib

    assert hasattr(importlib.import_module(module), name)  # importable without vLLM: it patches nothing here


def test_workers_beyond_the_numa_nodes_get_cores_of_their_own(monkeypatch):
    """vLLM's CPU build refuses an engine of more local workers than NUMA nodes unless their
    threads are bound by hand: the vllm backend binds them, one range of cores each."""
    import os

    monkeypatch.delenv(vllm_run.BIND_ENV, raising=False)
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    workers = nodes + 1
    bind = vllm_run.cpu_binding(workers)
    ranges = [set(map(int, r.split(","))) for r in bind.split("|")]
    assert len(ranges) == workers and set().union(*ranges) <= set(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) >= workers:  # disjoint where there are cores enough
        assert sum(map(len, ranges)) == len(set().union(*ranges))
    # more workers than cores (the rehearsal's 8 on this host's 2): a core each, in turn
    many = len(os.sched_getaffinity(0)) + 3
    each = [r.split(",") for r in vllm_run.cpu_binding(many).split("|")]
    assert len(each) == many and all(len(r) == 1 for r in each)
    assert {int(r[0]) for r in each} == set(os.sched_getaffinity(0))
    assert vllm_run.cpu_binding(1) is None
    app = {"args": {"llm_configs": [{"engine_kwargs": {"tensor_parallel_size": workers}}]}}
    env = {"py_executable": "python", "env_vars": {"A": "1"}}
    assert vllm_run.app_runtime_env(env, app, "cpu")["env_vars"] == {"A": "1", vllm_run.BIND_ENV: bind}
    assert vllm_run.app_runtime_env(env, app, "gpu") is env
    monkeypatch.setenv(vllm_run.BIND_ENV, "0-3|4-7")  # the user's own: passed on as set (CPU_ENV)
    assert vllm_run.cpu_binding(workers) is None


@pytest.mark.slow  # vLLM engines of 8 workers (deploy's, 2 search candidates) and the local engine: ~10 min
@pytest.mark.timeout(2400)
@pytest.mark.skipif(bool(vllm_run.vllm_missing()), reason=str(vllm_run.vllm_missing()))
def test_serving_and_deploy_on_vllm_hold_a_device_share_and_equal_the_one_device_run(tmp_path):
    # no ray_local: the rehearsal starts a Ray of its own, a node of its spec's 8 devices
    from benchmarks.rehearse_serving import checks, open_items, rehearse, report

    rec = rehearse(tmp_path, search=True)
    print("\n".join(report(rec) + open_items(rec)))
    (tmp_path / "record.json").write_text(json.dumps(rec, indent=1))
    assert not checks(rec), checks(rec)
    assert rec["checkpoint_bytes"] > rec["budget_bytes"]
    assert rec["plan"]["backend"] == "vllm" and rec["deploy"]["backend"] == "vllm"
    workers = rec["deploy"]["workers"]
    # the checkpoint is 4x the device; each worker holds its share (at least half of an even
    # split of the checkpoint: the weights are in the peak), within the plan's figure per
    # device, which is within the device
    planned = rec["plan"]["vllm"]["memory_per_device_gb"] * 1e9
    assert rec["checkpoint_bytes"] >= 4 * rec["budget_bytes"]
    assert len(workers) >= 4 and planned <= rec["budget_bytes"]
    assert all(rec["checkpoint_bytes"] / (2 * len(workers)) < w["peak_bytes"] <= rec["budget_bytes"] for w in workers)
    assert all(w["peak_bytes"] <= 1.05 * planned for w in workers)  # the plan's figure, to 5%
    assert rec["completions_equal"]
    # the serving stage searched the vLLM layout deploy serves, candidates measured end to end
    run = rec["search"]["run"]
    assert run["backend"] == "vllm" and run["measured"] and all(c["completed"] for c in run["measured"])
