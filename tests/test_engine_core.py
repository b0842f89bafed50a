"""The engine core in its own process (moeflow/serving/core.py, `engine_process: true`), no Ray:
the same answers as the in-process engine (text, stop strings, logprobs, adapters), a core
that dies fails its requests and the health check (never a hang), an abort frees the core's
slot, and the core dies with its replica."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moeflow.core.errors import UserError
from moeflow.serving.errors import STOPPED, EngineDead, ModelNotFound
from moeflow.serving.sampling import SamplingParams
from moeflow.serving.service import ServeSettings, Service
from moeflow_testing.serving import make_lora_adapter

REPO = Path(__file__).resolve().parents[1]
BASE = str(REPO / "assets" / "demo-base")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One replica with its core in a process and one in-process, same base and adapter root."""
    root = tmp_path_factory.mktemp("core") / "adapters"
    make_lora_adapter(BASE, root / "a1", seed=1)
    services = {mode: Service(ServeSettings(base_dir=BASE, served_model_name="demo", adapter_root=str(root),
                                            engine_process=mode == "process", engine={"max_num_seqs": 4}))
                for mode in ("process", "thread")}
    yield services, root
    for svc in services.values():
        svc.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is dead too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def _collect(svc: Service, prompts: list[list[int]], params: list[SamplingParams],
                   adapter: str | None = None) -> list[tuple]:
    served = adapter or "demo"
    streams = svc.generate_many([f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))], prompts, params,
                                adapter, served)
    out = []
    for stream in streams:
        text, ids, lps, last = "", [], [], None
        async for d in stream:
            text, ids, lps, last = text + d.text, ids + d.token_ids, lps + d.logprobs, d
        assert last is not None
        out.append((text, ids, [round(lp[1], 4) for lp in lps], last.finish_reason, last.error,
                    last.completion_tokens))
    return out


def test_core_process_answers_as_the_in_process_engine(pair):
    services, _ = pair
    svc = services["process"]
    ids = svc.tokenize("Once upon a time there was")
    free = asyncio.run(_collect(services["thread"], [ids], [SamplingParams(max_tokens=24)]))[0][0]
    cut = free[len(free) // 2:len(free) // 2 + 3]  # a stop string inside the free-running text
    params = [SamplingParams(max_tokens=24, logprobs=2), SamplingParams(max_tokens=24, stop=[cut]),
              SamplingParams(max_tokens=5, temperature=0.8, seed=7), SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=24, stop=[cut], min_tokens=20)]
    prompts = [ids, ids, ids, ids[:2], ids]
    got = asyncio.run(_collect(svc, prompts, params))
    want = asyncio.run(_collect(services["thread"], prompts, params))
    assert got == want
    assert got[1][3] == "stop" and cut not in got[1][0] and got[1][1] != got[0][1]
    assert svc.engine.pid != os.getpid() and _alive(svc.engine.pid)
    assert os.getpgid(svc.engine.pid) == os.getpgid(0)  # in the replica's process group
    text = svc.render_metrics().decode()
    assert 'moeflow_request_success_total{finished_reason="stop",model_name="demo"}' in text
    assert "moeflow_expert_tokens_total" in text  # the core's expert counts, fetched at the scrape
    assert svc.expert_load()["num_experts"] > 0
    with pytest.raises(UserError, match="maximum context length"):
        svc.engine.submit("big", ids, SamplingParams(max_tokens=10 ** 6), lambda d: None)


def test_a_stop_string_stops_the_core_too(pair):
    """The front end ends a request on a stop string and aborts it in the core, which would go
    on to max_tokens: the core routes at most a few tokens more than the request got, in
    either mode (the expert load counts every token a forward routed)."""
    services, _ = pair
    ids = services["thread"].tokenize("Once upon a time there was")
    free = asyncio.run(_collect(services["thread"], [ids], [SamplingParams(max_tokens=24)]))[0][0]

    def routed(svc: Service, params: SamplingParams) -> tuple[int, tuple]:
        before = sum(svc.expert_load()["counts"][0])
        (got,) = asyncio.run(_collect(svc, [ids], [params]))
        deadline = time.monotonic() + 60
        while svc.engine.stats is None or svc.engine.stats.running and time.monotonic() < deadline:
            time.sleep(0.05)
        return sum(svc.expert_load()["counts"][0]) - before, got
    for mode, svc in services.items():
        one, _ = routed(svc, SamplingParams(max_tokens=1))  # the prompt alone: its tokens x top-k
        per_token = one // len(ids)
        n, got = routed(svc, SamplingParams(max_tokens=400, ignore_eos=True, stop=[free[4:7]]))
        assert got[3] == "stop" and got[5] < 24, (mode, got)
        assert n <= (len(ids) + got[5] + 3) * per_token, (mode, n, got[5], per_token)


def test_core_process_runtime_adapters(pair):
    services, root = pair
    svc, ref = services["process"], services["thread"]
    for s in (svc, ref):
        asyncio.run(s.load_adapter("a1", str(root / "a1")))
    ids = svc.tokenize("The adapter says")
    params = [SamplingParams(max_tokens=12)]
    with_a1 = asyncio.run(_collect(svc, [ids], params, adapter="a1"))
    assert with_a1 == asyncio.run(_collect(ref, [ids], params, adapter="a1"))
    assert with_a1 != asyncio.run(_collect(svc, [ids], params))
    assert "a1" in [c["id"] for c in svc.model_cards()]
    for s in (svc, ref):
        asyncio.run(s.unload_adapter("a1"))
    with pytest.raises(ModelNotFound):
        svc.resolve_model("a1")
    with pytest.raises(ModelNotFound):  # the core forgot it too: unloading again finds nothing
        asyncio.run(svc.unload_adapter("a1"))


def test_an_abort_frees_the_core_slot():
    svc = Service(ServeSettings(base_dir=BASE, engine_process=True, engine={"max_num_seqs": 1}))
    try:
        ids = svc.tokenize("hello")

        async def go():
            (long,) = svc.generate_many(["long"], [ids], [SamplingParams(max_tokens=400, ignore_eos=True)],
                                        None, "demo")
            await long.__anext__()  # it runs, holding the only slot
            await long.aclose()  # the client went away: the replica aborts it in the core
            t0 = time.monotonic()
            (short,) = await _collect(svc, [ids], [SamplingParams(max_tokens=3, ignore_eos=True)])
            return short, time.monotonic() - t0
        short, took = asyncio.run(asyncio.wait_for(go(), 60))
        assert short[3] == "length" and len(short[1]) == 3 and took < 30
        assert not svc.engine.outputs.requests and svc.engine.limits.queued_seqs == 0
    finally:
        svc.close()
    assert not _alive(svc.engine.pid)


def test_a_killed_core_fails_its_requests_and_the_health_check():
    svc = Service(ServeSettings(base_dir=BASE, engine_process=True))
    try:
        ids = svc.tokenize("hello")

        async def go():
            streams = svc.generate_many(["a", "b"], [ids, ids], [SamplingParams(max_tokens=500, ignore_eos=True)] * 2,
                                        None, "demo")
            first = await streams[0].__anext__()
            os.kill(svc.engine.pid, signal.SIGKILL)
            last = first
            for stream in streams:
                async for d in stream:
                    last = d
            return last
        last = asyncio.run(asyncio.wait_for(go(), 60))
        assert last.finish_reason == "error" and STOPPED in (last.error or "")
        with pytest.raises(EngineDead, match="exited with code -9"):
            svc.engine.health()
        with pytest.raises(EngineDead):
            svc.engine.reserve([3])
        with pytest.raises(EngineDead):  # adapter operations fail, they do not wait
            svc.engine.run("remove_adapter", "x").result(timeout=5)
    finally:
        svc.close()


def test_the_core_dies_with_its_replica(tmp_path):
    """SIGKILL of the replica (nothing of it cleans up): its core exits, no orphan."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from moeflow.serving.service import ServeSettings, Service
        svc = Service(ServeSettings(base_dir={BASE!r}, engine_process=True))
        print(svc.engine.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        core = int(proc.stdout.readline())
        assert _alive(core)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(core), "the engine core outlived its replica"
    finally:
        proc.kill()


def test_a_core_that_cannot_start_says_why_in_one_line(tmp_path):
    with pytest.raises(UserError, match="deploy merge: adapter 'nope' is not among the adapters"):
        Service(ServeSettings(base_dir=BASE, engine_process=True, merge="nope"))


def test_auto_runs_the_core_for_a_text_model_and_the_engine_in_process_for_images(tmp_path):
    """deploy.engine_process auto (the default): a text model's replica starts a core process; a model
    whose config.json has a vision part keeps the engine in the replica, where images work; one
    whose vision tower only the loaded model shows moves back in process too."""
    from moeflow.serving.core import CoreClient
    from moeflow.serving.engine import Engine
    from moeflow.serving.service import shows_vision
    from moeflow_testing.tiny import build_debug_model

    svc = Service(ServeSettings(base_dir=BASE, engine_process="auto"))
    try:
        assert isinstance(svc.engine, CoreClient) and _alive(svc.engine.pid)
    finally:
        svc.close()
    vl = build_debug_model("qwen3_vl_moe", tmp_path / "vl")
    assert shows_vision(vl) and not shows_vision(Path(BASE))
    svc = Service(ServeSettings(base_dir=str(vl), engine_process="auto"))
    try:
        assert isinstance(svc.engine, Engine) and svc.processor is not None
    finally:
        svc.close()
    import moeflow.serving.service as service_mod

    started = []
    real_shows, real_client = service_mod.shows_vision, service_mod.CoreClient

    def client(*args, **kwargs):
        started.append(real_client(*args, **kwargs))
        return started[-1]
    # as for a config that names its vision part otherwise: only the core's loaded model shows it
    service_mod.shows_vision, service_mod.CoreClient = (lambda _: False), client
    try:
        svc = Service(ServeSettings(base_dir=str(vl), engine_process="auto"))
    finally:
        service_mod.shows_vision, service_mod.CoreClient = real_shows, real_client
    try:
        assert isinstance(svc.engine, Engine) and svc.processor is not None
        assert len(started) == 1 and started[0].image_text and not _alive(started[0].pid)
    finally:
        svc.close()


def test_a_step_message_crosses_the_socket_whole_and_by_position():
    """StepOutputs and CoreOutput pickle as their field values in order (request.Positional): every
    field, set to something other than its default, comes back equal, and no object carries a
    dict of its field names (the pickle does not spell them)."""
    import pickle
    from dataclasses import fields

    from moeflow.serving.request import CoreOutput, CoreStats, StepOutputs

    out = CoreOutput("cmpl-1", [5, 6], [(5, -0.25, [(5, -0.25), (7, -2.0)])], [(3, None, []), (4, -1.5, [])],
                     "stop", "a failure")
    msg = StepOutputs([out, CoreOutput("cmpl-2", [9])], ["cmpl-3"], CoreStats({"demo": 1}, {"demo": 2}, 7, 1, 9, 4,
                                                                               None, 0.5), "core stopped")
    for obj, bare in ((out, CoreOutput("", [])), (msg, StepOutputs())):  # every field off its default
        assert all(getattr(obj, f.name) != getattr(bare, f.name) for f in fields(obj)), obj
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    assert pickle.loads(data) == msg
    assert b"token_ids" not in data and b"finish_reason" not in data and b"outputs" not in data
