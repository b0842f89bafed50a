"""Process groups of a LoRA run: tensor (TP) x context (CP) x data (DP) parallel.

Rank layout, TP innermost (transformers' device mesh puts `tp` last, so its TP
groups are consecutive ranks): `rank = tp + TP * (cp + CP * dp)`. Transformers
itself only knows TP, EP and the data ranks (dp_replicate x fsdp); the CP ranks
of one DP replica are, to it, more data ranks: they hold the same weights (FSDP
shards over them too) and only this module knows they share one sequence.

  tp group    ranks that hold different shards of one layer and the same tokens
  cp group    ranks that hold different pieces of one sequence
  grad group  every rank with the same TP index (DP x CP): LoRA gradients of a
              token-weighted loss are summed over it (TP ranks already hold the
              full, identical gradient of replicated LoRA tensors and their own
              shard's gradient of sharded ones)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moeflow.parallel.memory import Plan


@dataclass(frozen=True)
class Degrees:
    """What the driver checked a plan to be (moeflow.training.driver.check_plan): world =
    tensor_parallel x data_parallel workers, the data ranks split into context_parallel
    ranks per sequence; `distributed`: the kwargs of transformers' DistributedConfig that
    loads the base sharded (TP / EP / FSDP), None for a whole replica per worker."""

    num_workers: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    context_parallel: int = 1
    distributed: dict[str, int] | None = None

    @property
    def replicas(self) -> int:
        """Distinct sequences per step: the rows are dealt over these (TP and CP ranks share)."""
        return self.data_parallel // self.context_parallel


@dataclass
class Layout:
    """This rank's coordinates and process groups (tp / cp group None: a group of one;
    grad group None: the default group, which is all of it when TP is 1)."""

    world: int = 1
    rank: int = 0
    tp: int = 1
    cp: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    cp_group: object = None
    grad_group: object = None

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp)

    @property
    def grad_size(self) -> int:
        """Ranks in the gradient group (DP x CP)."""
        return self.world // self.tp


def coords(rank: int, tp: int, cp: int, world: int) -> tuple[int, int, int]:
    """(tp index, cp index, dp replica index) of a global rank: the planner's rank order
    (moeflow.parallel.memory.Plan.coords), so a rank's groups and its planned bytes agree."""
    c = Plan(tp=tp, cp=cp, dp=world // tp).coords(rank)
    return c["tp"], c["cp"], c["replica"]


def make_layout(tp: int = 1, cp: int = 1) -> Layout:
    """Build the groups on the initialised default process group (every rank must call it:
    `new_group` is collective). Without a process group: the single-process layout."""
    if not dist.is_available() or not dist.is_initialized():
        if tp * cp != 1:
            raise RuntimeError(f"tensor_parallel={tp} x context_parallel={cp} needs a process group")
        return Layout()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp * cp):
        raise ValueError(f"world size {world} is not a multiple of TP {tp} x CP {cp}")
    out = Layout(world=world, rank=rank, tp=tp, cp=cp)
    out.tp_rank, out.cp_rank, out.dp_rank = coords(rank, tp, cp, world)
    by_tp: dict[tuple[int, int], list[int]] = {}
    by_cp: dict[tuple[int, int], list[int]] = {}
    by_grad: dict[int, list[int]] = {}
    for r in range(world):
        t, c, d = coords(r, tp, cp, world)
        by_tp.setdefault((c, d), []).append(r)
        by_cp.setdefault((t, d), []).append(r)
        by_grad.setdefault(t, []).append(r)
    # new_group is collective over the world: every rank creates every group, in one order
    for key in sorted(by_tp):
        g = dist.new_group(by_tp[key]) if tp > 1 else None
        if rank in by_tp[key]:
            out.tp_group = g
    for key in sorted(by_cp):
        g = dist.new_group(by_cp[key]) if cp > 1 else None
        if rank in by_cp[key]:
            out.cp_group = g
    for tp_index in sorted(by_grad):
        g = dist.new_group(by_grad[tp_index]) if world // tp > 1 and tp > 1 else None
        if rank in by_grad[tp_index]:
            out.grad_group = g  # None without TP: the default group, every rank
    return out
