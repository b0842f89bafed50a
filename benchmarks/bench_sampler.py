"""The engine's sampler against transformers' `generate` sampling the same logits, in one run.

    .venv/bin/python benchmarks/bench_sampler.py [--vocab 151936] [--rows 16] [--rounds 15]
    .venv/bin/python benchmarks/bench_sampler.py --static [--rounds 15]

One decode step's sampling of `--rows` rows of float32 logits over `--vocab` tokens (Qwen3's
vocabulary by default; the demo model's 512 hides what a real vocabulary costs), seeded random
logits (standard normal x 3), on one CPU thread, for four settings:

- greedy: the engine's `greedy_and_finite` (argmax and the finiteness check every step makes),
  against `generate`'s argmax;
- temperature 0.7; temperature 0.7 with top_p 0.9; temperature 0.7 with top_k 50: the engine's
  step (`greedy_and_finite`, then `sample_rows` on the batch with each request's seeded
  generator, as `step_sample.emit_rows`), against `generate`'s (its logits warpers on the
  batch, softmax, `torch.multinomial`).

Rounds alternate the two sides; each is timed on this thread's CPU clock. Prints the medians
and `generate`'s / the engine's (above 1: the engine spends less).

`--static`: the same knobs end to end on the demo model: the in-process engine (`Engine`, its
core on a thread of this process) with 16 prompts of 32 random tokens submitted at once, 32 new
tokens each, one seed a request, against `generate(do_sample=True)` on the same prompts as one
batch (transformers' default top_k of 50 off, so both sides sample under the same knobs);
rounds alternate, each timed on this process's CPU clock (the engine's thread included).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402


def engine_step(logits: torch.Tensor, params, gens: list) -> list[int]:
    """The engine's step: `greedy_and_finite` on every row, then the sampling rows together."""
    from moeflow.serving.sampling import greedy_and_finite, sample_rows

    greedy, _finite = greedy_and_finite(logits)
    if params.greedy:
        return greedy
    return sample_rows([params] * len(gens), logits, gens)


def generate_step(logits: torch.Tensor, ids: torch.Tensor, processors) -> list[int]:
    """`generate`'s step: argmax, or its warpers on the batch, softmax and one multinomial."""
    if processors is None:
        return torch.argmax(logits, dim=-1).tolist()
    scores = processors(ids, logits)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1).tolist()


def alternated(generate, engine, rounds: int, clock) -> tuple[float, float]:
    """Median `clock` seconds of `generate` and `engine`, alternated for `rounds` rounds after one
    that warms both up."""
    sides: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds + 1):
        for times, fn in zip(sides, (generate, engine)):
            c0 = clock()
            fn()
            times.append(clock() - c0)
    return statistics.median(sides[0][1:]), statistics.median(sides[1][1:])


def static(rounds: int) -> None:
    """`--static`: sampled static batches of the in-process engine against `generate`'s."""
    import threading

    from engine_rates import eager_anchor, served_round_parser

    from moeflow.model.models import load_model
    from moeflow.serving.engine import Engine, EngineConfig
    from moeflow.serving.sampling import SamplingParams

    args = served_round_parser(__doc__, rounds).parse_args([])
    anchor, batch = eager_anchor(args)
    from transformers import AutoTokenizer

    engine = Engine(load_model(args.model, torch.float32), AutoTokenizer.from_pretrained(args.model),
                    EngineConfig(max_num_seqs=len(batch)))
    engine.warm_up()
    engine.start()
    ids = torch.tensor(batch)
    new = args.output_len
    print(f"{len(batch)} prompts x {args.input_len} in / {new} out on {Path(args.model).name}, one thread; "
          f"median CPU ms per round of {rounds} alternated rounds")
    print(f"  {'setting':28s} {'generate':>9s} {'engine':>9s}  generate / engine")
    try:
        for name, knobs in (("greedy", {}), ("temperature 0.7", dict(temperature=0.7)),
                            ("temperature 0.7, top_p 0.9", dict(temperature=0.7, top_p=0.9)),
                            ("temperature 0.7, top_k 50", dict(temperature=0.7, top_k=50))):
            def gen(knobs=knobs) -> None:
                sample = {"do_sample": True, "top_k": 0, **knobs} if knobs else {"do_sample": False}
                anchor.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                pad_token_id=0, **sample)

            def eng(knobs=knobs) -> None:
                done = threading.Semaphore(0)
                for i, p in enumerate(batch):
                    engine.submit(f"s{time.monotonic_ns()}-{i}", p,
                                  SamplingParams(max_tokens=new, ignore_eos=True, seed=i, **knobs),
                                  lambda d: done.release() if d.finish_reason else None)
                for _ in batch:
                    done.acquire()

            g, e = alternated(gen, eng, rounds, time.process_time)
            print(f"  {name:28s} {1e3 * g:9.1f} {1e3 * e:9.1f}  {g / e:6.2f}")
    finally:
        engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--static", action="store_true", help="sampled static batches on the demo model, end to end")
    args = p.parse_args()
    if args.static:
        static(args.rounds)
        return

    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from moeflow.serving.sampling import SamplingParams, make_generator

    torch.set_num_threads(1)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.zeros(args.rows, 1, dtype=torch.long)
    settings = {
        "greedy": (SamplingParams(), None),
        "temperature 0.7": (SamplingParams(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
        "temperature 0.7, top_p 0.9": (SamplingParams(temperature=0.7, top_p=0.9),
                                       [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)]),
        "temperature 0.7, top_k 50": (SamplingParams(temperature=0.7, top_k=50),
                                      [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50)]),
    }
    print(f"one step's sampling of {args.rows} rows x {args.vocab} tokens, one thread; median CPU ms of "
          f"{args.rounds} alternated rounds")
    print(f"  {'setting':28s} {'generate':>9s} {'engine':>9s}  generate / engine")
    for name, (params, warpers) in settings.items():
        gens = [make_generator(7 + i) for i in range(args.rows)]
        processors = LogitsProcessorList(warpers or [])

        engine = functools.partial(engine_step, logits, params, gens)
        generate = functools.partial(generate_step, logits, ids, processors if warpers else None)
        g, e = alternated(generate, engine, args.rounds, time.thread_time)
        print(f"  {name:28s} {1e3 * g:9.2f} {1e3 * e:9.2f}  {g / e:6.2f}")


if __name__ == "__main__":
    main()
