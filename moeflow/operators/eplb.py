"""Expert-parallel load balancing: where each expert (and its replicas) lives.

Axis letters: L MoE layers, E logical experts, P physical expert slots
(E + redundant), R ranks (GPUs), N nodes, G expert groups.

`rebalance_experts(weight[L, E], P, G, N, R)` returns the same three maps as
DeepSeek's EPLB and vLLM's `--enable-eplb` use:

- phy2log [L, P]: the logical expert held by each physical slot; slot s lives
  on rank s // (P / R) (ranks hold consecutive slots, as engines shard them);
- log2phy [L, E, X]: the physical slots of each logical expert, -1 padded;
- logcnt [L, E]: how many replicas each logical expert has.

Two modes. Hierarchical (G % N == 0): whole expert groups are packed onto
nodes (so group-limited routing keeps its traffic inside few nodes), hot
experts are replicated inside their node, and each node's replicas are packed
onto its ranks. Global (otherwise): replicate over all slots, pack onto all
ranks. Packing is "longest processing time first" with a fixed number of
items per pack, then improved by exchanging items between the heaviest pack
and the others while that lowers the maximum. In hierarchical mode the group
to node assignment is then searched further on the quantity that matters —
the heaviest rank after replication — not only on node sums.

Balancedness = mean tokens per rank / max tokens per rank (vLLM's definition);
1.0 is perfect. A replica is assumed to take an equal share of its expert's
tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moeflow.core.errors import UserError

MAX_SWAPS = 64  # exchange rounds per packing; each strictly lowers the heaviest pack
SEARCH_ROUNDS = 16  # group-to-node swap rounds per layer (hierarchical mode)
SEARCH_WIDTH = 6  # swaps per round evaluated exactly (after replication and packing)


def check_shape(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> np.ndarray:
    """Validate a load matrix and the layout; UserError naming the value at fault.

    Returns:
        weight as float64 [L, E].
    """
    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise UserError(f"expert load: expected a layers x experts matrix, got shape {list(w.shape)}")
    if not np.isfinite(w).all():
        raise UserError("expert load: non-finite token count (NaN or Inf)")
    if (w < 0).any():
        layer, expert = np.argwhere(w < 0)[0]
        raise UserError(f"expert load: negative token count {w[layer, expert]:g} "
                        f"at layer {layer}, expert {expert}")
    experts = w.shape[1]
    for name, value in (("EP size", num_gpus), ("nodes", num_nodes), ("groups", num_groups)):
        if value < 1:
            raise UserError(f"{name} must be >= 1 (got {value})")
    if num_replicas < experts:
        raise UserError(f"physical experts {num_replicas} < logical experts {experts} "
                        "(redundant experts must be >= 0)")
    if num_replicas % num_gpus:
        raise UserError(f"EP size {num_gpus} does not divide experts + redundant = {num_replicas}")
    if num_gpus % num_nodes:
        raise UserError(f"nodes {num_nodes} do not divide EP size {num_gpus}")
    if experts % num_groups:
        raise UserError(f"groups {num_groups} do not divide the {experts} experts")
    return w


def balancedness(rank_load: np.ndarray) -> np.ndarray:
    """mean / max tokens per rank, per layer ([L, R] -> [L]); 1.0 for an idle layer."""
    peak = rank_load.max(axis=-1)
    return np.where(peak > 0, rank_load.mean(axis=-1) / np.where(peak > 0, peak, 1), 1.0)


def rank_load_contiguous(weight: np.ndarray, num_ranks: int) -> np.ndarray:
    """Tokens per rank when experts are sharded contiguously without replicas ([L, E] -> [L, R])."""
    layers, experts = weight.shape
    if experts % num_ranks:
        raise UserError(f"EP size {num_ranks} does not divide the {experts} experts")
    return weight.reshape(layers, num_ranks, experts // num_ranks).sum(-1)


def rank_load_placed(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray,
                     num_ranks: int) -> np.ndarray:
    """Tokens per rank for a placement ([L, E], [L, P], [L, E] -> [L, R])."""
    share = weight / np.maximum(logcnt, 1)  # [L, E] tokens per replica
    per_slot = np.take_along_axis(share, phy2log, axis=1)  # [L, P]
    return per_slot.reshape(weight.shape[0], num_ranks, -1).sum(-1)


# ---------------------------------------------------------------- building blocks


def replicate(weight: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica count per expert: each extra slot goes to the expert with the most
    tokens per replica (this minimises the heaviest replica).

    Args:
        weight: [L, n] tokens per expert.
        num_slots: slots to fill (>= n).

    Returns:
        counts [L, n] (int64, each >= 1, rows sum to num_slots).
    """
    counts = np.ones(weight.shape, dtype=np.int64)
    rows = np.arange(weight.shape[0])
    for _ in range(num_slots - weight.shape[1]):
        hot = np.argmax(weight / counts, axis=1)  # [L]
        counts[rows, hot] += 1
    return counts


def pack(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Split n weighted items into packs of exactly n / num_packs items, balanced.

    Longest-processing-time first (heaviest item to the lightest pack with room),
    then exchanges between the heaviest pack and any other while an exchange
    lowers the larger of the two.

    Args:
        weight: [n] item weights (one layer).
        num_packs: packs; must divide n.

    Returns:
        pack_of [n] (int64).
    """
    n = weight.shape[0]
    per = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_packs)
    room = np.full(num_packs, per)
    for item in np.argsort(-weight, kind="stable"):
        open_loads = np.where(room > 0, loads, np.inf)
        p = int(np.argmin(open_loads))
        pack_of[item] = p
        loads[p] += weight[item]
        room[p] -= 1
    if per > 1 and num_packs > 1:
        _exchange(weight, pack_of, loads)
    return pack_of


def _exchange(weight: np.ndarray, pack_of: np.ndarray, loads: np.ndarray) -> None:
    """Improve a packing in place: swap an item of the heaviest pack with a lighter
    item elsewhere when that lowers max(heaviest, other)."""
    for _ in range(MAX_SWAPS):
        top = int(np.argmax(loads))
        mine = np.flatnonzero(pack_of == top)  # [k]
        other = np.flatnonzero(pack_of != top)  # [m]
        if other.size == 0:
            return
        d = weight[mine][:, None] - weight[other][None, :]  # [k, m] load moved off `top`
        new_max = np.maximum(loads[top] - d, loads[pack_of[other]][None, :] + d)  # [k, m]
        new_max = np.where(d > 0, new_max, np.inf)
        i, j = np.unravel_index(np.argmin(new_max), new_max.shape)
        if not new_max[i, j] < loads[top] * (1 - 1e-12):
            return
        a, b = mine[i], other[j]
        pa, pb = top, pack_of[b]
        loads[pa] -= d[i, j]
        loads[pb] += d[i, j]
        pack_of[a], pack_of[b] = pb, pa


def _place(weight: np.ndarray, num_slots: int, num_ranks: int):
    """Replicate one layer's experts into num_slots slots and pack them onto num_ranks.

    Args:
        weight: [n] tokens per expert.

    Returns:
        (slot_expert [num_slots] local expert per slot, rank-major; counts [n];
         max rank load).
    """
    counts = replicate(weight[None], num_slots)[0]  # [n]
    experts = np.repeat(np.arange(weight.shape[0]), counts)  # [num_slots] expert of each replica
    share = (weight / counts)[experts]  # [num_slots]
    rank_of = pack(share, num_ranks)  # [num_slots]
    order = np.lexsort((np.arange(num_slots), rank_of))  # rank-major
    loads = np.bincount(rank_of, weights=share, minlength=num_ranks)
    return experts[order], counts, float(loads.max())


# ---------------------------------------------------------------- the two modes


def _layer_hierarchical(w: np.ndarray, num_slots: int, groups: int, nodes: int, ranks: int):
    """One layer, hierarchical: (phy2log [P], logcnt [E])."""
    experts = w.shape[0]
    size = experts // groups  # experts per group
    group_w = w.reshape(groups, size).sum(1)  # [G]
    node_of = pack(group_w, nodes)  # [G]
    slots, per_node = num_slots // nodes, ranks // nodes

    def node_result(members):
        ids = np.concatenate([np.arange(g * size, (g + 1) * size) for g in members])
        return (ids, *_place(w[ids], slots, per_node))

    members = [list(np.flatnonzero(node_of == n)) for n in range(nodes)]
    results = [node_result(m) for m in members]
    if nodes > 1 and len(members[0]) > 0:
        _search_groups(members, results, node_result, group_w)
    phy2log = np.empty(num_slots, dtype=np.int64)
    logcnt = np.zeros(experts, dtype=np.int64)
    for n, (ids, slot_expert, counts, _) in enumerate(results):
        phy2log[n * slots:(n + 1) * slots] = ids[slot_expert]
        logcnt[ids] = counts
    return phy2log, logcnt


def _search_groups(members: list, results: list, node_result, group_w: np.ndarray) -> None:
    """Swap groups between the node holding the heaviest rank and another node while
    that lowers the heavier of the two (after replication and packing).

    Each round ranks every swap by the node sums it leaves and evaluates only the
    SEARCH_WIDTH best exactly, so the search stays cheap for many groups.
    """
    for _ in range(SEARCH_ROUNDS):
        peaks = [r[3] for r in results]
        top = int(np.argmax(peaks))
        sums = [group_w[m].sum() for m in members]
        cands = []
        for other in range(len(members)):
            if other == top:
                continue
            for i, gi in enumerate(members[top]):
                for j, gj in enumerate(members[other]):
                    d = group_w[gi] - group_w[gj]
                    if d > 0:
                        cands.append((max(sums[top] - d, sums[other] + d), other, i, j))
        best: tuple[float, Any] = (peaks[top] * (1 - 1e-9), None)  # (peak, swap or None)
        for _, other, i, j in sorted(cands)[:SEARCH_WIDTH]:
            a = members[top][:i] + [members[other][j]] + members[top][i + 1:]
            b = members[other][:j] + [members[top][i]] + members[other][j + 1:]
            ra, rb = node_result(a), node_result(b)
            if max(ra[3], rb[3]) < best[0]:
                best = (max(ra[3], rb[3]), (other, a, b, ra, rb))
        if best[1] is None:
            return
        other, a, b, ra, rb = best[1]
        members[top], members[other] = a, b
        results[top], results[other] = ra, rb


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """Placement of experts and their replicas onto EP ranks.

    Args:
        weight: [L, E] tokens routed to each expert (any non-negative load).
        num_replicas: physical expert slots P = E + redundant; num_gpus divides it.
        num_groups: expert groups G (contiguous id ranges, as group-limited routing uses).
        num_nodes: nodes N; hierarchical placement when G % N == 0, else global.
        num_gpus: EP ranks R; N divides it.

    Returns:
        (phy2log [L, P], log2phy [L, E, X], logcnt [L, E]), int64 numpy arrays.
    """
    w = check_shape(weight, num_replicas, num_groups, num_nodes, num_gpus)
    layers, experts = w.shape
    hierarchical = num_groups % num_nodes == 0
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    phy2log = np.empty((layers, num_replicas), dtype=np.int64)
    logcnt = np.empty((layers, experts), dtype=np.int64)
    for layer in range(layers):
        phy2log[layer], logcnt[layer] = _layer_hierarchical(w[layer], num_replicas, num_groups,
                                                            num_nodes, num_gpus)
    return phy2log, inverse(phy2log, logcnt), logcnt


def inverse(phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """log2phy [L, E, max replicas] from phy2log [L, P] (-1 where an expert has fewer)."""
    layers, experts = logcnt.shape
    out = np.full((layers, experts, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(layers):
        seen = np.zeros(experts, dtype=np.int64)
        for slot, e in enumerate(phy2log[layer]):
            out[layer, e, seen[e]] = slot
            seen[e] += 1
    return out


def summary(weight, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int) -> dict:
    """Per-layer balancedness before (contiguous, no replicas) and after the placement.

    Returns:
        {"balancedness_before", "balancedness_after", "layers": [{"layer", "before", "after"}],
         "physical_to_logical"} — whole-model figures are the mean over layers.
    """
    w = np.asarray(weight, dtype=np.float64)
    layers, experts = w.shape
    before = balancedness(rank_load_contiguous(w, num_gpus)) if experts % num_gpus == 0 \
        else np.full(layers, np.nan)
    after = balancedness(rank_load_placed(w, phy2log, logcnt, num_gpus))
    return {"balancedness_before": _num(before.mean()), "balancedness_after": _num(after.mean()),
            "layers": [{"layer": i, "before": _num(b), "after": _num(a)}
                       for i, (b, a) in enumerate(zip(before, after))],
            "physical_to_logical": phy2log.tolist()}


def _num(x) -> float | None:
    return None if np.isnan(x) else round(float(x), 6)
