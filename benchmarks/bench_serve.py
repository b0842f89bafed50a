"""Serving benchmark, modelled on `vllm bench serve`: ratios measured in one run.

    .venv/bin/python benchmarks/bench_serve.py              # the three target ratios on the demo model
    .venv/bin/python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model demo \
        --num-prompts 64 --request-rate 8 --max-concurrency 16 --input-len 64 --output-len 32

Load and metrics come from the library (moeflow/serving/loadgen.py, also
`moeflow bench serve` with vllm's flags): Poisson arrivals at `--request-rate`
(inf: all at once), at most `--max-concurrency` in flight, prompt/output
lengths drawn uniformly within `--range-ratio` of the means, adapters picked
at random from `--model` (comma-separated). Reported: request and output-token
throughput, and mean/p50/p99 of TTFT, TPOT (time per output token after the
first), ITL (gap between streamed tokens) and E2E latency.

Targets checked by the default run (all on the same machine, same run):
1. 16 concurrent requests: >= 4x the throughput of one-at-a-time;
2. traffic spread over 4 adapters: >= 0.7x the throughput of one adapter;
3. long prompts among short ones: chunked prefill cuts the short requests'
   p99 TTFT to <= 0.5x of the same run without chunking.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # moeflow_testing: in the checkout, not installed

from moeflow.serving.loadgen import random_requests, replay  # noqa: E402
from moeflow.serving.loadgen import summarize as vllm_summary  # noqa: E402


def make_requests(n: int, models: list[str], input_len: int, output_len: int, range_ratio: float,
                  vocab: int, seed: int, tag: str = ""):
    """vllm's random dataset through the library (all arrivals at t=0; `run_load` paces them)."""
    return random_requests(n, models, input_len=input_len, output_len=output_len, range_ratio=range_ratio,
                           vocab=vocab, seed=seed, klass=tag or "random")


def run_load(url: str, reqs, request_rate: float, max_concurrency: int, api_key: str | None = None,
             seed: int = 0):
    """Send `reqs` with Poisson arrivals at `request_rate` (inf: all at once); (results, wall s)."""
    rng = random.Random(seed)
    t = 0.0
    for req in reqs:
        req.arrival_s = t
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    return asyncio.run(replay(url, reqs, max_concurrency=max_concurrency, api_key=api_key))


def summarize(results, wall: float) -> dict:
    """The library's vllm-named metrics, regrouped for this suite's table (ms)."""
    m = vllm_summary(results, wall, percentiles=(50, 99))
    if not m["completed"]:
        raise RuntimeError(f"no request succeeded: {m.get('errors')}")
    out = {k: m[k] for k in ("completed", "failed", "request_throughput", "output_throughput",
                             "total_token_throughput")}
    for key, name in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        out[name] = {"mean": m[f"mean_{key}_ms"], "p50": m[f"p50_{key}_ms"], "p99": m[f"p99_{key}_ms"]}
    return out


def print_table(rows: list[tuple[str, dict]]) -> None:
    print(f"{'scenario':40} {'req/s':>7} {'tok/s':>8} {'TTFT mean/p50/p99 ms':>24} "
          f"{'TPOT mean ms':>12} {'ITL p99 ms':>10} {'E2E p99 ms':>10}")
    for name, s in rows:
        t = s["ttft_ms"]
        print(f"{name:40} {s['request_throughput']:7.2f} {s['output_throughput']:8.1f} "
              f"{t['mean']:8.1f}/{t['p50']:6.1f}/{t['p99']:7.1f} {s['tpot_ms']['mean']:12.2f} "
              f"{s['itl_ms']['p99']:10.2f} {s['e2e_ms']['p99']:10.1f}")


# ---------------------------------------------------------------- the target suite


def _deploy(base: Path, adapters: dict, port: int) -> dict[bool, str]:
    """Two apps on one Serve proxy, same model: chunked prefill at /, unchunked at /nochunk."""
    from ray import serve

    from moeflow.serving.app import ServeSettings, build_app

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    urls = {}
    for chunked, prefix in ((True, "/"), (False, "/nochunk")):
        settings = ServeSettings(base_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 engine={"max_num_seqs": 16, "max_num_batched_tokens": 512,
                                         "long_prefill_token_threshold": 128,
                                         "enable_chunked_prefill": chunked, "max_loras": 4})
        serve.run(build_app(settings, max_ongoing_requests=64), name=f"moeflow{prefix.strip('/')}",
                  route_prefix=prefix, blocking=False)
        urls[chunked] = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
        httpx.get(f"{urls[chunked]}/v1/models", timeout=120).raise_for_status()
    return urls


def _pair(url_a: str, reqs_a: list, url_b: str, reqs_b: list, rate: float, conc_a: int,
          conc_b: int, pick=None) -> tuple[dict, dict]:
    """Run scenario A then B back to back (so machine load drifts as little as possible)."""
    out = []
    for url, reqs, conc in ((url_a, reqs_a, conc_a), (url_b, reqs_b, conc_b)):
        results, wall = run_load(url, reqs, rate, conc, seed=3)
        out.append(summarize([r for r in results if pick is None or pick(r)], wall))
    return out[0], out[1]


def suite(args) -> None:
    import ray

    from moeflow.serving.app import free_port
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    work = Path(tempfile.mkdtemp(prefix="moeflow-bench-"))
    # the demo model with a longer context, so long-document prompts fit
    base = build_debug_model("qwen3_moe", work / "demo", max_position_embeddings=8192)
    adapters = {f"lora{i}": make_lora_adapter(base, work / f"lora{i}", seed=i) for i in range(4)}
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="/tmp/mfr"))
    n, inf = args.num_prompts, float("inf")
    rows, ratios = [], {"conc": [], "lora": [], "ttft": []}
    try:
        urls = _deploy(base, adapters, free_port())
        warm = make_requests(8, list(adapters) + ["demo"], 32, 8, 0.0, vocab, 99)
        for url in urls.values():
            run_load(url, warm, inf, 8)  # load every adapter once
        short = make_requests(n, ["demo"], 32, 32, 0.0, vocab, 1)
        one = make_requests(2 * n, ["lora0"], 32, 32, 0.0, vocab, 2)
        four = make_requests(2 * n, list(adapters), 32, 32, 0.0, vocab, 2)
        mix = _mixed_lengths(vocab, args.long_len)
        for rep in range(args.repeat):
            serial, batched = _pair(urls[True], short, urls[True], short, inf, 1, 16)
            single, spread = _pair(urls[True], one, urls[True], four, inf, 16, 16)
            chunk, whole = _pair(urls[True], mix, urls[False], mix, args.mixed_rate, 32, 32,
                                 pick=lambda r: r.req.klass == "short")
            ratios["conc"].append(batched["output_throughput"] / serial["output_throughput"])
            ratios["lora"].append(spread["output_throughput"] / single["output_throughput"])
            ratios["ttft"].append(chunk["ttft_ms"]["p99"] / whole["ttft_ms"]["p99"])
            rows += [(f"[{rep}] base, concurrency 1", serial), (f"[{rep}] base, concurrency 16", batched),
                     (f"[{rep}] 1 adapter, concurrency 16", single), (f"[{rep}] 4 adapters, concurrency 16", spread),
                     (f"[{rep}] short reqs among long, chunked", chunk),
                     (f"[{rep}] short reqs among long, unchunked", whole)]
    finally:
        ray.shutdown()
    print_table(rows)
    print(f"\nratios (median of {args.repeat} back-to-back pairs; each pair's value in brackets)")
    for key, name, target in (("conc", "16 concurrent / one-at-a-time throughput", ">= 4"),
                              ("lora", "4 adapters / 1 adapter throughput", ">= 0.7"),
                              ("ttft", "short p99 TTFT chunked / unchunked", "<= 0.5")):
        value = statistics.median(ratios[key])
        ok = value >= float(target[3:]) if target.startswith(">=") else value <= float(target[3:])
        each = ", ".join(f"{v:.2f}" for v in ratios[key])
        print(f"{name:44} {value:6.2f}  target {target:7} {'PASS' if ok else 'MISS'}  [{each}]")


def _mixed_lengths(vocab: int, long_len: int) -> list:
    """Short chat-like requests with a few long-document prompts among them."""
    rng = random.Random(5)
    shorts = make_requests(80, ["demo"], 16, 16, 0.25, vocab, 6, tag="short")
    longs = make_requests(6, ["demo"], long_len, 4, 0.1, vocab, 7, tag="long")
    reqs = shorts + longs
    rng.shuffle(reqs)
    return reqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="benchmark a running server instead of the target suite")
    p.add_argument("--model", default="demo", help="model/adapter names, comma-separated (round-robin)")
    p.add_argument("--api-key")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    p.add_argument("--mixed-rate", type=float, default=6.0, help="suite: arrivals/s of the long+short mix")
    p.add_argument("--long-len", type=int, default=6000, help="suite: long-document prompt length")
    p.add_argument("--repeat", type=int, default=5, help="suite: back-to-back pairs per ratio (median)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not args.url:
        suite(args)
        return
    reqs = make_requests(args.num_prompts, args.model.split(","), args.input_len, args.output_len,
                         args.range_ratio, args.vocab, args.seed)
    results, wall = run_load(args.url, reqs, args.request_rate, args.max_concurrency, args.api_key, args.seed)
    print_table([(f"{args.model} @ {args.request_rate}/s, conc {args.max_concurrency}",
                  summarize(results, wall))])


if __name__ == "__main__":
    main()
