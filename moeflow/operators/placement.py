"""Apply an expert placement where moeflow runs, and render it for engines that replicate.

transformers shards experts contiguously under expert parallelism (rank r
holds experts [r*E/EP, (r+1)*E/EP)) and has no replicas, so a placement
without redundancy is applied by *permuting* the experts in a copy of the
converted checkpoint: the fused expert tensors, the router's rows and its
per-expert biases (`e_score_correction_bias`, GPT-OSS's router bias), and any
other per-expert tensor of the block (scales, expert biases) move together, so
the model computes the same function while the hot experts land on different
ranks. Group-limited routing (DeepSeek's `n_group` / `topk_group`) picks
contiguous groups of experts, so there only whole groups move between ranks
(when a rank holds whole groups) or experts move inside their group (when a
group spans ranks) — the routing decision stays the same.

Engines that replicate experts get the placement as data: SGLang's
`--init-expert-location` file (physical_to_logical_map for every decoder
layer) and vLLM's `--enable-eplb --eplb-config` (vLLM computes its own
placement online from the same window of loads).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np

from moeflow.checkpoint import digest
from moeflow.checkpoint.manifest import MANIFEST, read_manifest
from moeflow.core.errors import UserError
from moeflow.core.fsutil import staged_dir
from moeflow.operators import eplb


def text_config(config: dict) -> dict:
    """The language model's config (image-text models nest it under text_config)."""
    return config.get("text_config") or config


def routing_groups(config: dict) -> int:
    """Expert groups that group-limited routing chooses among (1: routing is not group-limited)."""
    tc = text_config(config)
    groups, topk = int(tc.get("n_group") or 1), tc.get("topk_group")
    return groups if groups > 1 and topk is not None and int(topk) < groups else 1


def layer_permutation(weight: np.ndarray, ep: int, groups: int = 1) -> np.ndarray:
    """New expert order for one layer: new index j holds old expert perm[j].

    Args:
        weight: [E] tokens per expert.
        ep: expert-parallel ranks (divides E).
        groups: routing groups that must stay whole (1: none).

    Returns:
        perm [E] (int64); the identity when no group-preserving move exists.
    """
    experts = weight.shape[0]
    size = experts // groups
    if groups == 1:
        rank_of = eplb.pack(weight, ep)  # [E]
        return np.lexsort((np.arange(experts), rank_of))
    if groups % ep == 0:  # a rank holds whole groups: move groups between ranks
        rank_of = eplb.pack(weight.reshape(groups, size).sum(1), ep)  # [G]
        order = np.lexsort((np.arange(groups), rank_of))
        return np.concatenate([np.arange(g * size, (g + 1) * size) for g in order])
    if ep % groups == 0:  # a group spans ranks: move experts inside their group
        per = ep // groups
        parts = []
        for g in range(groups):
            ids = np.arange(g * size, (g + 1) * size)
            rank_of = eplb.pack(weight[ids], per)
            parts.append(ids[np.lexsort((np.arange(size), rank_of))])
        return np.concatenate(parts)
    return np.arange(experts)


def plan_permutation(counts: np.ndarray, ep: int, groups: int = 1) -> dict:
    """Permutation per MoE layer and the per-rank balancedness it gives at EP `ep`.

    A layer keeps its order when the permutation would not lower its heaviest rank.

    Returns:
        {"perms": [L][E], "before": [L], "after": [L], "changed": bool}.
    """
    counts = np.asarray(counts, dtype=np.float64)
    layers, experts = counts.shape
    if ep < 1 or experts % ep:
        raise UserError(f"EP size {ep} does not divide the {experts} experts")
    perms = np.tile(np.arange(experts), (layers, 1))
    for layer in range(layers):
        perm = layer_permutation(counts[layer], ep, groups)
        old = eplb.rank_load_contiguous(counts[layer:layer + 1], ep).max()
        new = eplb.rank_load_contiguous(counts[layer:layer + 1, perm], ep).max()
        if new < old:
            perms[layer] = perm
    before = eplb.balancedness(eplb.rank_load_contiguous(counts, ep))
    after = eplb.balancedness(eplb.rank_load_contiguous(np.take_along_axis(counts, perms, 1), ep))
    changed = bool((perms != np.arange(experts)).any())
    return {"perms": perms.tolist(), "before": before.tolist(), "after": after.tolist(), "changed": changed}


def per_expert_tensors(weight_map: dict, shapes: dict, router: str, experts: int) -> list[str]:
    """Checkpoint tensors of one MoE block indexed by expert along dim 0: the fused
    experts and their per-expert scales/biases (`<block>.experts.*`) and the router's
    rows and per-expert biases (`<router>.*`)."""
    block = router.rsplit(".", 1)[0]
    names = [n for n in weight_map if n.startswith(f"{block}.experts.") or n.startswith(f"{router}.")]
    return [n for n in names if shapes[n] and shapes[n][0] == experts]


def apply_permutation(src: str | Path, out: str | Path, routers: list[str], perms: list[list[int]],
                      meta: dict) -> dict:
    """Write a copy of converted checkpoint `src` with each router's experts permuted.

    Files without a permuted tensor are hard-linked (copied where links fail); the
    manifest gets the new digests and a `placement` entry. Written to a temp dir,
    then renamed.

    Args:
        routers: router module names, one per MoE layer (find_routers order).
        perms: [L][E] new index -> old expert, per router.
        meta: recorded in the manifest's `placement` (EP size, load source, ...).

    Returns:
        {"model_path", "tensors_permuted", "files_rewritten"}.
    """
    # lazy: loads torch, which importing this module does not
    from moeflow.checkpoint.digest import file_digests

    src, out = Path(src), Path(out)
    manifest = read_manifest(src)
    tensors = manifest["tensors"]
    weight_map = {n: e["file"] for n, e in tensors.items()}
    shapes = {n: e["shape"] for n, e in tensors.items()}
    moves: dict[str, np.ndarray] = {}  # tensor -> perm
    for router, given in zip(routers, perms):
        perm = np.asarray(given, dtype=np.int64)
        if (perm == np.arange(perm.size)).all():
            continue
        names = per_expert_tensors(weight_map, shapes, router, perm.size)
        if not any(n.startswith(f"{router}.") for n in names) or len(names) < 2:
            raise UserError(f"{src}: cannot find the per-expert tensors of router {router} "
                            f"(found {names}); its experts cannot be permuted")
        moves.update({n: perm for n in names})
    with staged_dir(out) as tmp:
        rewrite = sorted({weight_map[n] for n in moves})
        _link_tree(src, tmp, skip=set(rewrite) | {MANIFEST})
        algorithm = digest.manifest_algorithm(manifest)
        for name in rewrite:
            _permute_file(src / name, tmp / name, moves)
            for tensor, hexdigest in file_digests(tmp / name, algorithm).items():
                tensors[tensor][algorithm] = hexdigest
        manifest["placement"] = dict(meta, kind="permutation", source_dir=str(src),
                                     layers={r: [int(i) for i in p] for r, p in zip(routers, perms)})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return {"model_path": str(out), "tensors_permuted": len(moves), "files_rewritten": len(rewrite)}


def _link_tree(src: Path, dst: Path, skip: set[str]) -> None:
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if str(rel) in skip or path.is_dir():
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dst / rel)
        except OSError:
            shutil.copy2(path, dst / rel)


def _permute_file(src: Path, dst: Path, moves: dict[str, np.ndarray]) -> None:
    """Rewrite one safetensors file (one decoder layer) with dim 0 of `moves` permuted.
    Streamed: one expert's slice (or one unmoved tensor) in memory at a time, since one
    layer of a large model is most of a device (moeflow.checkpoint.st_io.StreamWriter)."""
    # lazy: safetensors, torch: heavy, loaded only when this runs
    from safetensors import safe_open

    from moeflow.checkpoint.st_io import DTYPES, StreamWriter

    with safe_open(str(src), framework="pt") as fh:
        names = list(fh.keys())
        layout = [(n, DTYPES[fh.get_slice(n).get_dtype()], tuple(fh.get_slice(n).get_shape())) for n in names]
        writer = StreamWriter(dst, layout, metadata=fh.metadata())
        try:
            for name, dtype, shape in layout:
                if name not in moves:
                    writer.write(name, 0, fh.get_tensor(name))
                    continue
                piece = fh.get_slice(name)
                row = math.prod(shape[1:]) * torch_itemsize(dtype)  # bytes of one expert
                for new, old in enumerate(moves[name]):
                    writer.write(name, new * row, piece[int(old)].contiguous())
        except BaseException:
            os.close(writer.fd)
            writer.tmp.unlink(missing_ok=True)
            raise
    writer.close()


def torch_itemsize(dtype) -> int:
    # lazy: torch: heavy, loaded only when this runs
    import torch

    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------- engine renders


def sglang_expert_location(phy2log: np.ndarray, layer_ids: list[int], num_hidden_layers: int) -> dict:
    """SGLang `--init-expert-location` JSON: physical_to_logical_map for every decoder
    layer (layers without experts keep the trivial map)."""
    slots = phy2log.shape[1]
    experts = int(phy2log.max()) + 1
    full = np.tile(np.arange(slots) % experts, (num_hidden_layers, 1))  # [layers, P]
    for row, layer in zip(phy2log, layer_ids):
        full[layer] = row
    return {"physical_to_logical_map": full.tolist()}


def vllm_eplb_args(num_redundant: int, window_size: int = 1000, step_interval: int = 3000) -> dict:
    """vLLM `--enable-eplb --eplb-config '<json>'` (vLLM rebalances online from its own window)."""
    conf = {"window_size": window_size, "step_interval": step_interval,
            "num_redundant_experts": num_redundant, "log_balancedness": True}
    return {"args": ["--enable-eplb", "--eplb-config", json.dumps(conf, separators=(",", ":"))],
            "eplb_config": conf}
