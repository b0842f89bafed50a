"""The engine's paged forwards in inference mode against the same forwards under no_grad, and
both against `generate`, in one run.

    .venv/bin/python benchmarks/bench_inference_mode.py                       # 64 new tokens, 15 rounds
    .venv/bin/python benchmarks/bench_inference_mode.py --output-len 256 --rounds 7

Two in-process engines over the demo model, one as served (ModelRunner.inference_mode: its paged
forwards in `torch.inference_mode`, as vLLM's model runner) and one with it off (the forwards
under no_grad only, as `generate` runs), and `generate` on the same prompts as one batch,
alternated round by round in this process (`--num-prompts` prompts of `--input-len` random
tokens, exactly `--output-len` new tokens each, greedy). Each round is timed by this process's
CPU clock, which a busy host moves far less than the wall clock; the medians over `--rounds` are
printed with `generate`'s CPU / each engine's (above 1: the engine spends less CPU than
`generate` for the same tokens), and the tokens of the two engines are compared.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from engine_rates import cpu_round_setup, engines_against_generate  # noqa: E402


def main() -> None:
    args, anchor, batch, tok = cpu_round_setup(__doc__, str(REPO / "assets" / "demo-base"))

    from bench_engine import generate_tps

    from moeflow.model.models import load_model
    from moeflow.serving.engine import Engine, EngineConfig
    from moeflow.serving.sampling import SamplingParams

    engines = {}
    for name, on in (("no_grad", False), ("inference", True)):
        e = Engine(load_model(args.model, torch.float32), tok, EngineConfig(max_num_seqs=args.num_prompts))
        e.core.runner.inference_mode = on
        e.warm_up()
        e.start()
        engines[name] = e

    def tokens(e) -> list[list[int]]:
        """Greedy tokens of the round's prompts, all at once."""
        out: list[list[int]] = [[] for _ in batch]
        done = threading.Semaphore(0)

        def sink(delta, i):
            out[i].extend(delta.token_ids)
            if delta.finish_reason:
                done.release()
        for i, ids in enumerate(batch):
            e.submit(f"t{time.monotonic_ns()}-{i}", ids, SamplingParams(max_tokens=args.output_len, ignore_eos=True),
                     lambda d, i=i: sink(d, i))
        for _ in batch:
            done.acquire()
        return out

    med, same = engines_against_generate(lambda: generate_tps(anchor, batch, args.output_len), engines, batch,
                                         args.output_len, args.rounds,
                                         first=lambda: tokens(engines["no_grad"]) == tokens(engines["inference"]))
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, {args.rounds} alternated "
          f"rounds; median CPU ms per round")
    print(f"  generate (one batch, no_grad)         {1e3 * med['generate']:8.1f}")
    for name, label in (("no_grad", "engine, forwards under no_grad     "),
                        ("inference", "engine, forwards in inference mode")):
        print(f"  {label}    {1e3 * med[name]:8.1f}   generate / engine {med['generate'] / med[name]:.3f}")
    print(f"  inference mode saves {100 * (1 - med['inference'] / med['no_grad']):.1f}% of the engine's CPU per "
          f"round; greedy tokens equal: {same}")


if __name__ == "__main__":
    main()
