"""Chunked prefill: a long prompt arriving among decoding streams, their inter-token latency.

    .venv/bin/python benchmarks/bench_long_prompt.py                  # demo model, 16 streams, 4,096 tokens
    .venv/bin/python benchmarks/bench_long_prompt.py --repeat 3 --max-num-batched-tokens 256
    .venv/bin/python benchmarks/bench_long_prompt.py --prefill-keys-per-token 0   # vLLM's plain token count

`--streams` requests of `--input-len` random tokens decode `--output-len`
tokens each on the in-process engine (its own thread). The same round runs
twice per repeat: alone, and with one `--long-len`-token prompt submitted once
every stream has its first token. Reported per round: the p50 and p99 of the
streams' inter-token latencies (every gap between two tokens of a stream), the
long prompt's TTFT, and the streams' ITL p50 over the gaps that ended while
the long prompt was prefilled / their p50 alone (what a step carrying a chunk
costs them; steadier than p99 on a busy host, where the p99 alone is the
host's noise). The ratio is p99 with the long prompt / p99 alone.
The demo model's context is 512 positions; `max_model_len` is raised to fit
the long prompt (rotary positions extend; the weights are random anyway).
`stream_interval` plays no part: the engine's own sink sees every token.
Target (issue 51): the long prompt raises the streams' p99 ITL by <= 2x.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def one_round(engine, streams: list[list[int]], new: int,
              long: list[int] | None) -> tuple[list[float], float, list[float]]:
    """Inter-token gaps (s) of every stream, the long prompt's TTFT (s; 0 without one), and the
    gaps that ended while the long prompt was prefilled (its submission to its first token)."""
    from moeflow.serving.engine import SamplingParams

    stamps: list[list[float]] = [[] for _ in streams]
    done = threading.Event()  # set by the sink (the engine's thread: it must never block there)
    left = [len(streams)]
    first = threading.Event()
    long_first: list[float] = []
    started = threading.Semaphore(0)

    def sink(d, i):
        if d.token_ids:
            if not stamps[i]:
                started.release()
            stamps[i].extend([time.perf_counter()] * len(d.token_ids))
        if d.finish_reason:
            left[0] -= 1
            if not left[0]:
                done.set()

    def long_sink(d):
        if d.token_ids and not long_first:
            long_first.append(time.perf_counter())
            first.set()
    for i, ids in enumerate(streams):
        engine.submit(f"s{i}", ids, SamplingParams(max_tokens=new, ignore_eos=True), lambda d, i=i: sink(d, i))
    for _ in streams:
        started.acquire()
    t0 = time.perf_counter()
    if long is not None:
        engine.submit("long", long, SamplingParams(max_tokens=1, ignore_eos=True), long_sink)
    done.wait()
    if long is not None:
        first.wait()
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    end = long_first[0] if long_first else t0
    during = [b - a for s in stamps for a, b in zip(s, s[1:]) if t0 < b <= end]
    return gaps, (long_first[0] - t0) if long_first else 0.0, during


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "assets" / "demo-base"))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="per-prompt chunk cap (default: the engine's)")
    p.add_argument("--prefill-keys-per-token", type=int, default=None,
                   help="a chunk token attending to more keys charges keys / this tokens of the budget "
                        "(default: the engine's; 0: vLLM's plain count)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--padded", action="store_true", help="the padded batches (paged_kv off), for comparison")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeflow.serving.engine import Engine, EngineConfig

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(0)
    streams = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.streams)]
    long = [rng.randrange(3, vocab) for _ in range(args.long_len)]
    thr: dict = {} if args.long_prefill_token_threshold is None else \
        {"long_prefill_token_threshold": args.long_prefill_token_threshold}
    if args.prefill_keys_per_token is not None:
        thr["prefill_keys_per_token"] = args.prefill_keys_per_token or None
    engine = Engine(model, AutoTokenizer.from_pretrained(args.model),
                    EngineConfig(max_model_len=args.long_len + args.output_len + 8, max_num_seqs=args.streams + 1,
                                 max_num_batched_tokens=args.max_num_batched_tokens, paged_kv=not args.padded,
                                 **thr))
    engine.start()
    print(f"{args.streams} streams of {args.input_len} + {args.output_len} tokens; a {args.long_len}-token prompt "
          f"arrives once all have their first token; token budget {args.max_num_batched_tokens}; "
          f"{'padded batches' if args.padded else 'paged'}")
    ratios, mids = [], []
    try:
        one_round(engine, streams, 8, None)  # warm
        for r in range(args.repeat):
            alone, _, _ = one_round(engine, streams, args.output_len, None)
            mixed, ttft, during = one_round(engine, streams, args.output_len, long)
            ratio = pct(mixed, 0.99) / pct(alone, 0.99)
            ratios.append(ratio)
            # less noisy on a busy host than p99: what a step carrying a chunk costs the streams
            mids.append(statistics.median(during) / statistics.median(alone) if during else float("nan"))
            print(f"round {r}: ITL alone p50 {1000 * pct(alone, 0.5):6.2f} ms p99 {1000 * pct(alone, 0.99):6.2f} ms | "
                  f"with the long prompt p50 {1000 * pct(mixed, 0.5):6.2f} ms p99 {1000 * pct(mixed, 0.99):6.2f} ms | "
                  f"p99 ratio {ratio:.2f} | long prompt TTFT {ttft:.2f} s | ITL p50 during its prefill "
                  f"/ p50 alone {mids[-1]:.2f}")
    finally:
        engine.stop()
    print(f"median p99 ratio {statistics.median(ratios):.2f} (target <= 2.0); median ITL p50 during the "
          f"long prompt's prefill / p50 alone {statistics.median(mids):.2f}")


if __name__ == "__main__":
    main()
