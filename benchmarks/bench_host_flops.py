"""Peak `torch.mm` FLOP/s of this host, fp32 and bf16, on one torch thread and on every core.

    .venv/bin/python benchmarks/bench_host_flops.py            # 2048 x 2048 matrices, best of 5
    .venv/bin/python benchmarks/bench_host_flops.py --size 1024 --repeats 9

`cluster/hardware/cpu-local.yaml` (the demo host's hardware spec: the planner prices CPU work
by its `*_tflops` per core) rests on this figure, as does docs/facts.md. Each row is the best of
`--repeats` timed products after one warm-up product (a peak, as a spec's vendor figure is),
timed twice: by the wall clock, which other work on a shared host lowers, and by the process's
CPU clock (`time.process_time`: every thread's CPU seconds), which reads what a core does while
it runs this work -- the figure a spec's per-core rate means, and the one that holds on a busy
host. The load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def peak_gflops(size: int, dtype: torch.dtype, threads: int, repeats: int) -> tuple[float, float]:
    """(best wall-clock GFLOP/s, best GFLOP/s per CPU-second) of `repeats` size x size
    products in `dtype` on `threads` torch threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernel selection, first-touch of the output
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    flop = 2 * size ** 3 / 1e9
    return flop / wall, flop / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    for dt in (torch.float32, torch.bfloat16):
        for n in sorted({1, cores}):
            wall, per_cpu_s = peak_gflops(args.size, dt, n, args.repeats)
            rows.append({"dtype": str(dt).removeprefix("torch."), "threads": n, "wall_gflops": round(wall, 1),
                         "gflops_per_core": round(per_cpu_s, 1)})
    for r in rows:
        print(f"torch.mm {r['dtype']:9} {r['threads']} thread(s): {r['wall_gflops']:7.1f} GFLOP/s by the wall clock, "
              f"{r['gflops_per_core']:7.1f} per core by the CPU clock")
    print(json.dumps({"size": args.size, "repeats": args.repeats, "cores": cores, "rows": rows,
                      "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
