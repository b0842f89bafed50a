"""Chunked prefill: a long prompt arriving among decoding streams, their inter-token latency.

    .venv/bin/python benchmarks/bench_long_prompt.py                  # demo model, 16 streams, 4,096 tokens
    .venv/bin/python benchmarks/bench_long_prompt.py --repeat 3 --max-num-batched-tokens 256
    .venv/bin/python benchmarks/bench_long_prompt.py --prefill-keys-per-token 0   # vLLM's plain token count
    .venv/bin/python benchmarks/bench_long_prompt.py --step-costs     # one step's cost by chunk and context

`--streams` requests of `--input-len` random tokens decode `--output-len`
tokens each on the in-process engine (its own thread). The same round runs
twice per repeat: alone, and with one `--long-len`-token prompt submitted once
every stream has its first token. Reported per round: the p50 and p99 of the
streams' inter-token latencies (every gap between two tokens of a stream), the
long prompt's TTFT, and the streams' ITL p50 over the gaps that ended while
the long prompt was prefilled / their p50 alone (what a step carrying a chunk
costs them; steadier than p99 on a busy host, where the p99 alone is the
host's noise). The ratio is p99 with the long prompt / p99 alone. Before the rounds, one round
alone and one with another long prompt of the same length warm both sides, so
neither pays first-time costs in the rounds (the first chunks at each context
size cost more the first time: steady state against steady state).
The demo model's context is 512 positions; `max_model_len` is raised to fit
the long prompt (rotary positions extend; the weights are random anyway).
`stream_interval` plays no part: the engine's own sink sees every token.
Target (issue 51): the long prompt raises the streams' p99 ITL by <= 2x.

Every engine step is traced (`StepTrace`): what it carried, its wall and
thread-CPU time, the loop's time between steps, GC passes. Per round it
prints the same p99 ratio on the CPU clock -- the p99 of the steps' thread CPU
with the long prompt / alone; every stream's gap is one step, and a busy host
barely moves a thread's CPU time where it multiplies wall time -- the long
prompt's prefill steps and their CPU (its TTFT on that clock), the chunk
steps' CPU / the decode-only steps' by context, and what made each gap over
the p99 alone (a chunk step, a decode-only one, a step descheduled by the
host, the loop outside steps, a GC pass). `--trace-out` writes the steps.
`--step-costs` instead times one step (thread CPU) with the streams' decodes
and a chunk of n tokens at a context of L, against the decodes alone, and fits
the chunk's extra cost to tokens, context and query-key pairs: what the
scheduler's charge (scheduler.py) is set from.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import random
import statistics
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


class StepTrace:
    """Every engine step timed (issue 51, what sets the p99): what it carried -- its decodes and
    prompt chunks, the keys a chunk attends to -- and its wall and thread-CPU time (CPU survives a
    busy host), plus the loop's time between steps and the GC passes, by wrapping the core's
    `Scheduler.schedule` and `EngineCore.step` (no product change)."""

    def __init__(self, core) -> None:
        self.steps: list[dict] = []
        self.gcs: list[tuple[float, float]] = []  # (start, end) perf_counter of each collection
        self._gc_t0 = 0.0
        sched, step = core.sched.schedule, core.step
        pending: list = []

        def schedule():
            decodes, chunks = sched()
            pending[:] = [len(decodes), [(n, s.num_cached, s.req_id == "long") for s, n in chunks]]
            return decodes, chunks

        def timed() -> bool:
            pending.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            ran = step()
            t1, c1 = time.perf_counter(), time.thread_time()
            if ran and pending:
                decodes, chunks = pending
                self.steps.append({"t0": t0, "t1": t1, "wall": t1 - t0, "cpu": c1 - c0, "decodes": decodes,
                                   "chunk": sum(n for n, _, _ in chunks),
                                   "long": sum(n for n, _, lg in chunks if lg),  # the long prompt's chunk
                                   "context": max((c + n for n, c, _ in chunks), default=0),
                                   # query-key pairs of the chunks' causal attention
                                   "pairs": sum(n * c + n * (n + 1) // 2 for n, c, _ in chunks)})
            return ran
        core.sched.schedule, core.step = schedule, timed

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_t0 = time.perf_counter()
            else:
                self.gcs.append((self._gc_t0, time.perf_counter()))
        gc.callbacks.append(on_gc)

    def clear(self) -> None:
        self.steps.clear()
        self.gcs.clear()

    def cpu_p99(self) -> float:
        """p99 of the thread CPU of the steps that decoded the streams (every stream's gap is one
        such step, so this is their ITL p99 on the CPU clock, which a busy host barely moves)."""
        return pct([s["cpu"] for s in self.steps if s["decodes"] > 1], 0.99)

    def prefill_cpu(self) -> tuple[int, float]:
        """The steps that carried a chunk of the long prompt and their thread CPU summed (its TTFT
        on the CPU clock)."""
        ch = [s["cpu"] for s in self.steps if s["long"]]
        return len(ch), sum(ch)

    def explain(self, stamps: list[list[float]], over: float) -> str:
        """What each stream gap longer than `over` s spanned: the step that made its token (a
        chunk step or decode-only), that step's CPU, the loop's time outside steps, a GC pass."""
        ends = [s["t1"] for s in self.steps]
        kinds: dict[str, list[float]] = {}
        for s in stamps:
            for a, b in zip(s, s[1:]):
                if b - a <= over:
                    continue
                i = bisect.bisect_right(ends, b) - 1  # the step whose output carried the token at b
                st = self.steps[i] if i >= 0 else None
                kind = "no step" if st is None else "a long-prompt chunk step" if st["long"] else \
                    "another chunk step" if st["chunk"] else "decode-only step"
                if st is not None and st["cpu"] < 0.6 * st["wall"]:
                    kind += ", descheduled (its CPU < 0.6 x its wall)"
                if i - bisect.bisect_right(ends, a) > 0:  # more than this step ended inside the gap
                    kind += ", spans more steps"
                if st is not None and b - st["t1"] > 0.5 * (b - a):
                    kind += ", mostly after the step (loop, sinks)"
                if any(g0 < b and g1 > a for g0, g1 in self.gcs):
                    kind += ", a GC pass in it"
                kinds.setdefault(kind, []).append(b - a)
        return "; ".join(f"{k}: {len(v)} (max {1000 * max(v):.1f} ms)" for k, v in sorted(kinds.items())) or "none"

    def summary(self, ref: list[dict]) -> str:
        """The chunk steps against the decode-only steps of `ref` (the round alone): count, median
        wall and thread CPU (ms), the chunk steps' CPU / the decode-only median by context."""
        dec = [s for s in ref if not s["chunk"] and s["decodes"] > 1]
        ch = [s for s in self.steps if s["long"]]
        if not dec or not ch:
            return "no chunk steps" if dec else "no decode-only steps"
        md = statistics.median(s["cpu"] for s in dec)
        parts = [f"decode-only steps alone {len(dec)}: wall {1000 * statistics.median(s['wall'] for s in dec):.2f} "
                 f"ms, CPU {1000 * md:.2f} ms",
                 f"steps with a chunk of the long prompt {len(ch)}: wall "
                 f"{1000 * statistics.median(s['wall'] for s in ch):.2f} ms, "
                 f"CPU {1000 * statistics.median(s['cpu'] for s in ch):.2f} ms, CPU / decode-only's by context "
                 + " ".join(f"<{hi}: {statistics.median(x) / md:.2f}"
                            for lo, hi in ((0, 1024), (1024, 2048), (2048, 3072), (3072, 99999))
                            if (x := [s["cpu"] for s in ch if lo <= s["context"] < hi]))
                 + f" (max {max(s['cpu'] for s in ch) / md:.2f})"]
        gaps = [b["t0"] - a["t1"] for a, b in zip(self.steps, self.steps[1:])]
        parts.append(f"between steps: median {1000 * statistics.median(gaps):.2f} ms, max {1000 * max(gaps):.2f} ms")
        parts.append(f"GC passes {len(self.gcs)}, longest {1000 * max((b - a for a, b in self.gcs), default=0):.2f} ms")
        return "; ".join(parts)

def one_round(engine, streams: list[list[int]], new: int,
              long: list[int] | None) -> tuple[list[float], float, list[float], list[list[float]]]:
    """Inter-token gaps (s) of every stream, the long prompt's TTFT (s; 0 without one), the
    gaps that ended while the long prompt was prefilled (its submission to its first token), and
    every stream's token times."""
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
    return gaps, (long_first[0] - t0) if long_first else 0.0, during, stamps


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
    p.add_argument("--trace-out", help="every engine step of the rounds with the long prompt, one JSON line each")
    p.add_argument("--step-costs", action="store_true",
                   help="instead: one step's CPU time with a chunk of n tokens at context L / decodes alone")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeflow.serving.engine import Engine, EngineConfig

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(0)
    streams = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.streams)]
    # --step-costs times chunks up to 256 tokens after a context of up to --long-len
    long = [rng.randrange(3, vocab) for _ in range(args.long_len + (512 if args.step_costs else 0))]
    # the warm-up's long prompt: as long, other tokens (the prefix cache must not serve the rounds')
    warm_long = [rng.randrange(3, vocab) for _ in range(args.long_len)]
    thr: dict = {} if args.long_prefill_token_threshold is None else \
        {"long_prefill_token_threshold": args.long_prefill_token_threshold}
    if args.prefill_keys_per_token is not None:
        thr["prefill_keys_per_token"] = args.prefill_keys_per_token or None
    engine = Engine(model, AutoTokenizer.from_pretrained(args.model),
                    EngineConfig(max_model_len=len(long) + args.output_len + 8, max_num_seqs=args.streams + 1,
                                 max_num_batched_tokens=args.max_num_batched_tokens, paged_kv=not args.padded,
                                 **thr))
    if args.step_costs:
        try:
            step_costs(engine, streams, long, args)
        finally:
            engine.stop()
        return
    trace = StepTrace(engine.core)
    engine.start()
    print(f"{args.streams} streams of {args.input_len} + {args.output_len} tokens; a {args.long_len}-token prompt "
          f"arrives once all have their first token; token budget {args.max_num_batched_tokens}; "
          f"{'padded batches' if args.padded else 'paged'}")
    ratios, mids, ttfts, cpu_ratios, ttft_cpu = [], [], [], [], []
    dump = open(args.trace_out, "w") if args.trace_out else None
    try:
        # warm both sides, so both are measured in steady state: the streams alone, and a long prompt
        # among them (its first chunks at each context size otherwise pay one-time costs in round 0)
        one_round(engine, streams, 8, None)
        one_round(engine, streams, args.output_len, warm_long)
        for r in range(args.repeat):
            trace.clear()
            alone, _, _, _ = one_round(engine, streams, args.output_len, None)
            ref, cpu_alone = list(trace.steps), trace.cpu_p99()  # the decode-only steps of the round alone
            trace.clear()
            mixed, ttft, during, stamps = one_round(engine, streams, args.output_len, long)
            ratio = pct(mixed, 0.99) / pct(alone, 0.99)
            ratios.append(ratio)
            cpu_ratios.append(trace.cpu_p99() / cpu_alone)
            ttfts.append(ttft)
            # less noisy on a busy host than p99: what a step carrying a chunk costs the streams
            mids.append(statistics.median(during) / statistics.median(alone) if during else float("nan"))
            print(f"round {r}: ITL alone p50 {1000 * pct(alone, 0.5):6.2f} ms p99 {1000 * pct(alone, 0.99):6.2f} ms | "
                  f"with the long prompt p50 {1000 * pct(mixed, 0.5):6.2f} ms p99 {1000 * pct(mixed, 0.99):6.2f} ms | "
                  f"p99 ratio {ratio:.2f} | long prompt TTFT {ttft:.2f} s | ITL p50 during its prefill "
                  f"/ p50 alone {mids[-1]:.2f}")
            n_pre, cpu_pre = trace.prefill_cpu()
            ttft_cpu.append(cpu_pre)
            print(f"  on the CPU clock: p99 of the steps' thread CPU with the long prompt / alone "
                  f"{cpu_ratios[-1]:.2f} (the p99 ratio a quiet host would see); the long prompt's {n_pre} "
                  f"prefill steps took {cpu_pre:.2f} s of CPU")
            print(f"  steps with the long prompt: {trace.summary(ref)}")
            print(f"  gaps over the p99 alone ({1000 * pct(alone, 0.99):.2f} ms), what made them: "
                  f"{trace.explain(stamps, pct(alone, 0.99))}")
            if dump is not None:
                for st in trace.steps:
                    dump.write(json.dumps({"round": r, **st}) + "\n")
    finally:
        engine.stop()
        if dump is not None:
            dump.close()
    print(f"median p99 ratio {statistics.median(ratios):.2f} (target <= 2.0), rounds over 2.0: "
          f"{sum(x > 2.0 for x in ratios)} of {len(ratios)}; median ITL p50 during the long prompt's prefill / p50 "
          f"alone {statistics.median(mids):.2f}; long prompt TTFT median {statistics.median(ttfts):.2f} s")
    print(f"on the CPU clock: median p99 ratio {statistics.median(cpu_ratios):.2f}, rounds over 2.0: "
          f"{sum(x > 2.0 for x in cpu_ratios)} of {len(cpu_ratios)} ({', '.join(f'{x:.2f}' for x in cpu_ratios)}); "
          f"the long prompt's prefill CPU median {statistics.median(ttft_cpu):.2f} s")


def step_costs(engine, streams: list[list[int]], long: list[int], args) -> None:
    """One packed step's thread-CPU time with the streams' decodes and a chunk of n prompt tokens
    at a context of L, over its time with the decodes alone (steps run on this thread, the
    scheduler's choice replaced; the chunk rolled back after each, so every n is timed at the same
    L; decode-only and chunk steps interleaved, medians of --repeat x 3 rounds). The last column is
    what the engine's scheduler picks at that context (its own `schedule`)."""
    from moeflow.serving.engine import SamplingParams
    from moeflow.serving.scheduler import Scheduler

    core = engine.core
    sizes = [8, 16, 32, 64, 128, 256]
    contexts = [c for c in (0, 512, 1024, 2048, 3072, 4096) if c + max(sizes) < len(long)]
    for i, ids in enumerate(streams):
        engine.submit(f"s{i}", ids, SamplingParams(max_tokens=core.max_model_len - len(ids) - 1, ignore_eos=True),
                      lambda d: None)
    forced: list = []
    core.sched.schedule = lambda: forced[0]

    def run(n: int) -> float:
        decodes = [s for s in core.running if not s.is_prefill]
        chunk = [(s, len(s.tokens) - s.num_cached) for s in core.running if s.is_prefill and s.req_id != "long"]
        chunk += [(s, n) for s in core.running if s.req_id == "long"] if n else []
        forced[:] = [(decodes, chunk)]
        c0 = time.thread_time()
        core.step()
        took = time.thread_time() - c0
        core._flush()
        return took
    core._drain_inbox()
    for _ in range(4):
        run(0)  # admits the streams, their prompts, then decodes
    engine.submit("long", long, SamplingParams(max_tokens=1, ignore_eos=True), lambda d: None)
    core._drain_inbox()
    run(0)  # admits it
    seq = next(s for s in core.running if s.req_id == "long")
    pick = Scheduler(core.config)
    print(f"one step's thread-CPU time, {len(streams)} decodes + a chunk of n tokens at context L, / the decodes "
          f"alone (median of {3 * args.repeat}); scheduler: {pick.config.max_num_batched_tokens} budget, "
          f"{pick.config.prefill_keys_per_token} keys a token")
    rows: list[tuple[int, int, float]] = []  # (n, L, the chunk's extra cost in decode-only steps)
    print(f"{'L':>6} {'decodes ms':>10} " + " ".join(f"{'n=' + str(n):>7}" for n in sizes) + "   picked n: ratio")
    for ctx in contexts:
        while seq.num_cached < ctx:
            run(min(256, ctx - seq.num_cached))
        pick.running = [s for s in core.running if not s.is_prefill] + [seq]
        chosen = pick.schedule()[1][0][1]
        times: dict[int, list[float]] = {n: [] for n in [0, *sizes, chosen]}
        for _ in range(3 * args.repeat):
            for n in times:
                seq.num_cached = ctx
                times[n].append(run(n))
        seq.num_cached = ctx
        med = {n: statistics.median(v) for n, v in times.items()}
        rows += [(n, ctx, med[n] / med[0] - 1) for n in sizes]
        print(f"{ctx:>6} {1000 * med[0]:>10.2f} " + " ".join(f"{med[n] / med[0]:>7.2f}" for n in sizes)
              + f"   {chosen:>4}: {med[chosen] / med[0]:.2f}")
    # least squares: extra = a + b n + c L + d (query-key pairs), in decode-only steps
    x = torch.tensor([[1.0, n, L, n * L + n * (n + 1) / 2] for n, L, _ in rows], dtype=torch.float64)
    y = torch.tensor([[e] for _, _, e in rows], dtype=torch.float64)
    a, b, c, d = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    print(f"fit, a chunk's extra cost in decode-only steps: {a:.3f} + {b:.2e} n + {c:.2e} L + {d:.2e} pairs; "
          f"keys a token {b / d:.0f} (the token cost / the pair cost), a decode step = {1 / b:.0f} tokens, "
          f"a chunk's gather = {c / d:.1f} query rows' pairs (GATHER_ROWS)" if b > 0 and c > 0 and d > 0 else "")

if __name__ == "__main__":
    main()
