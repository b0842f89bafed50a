"""Prefix caching: TTFT of prompts that share a long prefix, with and without the cache.

    .venv/bin/python benchmarks/bench_prefix.py                     # demo model, 16 x (1,024 + 16) tokens
    .venv/bin/python benchmarks/bench_prefix.py --prefix-len 256 --num-prompts 8

`--num-prompts` prompts share `--prefix-len` random tokens and differ in their
last `--suffix-len`; they are sent one at a time to the in-process engine (its
own thread), each waited for to the end. Reported: the median TTFT of the
first request (a miss: the cache is empty) and of the others (hits), with
`enable_prefix_caching` on, and the same prompts' median TTFT with it off; and
whether the greedy tokens are equal with and without the cache. The demo
model's context is 512 positions; `max_model_len` is raised to fit the
prompts (rotary positions extend; the weights are random anyway).
Target (issue 51): a hit's TTFT <= 0.25x a miss's, tokens equal.
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


def run(model_dir: str, prompts: list[list[int]], new: int, cache: bool) -> tuple[list[float], list[list[int]]]:
    """TTFT (s) and tokens of each prompt, one request at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeflow.serving.engine import Engine, EngineConfig, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = Engine(model, AutoTokenizer.from_pretrained(model_dir),
                    EngineConfig(enable_prefix_caching=cache, max_model_len=max(map(len, prompts)) + new,
                                 max_num_batched_tokens=2048))
    engine.start()
    ttfts, outs = [], []
    try:
        for i, ids in enumerate(prompts):
            first, done, out = threading.Event(), threading.Event(), []

            def sink(d, first=first, done=done, out=out):
                out.extend(d.token_ids)
                first.set()
                if d.finish_reason:
                    done.set()
            t0 = time.perf_counter()
            engine.submit(f"p{i}", ids, SamplingParams(max_tokens=new, ignore_eos=True), sink)
            first.wait()
            ttfts.append(time.perf_counter() - t0)
            done.wait()
            outs.append(out)
    finally:
        engine.stop()
    return ttfts, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "assets" / "demo-base"))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(args.suffix_len)] for _ in range(args.num_prompts)]
    off, ref = run(args.model, prompts, args.output_len, cache=False)
    on, got = run(args.model, prompts, args.output_len, cache=True)
    miss, hit = on[0], statistics.median(on[1:])
    print(f"{args.num_prompts} prompts of {args.prefix_len} shared + {args.suffix_len} tokens, one at a time")
    print(f"TTFT without the cache (median)  {1000 * statistics.median(off):8.1f} ms")
    print(f"TTFT miss (first, cache on)      {1000 * miss:8.1f} ms")
    print(f"TTFT hit (median of the rest)    {1000 * hit:8.1f} ms   hit / miss {hit / miss:.2f}  (target <= 0.25)")
    print(f"greedy tokens equal with and without the cache: {got == ref}")


if __name__ == "__main__":
    main()
