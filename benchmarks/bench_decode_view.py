"""The decode view (moeflow/serving/paged.py `DecodeView`) against gathering every step, and both
against `generate`, in one run.

    .venv/bin/python benchmarks/bench_decode_view.py                        # 64 new tokens, 15 rounds
    .venv/bin/python benchmarks/bench_decode_view.py --output-len 256 --rounds 7

Two in-process engines over the demo model, one with the view (EngineConfig.decode_view_bytes
at its default) and one without (0: each decode step gathers the rows' keys and values from the
pool), and `generate` on the same prompts as one batch, alternated round by round in this process
(`--num-prompts` prompts of `--input-len` random tokens, exactly `--output-len` new tokens each,
greedy). Each round is timed by this process's CPU clock (time.process_time: the engine's thread
does the work while the main thread waits), which a busy host moves far less than the wall
clock; the medians over `--rounds` are printed with `generate`'s CPU / each engine's (above 1:
the engine spends less CPU than `generate` for the same tokens).
"""

from __future__ import annotations

import sys
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
    view = EngineConfig().decode_view_bytes
    engines = {name: Engine(load_model(args.model, torch.float32), tok,
                            EngineConfig(max_num_seqs=args.num_prompts, decode_view_bytes=budget))
               for name, budget in (("gather", 0), ("view", view))}
    for e in engines.values():
        e.warm_up()
        e.start()

    med, _ = engines_against_generate(lambda: generate_tps(anchor, batch, args.output_len), engines, batch,
                                      args.output_len, args.rounds)
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, {args.rounds} alternated "
          f"rounds; median CPU ms per round")
    print(f"  generate (one batch)                  {1e3 * med['generate']:8.1f}")
    print(f"  engine, gathering every decode step   {1e3 * med['gather']:8.1f}   generate / engine "
          f"{med['generate'] / med['gather']:.3f}")
    print(f"  engine, decode view ({view >> 20} MiB budget)   {1e3 * med['view']:8.1f}   generate / engine "
          f"{med['generate'] / med['view']:.3f}")
    print(f"  the view saves {100 * (1 - med['view'] / med['gather']):.1f}% of the engine's CPU per round")


if __name__ == "__main__":
    main()
