"""Many adapters on one base: the local engine's adapter tiers, ratios measured in one run.

    .venv/bin/python benchmarks/bench_many_adapters.py                # 64 adapters, 2 repeats
    .venv/bin/python benchmarks/bench_many_adapters.py --repeat 3 --max-loras 4
    .venv/bin/python benchmarks/bench_many_adapters.py --decode-steps   # the forward alone

What is measured (demo model, float32 on CPU, the engine in process, no HTTP):
64 random attention adapters of the demo base (rank 8), all registered; the
engine keeps `--max-loras` of them resident on the device (deploy.max_loras,
16 here: 16 distinct adapters in flight in one batch) and `--max-cpu-loras` in
host memory (deploy.max_cpu_loras, 32 here), reading the others from disk on
the loader thread when a request needs them (moeflow/serving/adapter_tiers.py).
Each scenario (a fresh engine) submits `--requests` requests at once
(`--input-len` random prompt tokens, exactly `--output-len` new tokens), request
i using adapter i mod k, for k in 1, 4, 16, 64 distinct adapters; the anchor is
the same requests on the base alone. The requests run once untimed (adapters
read, the tiers left as that traffic leaves them), then again, timed. At k=64
the timed pass starts with 16 adapters resident, 16 more in host memory and 32
to read from disk -- and the requests to those 32 come first in the queue.
Scenarios alternate within each repeat.

Printed per run (each repeat's ratios to that repeat's base alone, the load average), then
per k (medians over repeats): output tokens/s relative to the base
alone, device evictions and reads from disk per run, and time to first token
of the requests by where their adapter was when they were submitted: on the
device ("resident"), in host memory ("host") or on disk ("cold"), p50 / p99;
`slow` counts resident requests whose TTFT exceeded 3x the resident p99 of
the k=1 run (the issue's goal: none, and >= 0.7x the base's tokens/s at k=16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # moeflow_testing: in the checkout, not installed

from moeflow.serving.adapters import AdapterRegistry, make_spec  # noqa: E402
from moeflow.serving.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from moeflow_testing.demo_base import ASSET  # noqa: E402
from moeflow_testing.serving import make_lora_adapter  # noqa: E402

SPREADS = (1, 4, 16, 64)


def build_adapters(root: Path, n: int) -> dict[str, Path]:
    return {f"t{i:02d}": make_lora_adapter(ASSET, root / f"t{i:02d}", seed=i, rank=8) for i in range(n)}


def run_once(tok, adapters: dict[str, Path], root: Path, k: int | None, args) -> dict:
    """One scenario on a fresh model and engine (k None: the base alone): the requests once to
    warm up (adapters read, the tiers as traffic leaves them), then again, timed."""
    from moeflow.model.models import load_model

    registry = AdapterRegistry(root)
    for name, path in adapters.items():
        registry.add(make_spec(name, path))
    engine = Engine(load_model(ASSET, torch.float32).eval(), tok,
                    EngineConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_num_seqs=16,
                                 max_num_batched_tokens=256),
                    registry)
    _pass(engine, tok, sorted(adapters), k, args)
    evictions, reads = engine.core.slots.evictions, engine.core.tiers.host.cold_loads
    out = _pass(engine, tok, sorted(adapters), k, args)
    out["evictions"] = engine.core.slots.evictions - evictions
    out["reads"] = engine.core.tiers.host.cold_loads - reads
    engine.stop()
    return out


def decode_steps(tok, adapters: dict[str, Path], root: Path, args) -> None:
    """`--decode-steps`: the forward alone, no queueing or loads. Per k (None: the base), an
    engine with k adapters resident and 16 rows decoding (request i on adapter i mod k);
    blocks of 20 steps timed on each engine in turn, `--repeat` x 3 blocks; ms per step,
    medians, and the base's ms over k's (the tokens/s ratio: every step makes 16 tokens)."""
    from moeflow.model.models import load_model

    names = sorted(adapters)[:16]
    engines = {}
    for k in (None, *SPREADS[:3]):
        registry = AdapterRegistry(root)
        for name, path in adapters.items():
            registry.add(make_spec(name, path))
        engine = Engine(load_model(ASSET, torch.float32).eval(), tok,
                        EngineConfig(max_loras=16, max_cpu_loras=32, max_num_seqs=16, max_num_batched_tokens=1024),
                        registry)
        for name in names[:k or 0]:  # resident before the requests
            engine.call(lambda n=name, e=engine: e.core.tiers.load_now(e.core.registry.get(n), set())).result()
        gen = torch.Generator().manual_seed(0)
        for i in range(16):
            ids = torch.randint(10, tok.vocab_size - 10, (args.input_len,), generator=gen).tolist()
            engine.submit(str(i), ids, SamplingParams(max_tokens=400, ignore_eos=True), lambda d: None,
                          adapter=names[i % k] if k else None)
        engine.core.run_until_idle(6)  # prompts prefilled: every later step decodes 16 rows
        engines[k] = engine
    # timed by this thread's CPU clock (the steps run here, torch on one thread): on a shared
    # host the wall clock also counts the time other processes held the core; both printed
    times: dict[int | None, list[tuple[float, float]]] = {k: [] for k in engines}
    for _ in range(3 * args.repeat):
        for k, engine in engines.items():
            t, c = time.perf_counter(), time.thread_time()
            engine.core.run_until_idle(20)
            times[k].append(((time.thread_time() - c) / 20 * 1000, (time.perf_counter() - t) / 20 * 1000))
    base = statistics.median(c for c, _ in times[None])
    base_wall = statistics.median(w for _, w in times[None])
    for k, ts in times.items():
        m, wall = statistics.median(c for c, _ in ts), statistics.median(w for _, w in ts)
        print(f"{'base' if k is None else f'{k} adapters':>11}: {m:6.2f} ms CPU per step of 16 rows, "
              f"x{base / m:.2f} the base's tokens/s (wall clock {wall:.2f} ms, x{base_wall / wall:.2f}; "
              f"blocks, CPU ms: {', '.join(f'{c:.1f}' for c, _ in ts)}); load {os.getloadavg()[0]:.1f}")
    for engine in engines.values():
        engine.stop()


def _pass(engine, tok, names: list[str], k: int | None, args) -> dict:
    gen = torch.Generator().manual_seed(0)
    first: dict[int, float] = {}
    done: dict[int, int] = {}
    t_submit: dict[int, float] = {}
    where: dict[int, str] = {}
    tiers = engine.core.tiers
    start = time.perf_counter()
    for i in range(args.requests):
        adapter = None if k is None else names[i % k]
        ids = torch.randint(10, tok.vocab_size - 10, (args.input_len,), generator=gen).tolist()

        def sink(d, i=i):
            if d.token_ids and i not in first:
                first[i] = time.perf_counter()
            done[i] = done.get(i, 0) + len(d.token_ids)
        where[i] = ("resident" if adapter is None or adapter in tiers.device.resident() else
                    "host" if adapter in tiers.host.held() else "cold")
        t_submit[i] = time.perf_counter()
        engine.submit(str(i), ids, SamplingParams(max_tokens=args.output_len, ignore_eos=True), sink,
                      adapter=adapter)
    engine.run_until_idle()
    wall = time.perf_counter() - start
    ttft = {i: first[i] - t_submit[i] for i in first}
    return {"tok_s": sum(done.values()) / wall} | {
        tier: sorted(v for i, v in ttft.items() if where[i] == tier) for tier in ("resident", "host", "cold")}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--max-cpu-loras", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--decode-steps", action="store_true",
                    help="time decode steps of 16 rows with 1, 4, 16 adapters resident against the base instead")
    args = ap.parse_args()
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a model is loaded per scenario: keep the table readable
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    adapters = build_adapters(root, min(16, args.adapters) if args.decode_steps else args.adapters)
    tok = AutoTokenizer.from_pretrained(str(ASSET))
    if args.decode_steps:
        decode_steps(tok, adapters, root, args)
        return
    runs: dict[str | int, list[dict]] = {}
    for i in range(args.repeat):
        for k in (None, *SPREADS):
            runs.setdefault("base" if k is None else k, []).append(run_once(tok, adapters, root, k, args))
        print(f"run {i + 1}: base alone {runs['base'][-1]['tok_s']:.0f} tok/s; x base "
              + ", ".join(f"k={k} {runs[k][-1]['tok_s'] / runs['base'][-1]['tok_s']:.2f}" for k in SPREADS)
              + "; slow (over 3x this run's k=1 resident p99) "
              + ", ".join(f"k={k} {_slow(runs[k][-1], runs[1][-1])}" for k in SPREADS)
              + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    report(runs, args)


def _slow(run: dict, ref: dict) -> int:
    """Resident requests of `run` whose TTFT is over 3x the resident p99 of `ref` (a k=1 run)."""
    p99 = pct(ref["resident"], 0.99) or 0.0
    return sum(v > 3 * p99 for v in run["resident"])


def report(runs: dict, args) -> None:
    base = statistics.median(r["tok_s"] for r in runs["base"])
    ref_p99 = pct([v for r in runs[1] for v in r["resident"]], 0.99) or 0.0
    print(f"base alone: {base:.0f} output tok/s ({args.requests} requests x {args.output_len} tokens, "
          f"{args.repeat} runs; max_loras {args.max_loras}, max_cpu_loras {args.max_cpu_loras})")
    print(f"{'adapters':>8} {'tok/s':>7} {'x base':>7} {'evict':>6} {'reads':>6} {'resident p50/p99 ms':>20} "
          f"{'host p50/p99 ms':>16} {'cold p50/p99 ms':>16} {'cold n':>6} {'slow':>5}")
    for k in SPREADS:
        rs = runs[k]
        tok_s = statistics.median(r["tok_s"] for r in rs)
        res, host, cold = (sorted(v for r in rs for v in r[t]) for t in ("resident", "host", "cold"))
        slow = sum(v > 3 * ref_p99 for v in res)

        def ms(values, q):
            v = pct(values, q)
            return "-" if v is None else f"{1000 * v:.0f}"

        def both(values):
            return ms(values, .5) + "/" + ms(values, .99)
        print(f"{k:>8} {tok_s:>7.0f} {tok_s / base:>7.2f} {statistics.median(r['evictions'] for r in rs):>6.0f} "
              f"{statistics.median(r['reads'] for r in rs):>6.0f} {both(res):>20} {both(host):>16} "
              f"{both(cold):>16} {len(cold) // len(rs):>6} {slow:>5}")
    print(f"slow: resident requests over 3x the k=1 resident p99 ({1000 * ref_p99:.0f} ms)")


if __name__ == "__main__":
    main()
