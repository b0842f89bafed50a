"""Adapter tiers (moeflow/serving/adapter_tiers.py): host memory (LRU, max_cpu_loras), reads off
the engine's step, admission that skips sequences whose adapter is being read, prefetch from the
waiting queue, pinning, the tier metrics, adapters in an object store."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moeflow.core.errors import UserError
from moeflow.serving import adapter_tiers
from moeflow.serving.adapter_tiers import HostTier
from moeflow.serving.adapters import AdapterRegistry, make_spec, module_shapes
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
from moeflow.serving.metrics import ServingMetrics
from moeflow_testing.serving import IdTokenizer, make_lora_adapter, poison_adapter
from moeflow_testing.tiny import build_debug_model

PROMPT = [5, 6, 7, 8, 9]
NEW = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny Qwen3-MoE, six attention adapters and a poisoned one."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiers")
    base = build_debug_model("qwen3_moe", root / "base")
    paths = {f"a{i}": make_lora_adapter(base, root / "adapters" / f"a{i}", seed=i) for i in range(6)}
    paths["bad"] = poison_adapter(paths["a0"], root / "adapters" / "bad")
    return {"base": base, "paths": paths, "root": root}


def make_engine(world, names=None, metrics=None, **cfg):
    from moeflow.model.models import load_model

    reg = AdapterRegistry(world["root"] / "adapters")
    for n in names or world["paths"]:
        reg.add(make_spec(n, world["paths"][n]))
    cfg = {"max_loras": 2, **cfg}
    return Engine(load_model(world["base"], torch.float32), IdTokenizer(), EngineConfig(**cfg), reg, metrics)


def submit(engine, req_id, adapter, out, max_tokens=NEW):
    out[req_id] = []

    def sink(d):
        out[req_id].extend(d.token_ids)
        if d.finish_reason:
            out[req_id + ":end"] = d.error or d.finish_reason
    engine.submit(req_id, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True), sink, adapter=adapter)


def reference(world, adapter):
    """The tokens of PROMPT with `adapter` on an engine that had it resident before the request."""
    engine = make_engine(world, [adapter])
    engine.call(lambda: engine.core.tiers.load_now(engine.core.registry.get(adapter), set())).result()
    out = {}
    submit(engine, "r", adapter, out)
    engine.run_until_idle()
    return out["r"]


@pytest.fixture
def gated_reads(monkeypatch):
    """Reads from a source wait until the test opens the gate (the loader thread blocks)."""
    gate = threading.Event()
    real = adapter_tiers.read_held

    def slow(spec, shapes):
        assert gate.wait(30), "the gate was never opened"
        return real(spec, shapes)
    monkeypatch.setattr(adapter_tiers, "read_held", slow)
    yield gate
    gate.set()


def test_host_tier_keeps_at_most_its_capacity_lru_and_never_a_pinned_one(world):
    from moeflow.model.models import load_model

    shapes = module_shapes(load_model(world["base"], torch.float32))
    specs = {n: make_spec(n, p) for n, p in world["paths"].items()}
    host = HostTier(2, shapes, pinned=["a0"])
    for name in ("a0", "a1", "a2", "a3"):
        host.load_now(specs[name])
    assert sorted(host.held()) == ["a0", "a3"] and host.evictions == 2
    assert host.cold_loads == 4
    ready = threading.Event()
    host._on_ready = ready.set
    assert host.request(specs["a4"]) and not host.request(specs["a4"])  # queued once
    assert ready.wait(30)
    assert sorted(host.held()) == ["a0", "a4"]
    held = host.get("a4")
    assert held is not None and held.nbytes > 0 and set(held.tensors) and held.load_s > 0
    ready.clear()
    assert host.request(specs["bad"])
    assert ready.wait(30)
    failed = host.take_failures()
    assert "NaN" in failed["bad"] and host.take_failures() == {}
    host.close()


def test_a_burst_to_cold_adapters_does_not_stall_a_resident_one(world, gated_reads):
    engine = make_engine(world, max_loras=4, max_num_seqs=8)
    out = {}
    submit(engine, "warm", "a0", out)  # a0 resident (its read allowed once)
    gated_reads.set()
    engine.run_until_idle()
    gated_reads.clear()
    assert engine.core.slots.resident() == ["a0"]
    for i, name in enumerate(("a1", "a2", "a3")):  # cold: their reads block in the loader
        submit(engine, f"cold{i}", name, out, max_tokens=2)
    submit(engine, "hot", "a0", out)
    t0 = time.monotonic()
    for _ in range(NEW + 2):
        engine.core.iterate()  # takes the queued requests, one step, emits
    assert time.monotonic() - t0 < 10  # no step waited for a read
    assert out.get("hot:end") == "length" and len(out["hot"]) == NEW  # served while the cold ones wait
    assert all(not out[f"cold{i}"] for i in range(3))
    assert [s.req_id for s in engine.core.waiting] == ["cold0", "cold1", "cold2"]
    gated_reads.set()
    engine.run_until_idle()
    assert [out[f"cold{i}:end"] for i in range(3)] == ["length"] * 3
    assert out["cold0"] == reference(world, "a1")[:2]


def test_the_waiting_queue_is_read_ahead_into_host_memory_and_free_slots(world):
    engine = make_engine(world, max_loras=3, max_num_seqs=1)
    out = {}
    for i, name in enumerate(("a1", "a2", "a3")):
        submit(engine, f"r{i}", name, out, max_tokens=8)
    core = engine.core
    core._drain_inbox()
    deadline = time.monotonic() + 30
    while core.running == [] and time.monotonic() < deadline:  # r0 admitted once a1 is read
        core.step()
        time.sleep(0.01)
    assert [s.req_id for s in core.running] == ["r0"]
    while len(core.tiers.host.held()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    core.step()  # r1, r2 wait for the one running slot; their adapters are read ahead ...
    assert sorted(core.tiers.host.held()) == ["a1", "a2", "a3"]
    assert sorted(core.slots.resident()) == ["a1", "a2", "a3"]  # ... and made resident in the free slots
    assert [s.req_id for s in core.waiting] == ["r1", "r2"]
    engine.run_until_idle()
    assert core.tiers.stats().cold_loads == 3


def test_pinned_adapters_stay_resident_and_are_checked(world):
    metrics = ServingMetrics()
    engine = make_engine(world, metrics=metrics, max_loras=2, max_cpu_loras=2, pinned_adapters=("a5",))
    core = engine.core
    assert core.slots.resident() == ["a5"]  # resident from the start
    out = {}
    for i, name in enumerate(("a1", "a2", "a3", "a1", "a5")):
        submit(engine, f"r{i}", name, out, max_tokens=2)
        engine.run_until_idle()
        assert "a5" in core.slots.resident() and "a5" in core.tiers.host.held()
        assert out[f"r{i}:end"] == "length"
    stats = core.tiers.stats()
    assert stats.device_evictions == 3 and stats.host_evictions >= 2
    text = metrics.render().decode()
    assert 'moeflow_lora_evictions_total{tier="device"} 3.0' in text
    assert "moeflow_lora_cold_load_seconds_count 5.0" in text  # a5 at the start, a1, a2, a3, a1 again
    assert "moeflow_lora_adapters_host 2.0" in text
    with pytest.raises(UserError, match="not a served adapter"):
        make_engine(world, ["a1"], pinned_adapters=("a2",))
    with pytest.raises(UserError, match="max_loras is 1"):
        make_engine(world, max_loras=1, pinned_adapters=("a1", "a2"))
    engine = make_engine(world, max_loras=1, pinned_adapters=("a1",))
    out = {}
    submit(engine, "x", "a2", out)
    engine.run_until_idle()
    assert "pinned" in out["x:end"]


def test_host_memory_hits_count_a_resident_copy_without_a_read(world):
    metrics = ServingMetrics()
    engine = make_engine(world, metrics=metrics, max_loras=1, max_cpu_loras=4)
    out = {}
    for i, name in enumerate(("a1", "a2", "a1", "a2")):
        submit(engine, f"r{i}", name, out, max_tokens=2)
        engine.run_until_idle()
    stats = engine.core.tiers.stats()
    assert (stats.cold_loads, stats.host_hits, stats.device_evictions) == (2, 2, 3)
    assert "moeflow_lora_host_hits_total 2.0" in metrics.render().decode()
    assert out["r2"] == reference(world, "a1")[:2]  # the copy from memory computes what the read did


def test_a_broken_adapter_read_off_the_step_fails_only_its_requests(world):
    engine = make_engine(world, max_loras=2)
    out = {}
    submit(engine, "bad1", "bad", out)
    submit(engine, "good", "a1", out)
    submit(engine, "bad2", "bad", out)
    engine.run_until_idle(max_steps=400)  # bounded: a failure never reported would wait forever
    assert "NaN" in out["bad1:end"] and "NaN" in out["bad2:end"]
    assert out["good:end"] == "length"
    submit(engine, "bad3", "bad", out)  # a later request reads it again (and fails again)
    engine.run_until_idle(max_steps=400)
    assert "NaN" in out["bad3:end"]


def test_deploy_section_checks_the_tier_fields():
    from pydantic import ValidationError

    from moeflow.core.sections.deploy import DeploySection

    assert DeploySection(pinned_adapters=["x"], max_cpu_loras=8).max_cpu_loras == 8
    with pytest.raises(ValidationError, match="max_loras is 4"):
        DeploySection(pinned_adapters=["a", "b", "c", "d", "e"])
    with pytest.raises(ValidationError, match="must be >= max_loras"):
        DeploySection(max_cpu_loras=2)


def test_an_adapter_in_an_object_store_is_read_from_there(world, tmp_path, monkeypatch):
    """A plain prefix (uploaded by hand, no manifest): registered by URI, read from the store
    into host memory when first used (moeflow.core.storage's filesystem), served like a local one."""
    from moeflow.core import storage
    from moeflow.serving.adapters import check_compatible
    from tests.s3server import s3_server

    with s3_server() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        fs, _ = storage.filesystem("s3://moeflow/x", fresh=True)
        uri = "s3://moeflow/tenants/a1"
        for f in world["paths"]["a1"].iterdir():
            fs.put_file(str(f), f"{uri.removeprefix('s3://')}/{f.name}")
        spec = make_spec("a1", uri)
        assert spec.path == uri and spec.mixable
        from moeflow.model.models import load_model

        check_compatible(uri, load_model(world["base"], torch.float32))
        reg = AdapterRegistry()
        reg.add(spec)
        engine = Engine(load_model(world["base"], torch.float32), IdTokenizer(), EngineConfig(max_loras=2), reg)
        out = {}
        submit(engine, "r", "a1", out)
        engine.run_until_idle()
        assert out["r:end"] == "length"
        with pytest.raises(UserError, match="no adapter_config.json"):
            make_spec("nope", "s3://moeflow/tenants/none")
    assert out["r"] == reference(world, "a1")


def test_deploy_pins_only_served_adapters():
    from moeflow.core.config import validate
    from moeflow.serving.deployment import decide

    def cfg(**deploy):
        return validate({"model": {"path": "/m"}, "deploy": {"backend": "local", **deploy}})
    dep = decide(cfg(adapters={"t1": "/a/t1"}, pinned_adapters=["t1"]), {})
    assert dict(dep.adapters) == {"t1": "/a/t1"}
    with pytest.raises(UserError, match="deploy.pinned_adapters: 't2' is not a served adapter"):
        decide(cfg(adapters={"t1": "/a/t1"}, pinned_adapters=["t2"]), {})
