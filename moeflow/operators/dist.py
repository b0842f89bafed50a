"""Measurements over real process groups (gloo on CPU, NCCL where GPUs are).

- `ep_rank_load`: load a checkpoint with transformers' `DistributedConfig(ep_size=N)`
  in N processes, feed each its share of the calibration texts, and count the
  (token, expert) pairs its expert-parallel experts modules route to each rank
  (their own sharding decides the rank) — the per-rank load an expert-parallel
  deployment of this checkpoint sees.
- `dispatch_bench`: move one MoE layer's tokens to their experts' ranks by
  all-to-all (each rank sends only the rows the other ranks' experts need) and by
  all-gather (every rank receives every token), timed, with the bytes each moves.

Axis letters: T tokens per rank, H hidden, k experts per token, W world size.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from moeflow.core.ports import free_port
from moeflow.model.models import load_model


def _init(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    # lazy: torch: heavy, loaded only when this runs
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, rank=rank, world_size=world)


def _spawn(target, world: int, args: tuple) -> list[dict]:
    """Run `target(rank, world, port, out_prefix, *args)` in `world` processes; their JSON results."""
    # lazy: torch: heavy, loaded only when this runs
    import torch.multiprocessing as mp

    # the ranks are gloo processes on CPU: on a GPU host transformers would bind each to
    # cuda:LOCAL_RANK (rank 1 of a 1-GPU host fails), so they start with no GPU visible
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        with tempfile.TemporaryDirectory(prefix="moeflow-dist-") as tmp:
            prefix = str(Path(tmp) / "rank")
            mp.spawn(target, args=(world, free_port(), prefix, *args), nprocs=world, join=True)
            return [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(world)]
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _write(prefix: str, rank: int, obj) -> None:
    Path(f"{prefix}.{rank}").write_text(json.dumps(obj))


# ---------------------------------------------------------------- per-rank expert load


def _ep_worker(rank: int, world: int, port: int, prefix: str, model_dir: str, texts: list[str]) -> None:
    # lazy: torch, transformers: heavy, loaded only when this runs
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from transformers.distributed import DistributedConfig


    torch.set_num_threads(1)
    _init(rank, world, port)
    model = load_model(model_dir, torch.float32,
                       distributed_config=DistributedConfig(fsdp_size=world, ep_size=world)).eval()
    per_rank = torch.zeros(world, dtype=torch.long)  # [W] pairs this rank's batch sends to each rank

    def count(module, args, kwargs):
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [T, k] global expert ids
        dest = (top_k_index // module.num_experts).reshape(-1)  # num_experts: the local count under EP
        per_rank.add_(torch.bincount(dest, minlength=world))

    experts = [m for m in model.modules() if getattr(m, "_is_expert_parallel", False)]
    for module in experts:
        module.register_forward_pre_hook(count, with_kwargs=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():  # not inference_mode: FSDP's unshard tracks tensor versions
        for text in texts[rank::world]:  # one text per forward: no padding rows reach the experts
            model(**tok(text, return_tensors="pt"))
    dist.all_reduce(per_rank)  # what every rank's experts received from all batches
    _write(prefix, rank, {"received": int(per_rank[rank]), "experts_modules": len(experts)})
    dist.destroy_process_group()


def ep_rank_load(model_dir: str, texts: list[str], ep: int = 2) -> dict:
    """Per-rank routed (token, expert) pairs of `model_dir` under transformers' EP.

    Each rank takes every ep-th text (a data-parallel split, as AllToAllEP expects);
    the texts are cut to a multiple of `ep` so every rank runs the same forwards.

    Returns:
        {"ep", "per_rank": [W], "max_over_mean", "balancedness"}.
    """
    texts = texts[:len(texts) - len(texts) % ep]
    parts = _spawn(_ep_worker, ep, (model_dir, texts))
    if not parts[0]["experts_modules"]:
        raise RuntimeError(f"{model_dir}: transformers did not shard any experts module at EP {ep}")
    per_rank = [p["received"] for p in parts]
    mean = sum(per_rank) / len(per_rank)
    peak = max(per_rank)
    return {"ep": ep, "per_rank": per_rank, "max_over_mean": round(peak / mean, 4) if mean else None,
            "balancedness": round(mean / peak, 4) if peak else None}


# ---------------------------------------------------------------- dispatch


def _dispatch_worker(rank: int, world: int, port: int, prefix: str, tokens: int, hidden: int,
                     experts: int, top_k: int, dtype: str, iters: int) -> None:
    # lazy: torch: heavy, loaded only when this runs
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
    # lazy: torch: heavy, loaded only when this runs
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
