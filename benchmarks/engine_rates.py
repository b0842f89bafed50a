"""What bench_engine.py and its peers (peer_tf_serve.py, peer_vllm.py) measure alike: the
random prompts, the engine's rates (output tokens/s, 1 / TTFT) in process, and the same
over HTTP through one kept-alive client. One module all three import, so that no benchmark
imports another that imports it back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from moeflow.serving.engine import SamplingParams
from moeflow.serving.loadgen import client_session, replay
from moeflow.serving.traffic import Request


def round_args(parser, model: str) -> None:
    """The round's shape, the same options in every engine benchmark: the model, and
    `--num-prompts` prompts of `--input-len` random tokens, `--output-len` new tokens each."""
    parser.add_argument("--model", default=model)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)


def served_round_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options of a benchmark that alternates `generate` with served rounds: the round's shape
    (`round_args`, the demo model by default), `--rounds` and `--stream-interval`."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    round_args(p, str(Path(__file__).resolve().parents[1] / "assets" / "demo-base"))
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--stream-interval", type=int, default=8)
    return p


def eager_anchor(args):
    """(model, prompts) of a served benchmark's `generate` side: the model eager, in float32, on
    one thread of this process; `args.num_prompts` random prompts of `args.input_len` tokens."""
    from moeflow.model.models import load_model

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = load_model(args.model, torch.float32).eval()
    return model, prompts(args.num_prompts, args.input_len, model.config.vocab_size, 0)


@contextlib.contextmanager
def local_serve(temp: str):
    """A Ray of 2 CPUs started by this process and Serve on a free loopback port behind the default
    ingress (`deploy.ingress: auto`), both stopped after and `temp` (Ray's session) removed;
    yields the port."""
    import ray
    from ray import serve

    from moeflow.serving.app import free_port
    from moeflow.serving.ingress import ingress_environment

    try:
        with ingress_environment("auto", temp):
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)  # also when Ray did not start


def deploy_demo(args, name: str) -> None:
    """The model as bench_engine.py's HTTP row serves it (one replica, the engine core in its own
    process, `args.stream_interval`), as app `name` at /name; returns before it is ready."""
    from ray import serve

    from moeflow.serving.app import ServeSettings, build_app

    settings = ServeSettings(base_dir=args.model, served_model_name="demo", stream_interval=args.stream_interval,
                             engine={"max_num_seqs": args.num_prompts}, engine_process=True)
    serve.run(build_app(settings, max_ongoing_requests=4 * args.num_prompts, num_cpus=1), name=name,
              route_prefix=f"/{name}", blocking=False)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def engine_ttft_rate(engine, prompt: list[int], new: int) -> float:
    """1 / seconds from submitting one request (nothing else in flight) to its first token."""
    first, done = threading.Event(), threading.Event()
    t0 = time.perf_counter()
    stamp: list[float] = []

    def sink(delta):
        if delta.token_ids and not first.is_set():
            stamp.append(time.perf_counter())
            first.set()
        if delta.finish_reason:
            done.set()
    engine.submit(f"t{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=new, ignore_eos=True), sink)
    done.wait()
    return 1 / (stamp[0] - t0)


class Client:
    """One HTTP client for every round, its connections kept alive between rounds (as an OpenAI
    SDK client's pool, or vLLM's benchmark_serving session), on an event loop of its own."""

    def __init__(self, connections: int):
        self.loop = asyncio.new_event_loop()

        async def open_():
            return client_session(max_concurrency=connections)
        self.session = self.loop.run_until_complete(open_())

    def replay(self, url: str, reqs: list) -> tuple[list, float]:
        return self.loop.run_until_complete(replay(url, reqs, max_concurrency=len(reqs), session=self.session))

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


def http_ttft_rate(client: Client, url: str, prompt: list[int], new: int) -> float:
    """1 / the client's TTFT of one streamed completion (nothing else in flight)."""
    req = Request(arrival_s=0.0, model="demo", prompt=prompt, max_tokens=new, klass="random")
    (result,), _ = client.replay(url, [req])
    if not result.ok:
        raise RuntimeError(f"HTTP request failed: {result.error}")
    return 1 / result.ttft


def engine_tps(engine, batch: list[list[int]], new: int, concurrent: bool) -> float:
    """Output tokens/s of the running engine: all requests at once, or one after another."""
    def one_round(group: list[list[int]]) -> None:
        done = threading.Semaphore(0)

        def sink(delta, _done=done):
            if delta.finish_reason:
                if delta.error:
                    raise RuntimeError(delta.error)
                _done.release()
        for i, p in enumerate(group):
            engine.submit(f"b{time.monotonic_ns()}-{i}", p,
                          SamplingParams(max_tokens=new, ignore_eos=True), sink)
        for _ in group:
            done.acquire()

    t0 = time.perf_counter()
    if concurrent:
        one_round(batch)
    else:
        for p in batch:
            one_round([p])
    return len(batch) * new / (time.perf_counter() - t0)


def http_tps(client: Client, url: str, batch: list[list[int]], new: int) -> float:
    reqs = [Request(arrival_s=0.0, model="demo", prompt=p, max_tokens=new, klass="random") for p in batch]
    results, wall = client.replay(url, reqs)
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"HTTP requests failed: {bad[:2]}")
    return sum(r.output_tokens for r in results) / wall


def tree_cpu(root: int, skip: int | None = None, with_root: bool = True) -> float:
    """CPU seconds (user + system) used so far by process `root` (unless not `with_root`) and its
    live descendants, leaving out `skip` and its descendants, read from /proc (Linux). On a shared host the wall
    clock swings with the others' load; the CPU a serving stack spends on a round does much
    less, so the peers' rows report both. (psutil would do the same walk; /proc is read
    directly so the benchmark needs nothing beyond the project's own dependencies.)"""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        parents[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid == skip:
            continue
        total += cpu.get(pid, 0.0) if pid != root or with_root else 0.0
        todo += children.get(pid, [])
    return total


def task_cpu(pid: int) -> float:
    """CPU seconds used so far by every thread of process `pid`, from each thread's
    /proc/PID/task/TID/schedstat (Linux: nanoseconds on the CPU). /proc's stat counts clock ticks
    (10 ms): a 130 ms round read from it moves in steps of 8%; schedstat resolves it."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):  # exited meanwhile
            continue
    return total / 1e9


def alternated_cpu(sides: dict, rounds: int, warm: int = 3) -> dict[str, float]:
    """Each side's median CPU seconds per round (this process's clock, which a busy host moves
    far less than the wall clock): every side run `warm` times first, then the sides in turn,
    `rounds` times, so the host's drift falls on all of them alike."""
    for run in sides.values():
        for _ in range(warm):
            run()
    spent: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, run in sides.items():
            c = time.process_time()
            run()
            spent[name].append(time.process_time() - c)
    return {name: statistics.median(v) for name, v in spent.items()}


def cpu_round_setup(doc: str, model: str, output_len: int = 64) -> tuple:
    """What the CPU-clock engine A/B benchmarks share (bench_decode_view.py,
    bench_inference_mode.py): their options (the round's shape and `--rounds`), one torch
    thread as a replica's core, no autograd, and `generate`'s model, the round's prompts and
    the tokenizer. Returns (args, anchor model, prompts, tokenizer)."""
    # lazy: only the benchmarks that build models pay for transformers and the loader
    # (bench_engine.py's peers import this module in processes that load neither)
    import argparse

    from transformers import AutoTokenizer

    from moeflow.model.models import load_model

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    round_args(p, model)
    p.add_argument("--rounds", type=int, default=15)
    p.set_defaults(output_len=output_len)
    args = p.parse_args()
    torch.set_num_threads(1)  # as a replica and its core (ServeSettings.torch_threads)
    torch.set_grad_enabled(False)
    anchor = load_model(args.model, torch.float32).eval()
    batch = prompts(args.num_prompts, args.input_len, anchor.config.vocab_size, 0)
    return args, anchor, batch, AutoTokenizer.from_pretrained(args.model)


def engines_against_generate(generate, engines: dict, batch: list[list[int]], new: int, rounds: int,
                             first=None) -> tuple[dict[str, float], object]:
    """`generate` (a callable running one round) and each running engine on `batch`, alternated
    on the CPU clock (`alternated_cpu`); the engines are stopped after. `first`: a callable run
    before the rounds (its result is returned beside the medians)."""
    sides = {"generate": generate}
    sides |= {name: (lambda e=e: engine_tps(e, batch, new, True)) for name, e in engines.items()}
    try:
        got = first() if first is not None else None
        return alternated_cpu(sides, rounds), got
    finally:
        for e in engines.values():
            e.stop()
