"""CPU per round of the served engine's parts against `generate`'s, in one run.

    .venv/bin/python benchmarks/bench_served_cpu.py [--rounds 8] [--model DIR]

On a shared host the wall clock of a round swings with the others' load, and a serving stack's
wall rate there follows the CPU all of its processes spend (docs/serving.md: autogroups); the CPU
seconds of a round move much less. Per round (`--num-prompts` prompts of `--input-len` random
tokens, exactly `--output-len` new tokens each, greedy, one torch thread), alternating:

1. `generate` on all prompts as one batch (the anchor bench_engine.py's static batch uses);
2. the in-process engine (`Engine`, its core on a thread; the front end's text and metrics on
   that thread too) with every request submitted at once;
3. the engine core in its own process, as a replica runs it (`CoreClient`,
   `deploy.engine_process`): the core process's CPU (every thread's, read at nanoseconds from
   /proc's schedstat) and this process's (the front end: the reader thread's unpickling, text
   and metrics), with every request submitted at once.

Each engine counts the expert load as a replica does (`ExpertLoad`). Prints the median CPU
milliseconds of each part and each total / `generate`'s: the share of a round that is the engine
against the share that is serving it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from engine_rates import engine_tps, prompts, round_args, task_cpu  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, str(REPO / "assets" / "demo-base"))
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()

    from transformers import AutoTokenizer

    from moeflow.model.models import load_model
    from moeflow.serving.core import CoreClient
    from moeflow.serving.engine import Engine, EngineConfig
    from moeflow.serving.metrics import ExpertLoad
    from moeflow.serving.settings import ServeSettings

    torch.set_num_threads(1)  # as a replica (ServeSettings.torch_threads) and its core
    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(args.model)
    anchor = load_model(args.model, torch.float32).eval()
    batch = prompts(args.num_prompts, args.input_len, anchor.config.vocab_size, 0)
    new, seqs = args.output_len, {"max_num_seqs": args.num_prompts}
    ids = torch.tensor(batch)
    model = load_model(args.model, torch.float32).eval()
    engine = Engine(model, tok, EngineConfig(**seqs), experts=ExpertLoad(model))
    engine.warm_up()
    engine.start()
    client = CoreClient(ServeSettings(base_dir=args.model, served_model_name="demo", engine=seqs), {}, tok)
    try:
        def generate() -> None:
            anchor.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0)

        def cpu_of(fn) -> float:
            t0 = time.process_time()
            fn()
            return time.process_time() - t0

        def split() -> tuple[float, float]:
            core, front = task_cpu(client.pid), time.process_time()
            engine_tps(client, batch, new, True)
            return task_cpu(client.pid) - core, time.process_time() - front

        generate(), engine_tps(engine, batch, new, True), engine_tps(client, batch, new, True)  # warm-up
        rounds = [(cpu_of(generate), cpu_of(lambda: engine_tps(engine, batch, new, True)), *split())
                  for _ in range(args.rounds)]
    finally:
        client.stop()
        engine.stop()
    gen, inproc, core, front = (statistics.median(r[i] * 1000 for r in rounds) for i in range(4))
    print(f"\n{args.num_prompts} prompts x {args.input_len} in x {new} out, one torch thread; CPU ms per round, "
          f"medians of {args.rounds} alternated rounds")
    print(f"{'generate, one batch':44} {gen:8.1f}   1.00")
    print(f"{'engine in process (core + front end)':44} {inproc:8.1f} {inproc / gen:6.2f}")
    print(f"{'engine core process':44} {core:8.1f} {core / gen:6.2f}")
    print(f"{'  + its front end (replica side)':44} {front:8.1f} {(core + front) / gen:6.2f}")


if __name__ == "__main__":
    main()
