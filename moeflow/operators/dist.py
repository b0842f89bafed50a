"""Measurements over real process groups (gloo on CPU, NCCL where GPUs are).

- `ep_rank_load`: load a checkpoint with transformers' `DistributedConfig(ep_size=N)`
  in N processes and count the (token, expert) pairs each rank's experts actually
  run on the calibration texts — the per-rank load an expert-parallel deployment
  of this checkpoint sees.
- `dispatch_bench`: move one MoE layer's tokens to their experts' ranks by
  all-to-all (each rank sends only the rows the other ranks' experts need) and by
  all-gather (every rank receives every token), timed, with the bytes each moves.

Axis letters: T tokens per rank, H hidden, k experts per token, W world size.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

COUNT_IMPL = "moeflow_count"  # experts implementation that counts the rows it runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, rank=rank, world_size=world)


def _spawn(target, world: int, args: tuple) -> list[dict]:
    """Run `target(rank, world, port, out_prefix, *args)` in `world` processes; their JSON results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moeflow-dist-") as tmp:
        prefix = str(Path(tmp) / "rank")
        mp.spawn(target, args=(world, _free_port(), prefix, *args), nprocs=world, join=True)
        return [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(world)]


def _write(prefix: str, rank: int, obj) -> None:
    Path(f"{prefix}.{rank}").write_text(json.dumps(obj))


# ---------------------------------------------------------------- per-rank expert load


def _register_counter(counts: dict) -> None:
    """Register an experts implementation that counts the local (token, expert) rows it
    runs (EP sentinels, ids >= the local expert count, excluded), then runs grouped_mm."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    def counting(self, hidden_states, top_k_index, top_k_weights):
        local = int((top_k_index < self.num_experts).sum())
        counts[id(self)] = counts.get(id(self), 0) + local
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    ALL_EXPERTS_FUNCTIONS.register(COUNT_IMPL, counting)


def _ep_worker(rank: int, world: int, port: int, prefix: str, model_dir: str, texts: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer
    from transformers.distributed import DistributedConfig

    from moeflow.models import load_model

    torch.set_num_threads(1)
    _init(rank, world, port)
    counts: dict[int, int] = {}
    _register_counter(counts)
    model = load_model(model_dir, torch.float32, distributed_config=DistributedConfig(fsdp_size=world, ep_size=world),
                       experts_implementation=COUNT_IMPL).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():  # not inference_mode: FSDP's unshard tracks tensor versions
        for text in texts[rank::world]:  # one text per forward: no padding rows reach the experts
            model(**tok(text, return_tensors="pt"))
    _write(prefix, rank, sum(counts.values()))
    torch.distributed.destroy_process_group()


def ep_rank_load(model_dir: str, texts: list[str], ep: int = 2) -> dict:
    """Per-rank routed (token, expert) pairs of `model_dir` under transformers' EP.

    Each rank takes every ep-th text (a data-parallel split, as AllToAllEP expects);
    the texts are cut to a multiple of `ep` so every rank runs the same forwards.

    Returns:
        {"ep", "per_rank": [W], "max_over_mean", "balancedness"}.
    """
    texts = texts[:len(texts) - len(texts) % ep]
    per_rank = _spawn(_ep_worker, ep, (model_dir, texts))
    mean = sum(per_rank) / len(per_rank)
    peak = max(per_rank)
    return {"ep": ep, "per_rank": per_rank, "max_over_mean": round(peak / mean, 4) if mean else None,
            "balancedness": round(mean / peak, 4) if peak else None}


# ---------------------------------------------------------------- dispatch


def _dispatch_worker(rank: int, world: int, port: int, prefix: str, tokens: int, hidden: int,
                     experts: int, top_k: int, dtype: str, iters: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _init(rank, world, port)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen).to(getattr(torch, dtype))  # [T, H]
    idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices  # [T, k]
    per_rank = experts // world
    dest = (idx // per_rank).reshape(-1)  # [T*k] rank of each (token, expert) pair
    order = torch.argsort(dest, stable=True)
    rows = x[order // top_k]  # [T*k, H] pairs grouped by destination
    send = torch.bincount(dest, minlength=world)  # [W]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # the split sizes (what AllToAllEP exchanges first)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    out = rows.new_empty(sum(recv_sizes), hidden)

    def a2a():
        dist.all_to_all_single(out, rows, recv_sizes, send_sizes)  # dispatch
        dist.all_to_all_single(rows, out, send_sizes, recv_sizes)  # combine (results back)

    gathered = [torch.empty_like(x) for _ in range(world)]
    gathered_idx = [torch.empty_like(idx) for _ in range(world)]

    def gather():
        dist.all_gather(gathered, x)  # every token to every rank
        dist.all_gather(gathered_idx, idx)  # and its routing
        dist.all_reduce(x)  # partial outputs summed back

    item = x.element_size()
    off_rank = sum(s for r, s in enumerate(send_sizes) if r != rank)
    result = {"all_to_all": {"bytes": 2 * off_rank * hidden * item + 2 * world * 8,
                             "seconds": _timed(a2a, iters)},
              "all_gather": {"bytes": (world - 1) * tokens * (hidden * item + top_k * 8)
                             + 2 * (world - 1) * tokens * hidden * item,
                             "seconds": _timed(gather, iters)}}
    _write(prefix, rank, result)
    dist.destroy_process_group()


def _timed(fn, iters: int) -> float:
    """Median seconds of `fn` over `iters` runs after one warm-up, agreed across ranks (max)."""
    import torch
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    median = torch.tensor(sorted(times)[len(times) // 2])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def dispatch_bench(tokens: int, hidden: int, experts: int, top_k: int, dtype: str = "bfloat16",
                   world: int = 2, iters: int = 5) -> dict:
    """All-to-all vs all-gather dispatch (+ combine) of one MoE layer's tokens over
    `world` gloo ranks; uniform random routing.

    Returns:
        {"world", "tokens_per_rank", "all_to_all": {"bytes", "seconds"},
         "all_gather": {"bytes", "seconds"}} — bytes each rank sends and receives, max over ranks.
    """
    if experts % world:
        raise ValueError(f"{experts} experts do not split over {world} ranks")
    parts = _spawn(_dispatch_worker, world, (tokens, hidden, experts, top_k, dtype, iters))
    out = {"world": world, "tokens_per_rank": tokens, "dtype": dtype}
    for kind in ("all_to_all", "all_gather"):
        out[kind] = {"bytes": max(p[kind]["bytes"] for p in parts),
                     "seconds": round(max(p[kind]["seconds"] for p in parts), 6)}
    return out
