"""The plan against reality: load a real sharded checkpoint with transformers'
DistributedConfig over 2 gloo processes and compare each rank's parameter
elements with `planned_rank_numel` (slow: two spawned interpreters)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]

KWARGS = [{"fsdp_size": 2}, {"fsdp_size": 2, "ep_size": 2}]


def _worker(rank: int, world: int, path: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counts = []
    for kwargs in KWARGS:
        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(**kwargs), dtype=torch.float32)
        counts.append(sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                          for p in model.parameters()))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(counts, f)
    dist.destroy_process_group()


def test_loaded_rank_params_equal_the_plan(tmp_path):
    import torch.multiprocessing as mp

    from moeflow.model.params import spec_from_path
    from moeflow.parallel.memory import Plan, planned_rank_numel
    from moeflow.parallel.planner import distributed_config
    from moeflow_testing.tiny import build_debug_model

    path = tmp_path / "model"
    build_debug_model("qwen3_moe", path, dtype="float32")
    out = str(tmp_path / "numel")
    mp.spawn(_worker, args=(2, str(path), free_port(), out), nprocs=2)
    loaded = [json.load(open(f"{out}.{r}")) for r in range(2)]  # [rank][config]
    spec = spec_from_path(path)
    for i, plan in enumerate((Plan(dp=2, fsdp=2), Plan(dp=2, fsdp=2, ep=2))):
        dc = distributed_config(plan, "lora")  # what plan.json tells finetune to load with
        assert all(dc[k] == v for k, v in KWARGS[i].items())
        planned = [sum(planned_rank_numel(spec, plan, r).values()) for r in range(2)]
        assert [loaded[r][i] for r in range(2)] == planned
