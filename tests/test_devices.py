"""Device resolution (moeflow/core/devices.py) on CPU: the GPU branches are exercised by
faking what torch / Ray report, the real GPU path by benchmarks/gpu_check.sh."""

from __future__ import annotations

import pytest
import ray
import torch

from moeflow.core import devices
from moeflow.core.errors import UserError


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports one bf16-capable CUDA device; Ray is not initialised."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def test_cpu_defaults_are_float32_gloo_and_no_gpu_requests():
    if devices.cuda_available():
        pytest.skip("this machine has a GPU; the CPU defaults are checked elsewhere")
    assert devices.local_device() == torch.device("cpu")
    assert devices.resolve_dtype("auto", "cpu") is torch.float32
    assert devices.resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert devices.dist_backend(False) == "gloo"
    assert devices.gpus_per_worker("auto") == 0.0
    assert devices.want_gpu("auto") is False
    assert devices.describe()["dtype"] == "float32"


def test_gpu_defaults_are_bf16_nccl_and_one_gpu(fake_gpu, monkeypatch):
    assert devices.local_device() == torch.device("cuda", 0)
    assert devices.resolve_dtype("auto", "cuda") is torch.bfloat16
    assert devices.resolve_dtype("float32", "cuda") is torch.float32  # explicit wins
    assert devices.dist_backend(True) == "nccl"
    assert devices.want_gpu("auto") is True and devices.gpus_per_worker("auto") == 1.0
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert devices.resolve_dtype("auto", "cuda") is torch.float16  # pre-Ampere GPUs


def test_ray_resources_decide_gpu_requests(monkeypatch):
    """With Ray up, the cluster's GPUs decide (not the driver's own torch.cuda)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    assert devices.cluster_gpus() == 8.0 and devices.want_gpu("auto") is True
    assert devices.want_gpu("auto", workers=8) is True
    assert devices.want_gpu("auto", workers=16) is False  # 16 workers would wait for 8 GPUs forever
    assert devices.gpus_per_worker("auto") == 1.0 and devices.gpus_per_worker(0.5) == 0.5
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    assert devices.want_gpu("auto") is False and devices.gpus_per_worker("auto") == 0.0
    assert devices.want_gpu(True) is True and devices.gpus_per_worker(True) == 1.0
    assert devices.want_gpu(False) is False


def test_a_ray_worker_without_assigned_gpus_stays_on_cpu(fake_gpu, monkeypatch):
    """On a GPU host, a task Ray gave no GPU must not grab cuda:0 (another task owns it)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(devices, "_in_ray_worker", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert devices.local_device() == torch.device("cpu")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # what Ray sets for that task -> cuda:0
    assert devices.local_device() == torch.device("cuda", 0)


def test_a_ray_train_worker_uses_its_own_gpu_of_a_shared_list(fake_gpu, monkeypatch):
    """Ray Train's workers on one node share CUDA_VISIBLE_DEVICES (all 8 GPUs): worker 3's
    GPU is cuda:3 there; cuda:0 would put all 8 on GPU 0 (NCCL: duplicate GPU)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(devices, "_in_ray_worker", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    assert devices.local_device() == torch.device("cuda", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a node's second half, ids as strings
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["6", "7"])
    assert devices.local_device() == torch.device("cuda", 2)
    assert devices.local_device(1) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="assigned this worker 2 GPU"):
        devices.local_device(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # overridden behind Ray's back
    with pytest.raises(RuntimeError, match="does not list it"):
        devices.local_device()


def test_inputs_and_generators_follow_the_device():
    model = torch.nn.Linear(2, 2)
    dev = devices.model_device(model)
    moved = devices.to_device({"ids": torch.ones(1, 2), "cache": None, "n": 3}, dev)
    assert moved["ids"].device == dev and moved["cache"] is None and moved["n"] == 3
    gen = devices.seeded_generator(7, dev)
    assert gen.device == dev
    a = torch.multinomial(torch.ones(10), 3, generator=gen)
    assert torch.equal(a, torch.multinomial(torch.ones(10), 3, generator=devices.seeded_generator(7, dev)))
    assert devices.model_device(torch.nn.ReLU()) == torch.device("cpu")


def test_bad_dtype_is_one_line():
    with pytest.raises(UserError, match="dtype must be auto or one of"):
        devices.resolve_dtype("float64", "cpu")
