"""Layer-by-layer comparison of two checkpoints of one architecture on a golden set.

    result = compare_checkpoints("base", "candidate", samples)

Both models are run one decoder layer at a time (moeflow.quant.source builds
a layer from its tensors): the baseline's layer i, then the candidate's, on the
golden set's hidden states, which are kept between layers. Memory: the
embedding/vision front, one layer and the hidden states, never a whole model,
never both sides at once. Two modes in one pass:

- isolated: each candidate layer is fed the baseline's input (locates: the
  first red row is where precision breaks);
- propagated: the candidate runs on its own outputs (judges: error accumulates).

Hooks record, per decoder layer, the attention output, the MoE/MLP block
output (after the experts are combined; per-expert tensors stop being
comparable once routing flips) and the router's top-k choices (overlap per
layer); per vision block the block output (the vision tower runs whole, in
the front, so its rows are propagated); then the final norm and the logits.
Rows are in forward order. Metrics: moeflow.quant.metrics (msprobe's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.core.devices import gpus_per_worker, local_device
from moeflow.core.errors import UserError
from moeflow.core.memmeter import PeakMemory
from moeflow.evaluation.ties import TIE_MARGIN, top1_tie_aware
from moeflow.model.anatomy import router_names
from moeflow.quant import metrics as M
from moeflow.quant.groups import PartBuilder, release_freed_tensors
from moeflow.quant.source import ModelSource, architecture
from moeflow.quant.streamed import Front, first_tensor, keep_output, layer_ranges

# Legend: T tokens of one sample, H hidden, V vocab, K router top-k.


def _parts(layer: torch.nn.Module) -> tuple[str | None, str | None, list]:
    """(attention child, MoE/MLP child, routers) of a decoder layer, by structure:
    the child whose name holds `attn`, the child holding experts (else the one named
    like an MLP), and the routers that choose top-k experts (moeflow.model.anatomy.router_names:
    works on one layer, which has no config of its own)."""

    names = [n for n, _ in layer.named_children()]
    attn = next((n for n in names if "attn" in n), None)
    mlp = next((n for n, m in layer.named_children()
                if any("experts" in sub for sub, _ in m.named_modules())), None)
    mlp = mlp or next((n for n in names if n in ("mlp", "feed_forward", "block_sparse_moe")), None)
    return attn, mlp, [name for name in router_names(layer) if hasattr(layer.get_submodule(name), "top_k")]


def _topk(output, module) -> torch.Tensor | None:
    """Chosen experts [T, K] from a router's output (indices last, or logits + top_k)."""
    t = output[-1] if isinstance(output, (tuple, list)) else output
    if not isinstance(t, torch.Tensor):
        return None
    if t.is_floating_point():
        return t.reshape(-1, t.shape[-1]).topk(int(module.top_k), dim=-1).indices
    return t.reshape(-1, t.shape[-1])


def _run_layer(layer, parts, hidden, call, mlp_input=None) -> tuple[torch.Tensor, dict]:
    """One layer on one sample with hooks; returns (output [1, T, H], {part: tensor}).

    `mlp_input` (isolated mode): the baseline's input of the MoE/MLP block, fed to this
    layer's block instead of its own, so a damaged attention does not mask the block.
    """
    attn, mlp, routers = parts
    seen: dict = {}
    hooks = []
    if attn:
        hooks.append(layer.get_submodule(attn).register_forward_hook(keep_output(seen, "attention")))
    if mlp:
        block = layer.get_submodule(mlp)

        def feed(_m, inputs):
            seen["mlp_in"] = inputs[0]
            return None if mlp_input is None else (mlp_input, *inputs[1:])
        hooks.append(block.register_forward_pre_hook(feed))
        hooks.append(block.register_forward_hook(keep_output(seen, "mlp")))
    for name in routers:
        module = layer.get_submodule(name)

        def route(_m, _i, out, name=name, module=module):
            seen.setdefault("router", {})[name] = _topk(out, module)
        hooks.append(module.register_forward_hook(route))
    args, kwargs = call
    try:
        with torch.no_grad():
            out = layer(hidden, *args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return first_tensor(out), seen


def _overlap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(sum over tokens of |top-k(a) ∩ top-k(b)| / K, tokens)."""
    hit = (a[:, :, None] == b[:, None, :]).any(-1).float().mean(-1)  # [T]
    return float(hit.sum()), a.shape[0]


class _Row:
    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.iso, self.prop = M.empty(), M.empty()
        self.route = {"iso": [0.0, 0], "prop": [0.0, 0]}

    def add(self, mode: str, bench, cand) -> None:
        M.accumulate(self.iso if mode == "iso" else self.prop, bench, cand)

    def add_route(self, mode: str, bench: dict, cand: dict) -> None:
        for name, a in (bench or {}).items():
            b = (cand or {}).get(name)
            if a is not None and b is not None:
                s, n = _overlap(a, b)
                self.route[mode][0] += s
                self.route[mode][1] += n

    def stats(self) -> dict:
        return {"name": self.name, "kind": self.kind, "iso": self.iso, "prop": self.prop,
                "route": self.route}


def check_same_architecture(a: str | Path, b: str | Path) -> None:
    """Two checkpoints of one architecture and shape, else UserError naming the difference."""
    arch_a, shape_a = architecture(a)
    arch_b, shape_b = architecture(b)
    if arch_a != arch_b:
        raise UserError(f"compare: {a} is {arch_a}, {b} is {arch_b}: not the same architecture")
    for key in sorted(set(shape_a) | set(shape_b)):
        if shape_a.get(key) != shape_b.get(key):
            raise UserError(f"compare: {key} is {shape_a.get(key)} in {a} but {shape_b.get(key)} "
                            f"in {b}: not the same architecture")


def compare_stats(base_dir: str | Path, cand_dir: str | Path, samples: list[dict],
                  progress=None, device=None, layer_workers: int = 1, tie_margin: float = TIE_MARGIN,
                  expert_groups: int = 1) -> dict:
    """Sufficient statistics of every row for `samples` (mergeable across shards).

    Args:
        device: where the layers run (float32 either way); None: the GPU Ray granted this
            task, else CPU (moeflow.core.devices.local_device). One decoder layer at a time is there.
        layer_workers: > 1: the decoder layers are split into this many contiguous ranges,
            each compared by a Ray task that reads only its layers and gets the recorded
            inputs of its first one (`compare_range`); the rows are the same as in one process.
        tie_margin: a top-1 flip whose log-odds swing is at most this (nats) still agrees.
        expert_groups: > 1: each layer's routed experts split into that many groups, the
            first run where the layer runs (with the rest of the layer), the others on Ray
            actors (moeflow.quant.groups); the rows are the one-process ones within float
            rounding (the groups' outputs are summed, not accumulated expert by expert).

    Returns:
        {"rows": [row stats in forward order], "top1": [agree, total, excused near ties],
         "memory": {"front": this process's peak, "layers": [each layer range's]}}
    """

    if not samples:
        raise UserError("compare: the golden set is empty")
    device = torch.device(device) if device is not None else local_device()
    base, cand = ModelSource(base_dir), ModelSource(cand_dir)
    meter = PeakMemory(device.type).start()  # before the first tensor is read
    fronts = {}
    runs = {}
    for side, src in (("base", base), ("cand", cand)):  # one front alive at a time
        front = Front(src, device=device)
        runs[side] = [front.run(s) for s in samples]
        fronts[side] = (front.norm, front.head)
        del front
    rows: list[dict] = []
    names = dict.fromkeys(n for r in runs["base"] for n in r["vision"])  # image samples only
    for name in names:
        row = _Row(name, "vision")
        for rb, rc in zip(runs["base"], runs["cand"]):
            if name in rb["vision"] and name in rc["vision"]:
                row.add("iso", rb["vision"][name], rc["vision"][name])  # the tower runs whole:
                row.add("prop", rb["vision"][name], rc["vision"][name])  # rows are propagated
        rows.append(row.stats())
        for r in runs["base"] + runs["cand"]:
            r["vision"].pop(name, None)
    h_base = [r["hidden"] for r in runs["base"]]
    h_prop = [r["hidden"] for r in runs["cand"]]
    spans = layer_ranges(base.num_layers, layer_workers)
    ranges = []
    if len(spans) == 1:
        layer_rows, h_base, h_prop, mem = compare_range(base, cand, 0, base.num_layers, runs, h_base, h_prop,
                                                        device, progress, expert_groups)
        rows += layer_rows
        ranges.append(mem)
    else:
        # lazy: ray: heavy, loaded only when this runs
        import ray

        task = ray.remote(num_cpus=1, num_gpus=gpus_per_worker())(compare_range)  # a GPU each where there are
        for start, stop in spans:  # in order: a range starts from the previous one's outputs
            part = {side: [{k: r[k][start:stop] for k in ("calls", "deltas")} for r in rs]
                    for side, rs in runs.items()}
            layer_rows, h_base, h_prop, mem = ray.get(task.remote(str(base_dir), str(cand_dir), start, stop,
                                                                  part, h_base, h_prop,
                                                                  expert_groups=expert_groups))
            h_base, h_prop = [h.to(device) for h in h_base], [h.to(device) for h in h_prop]
            rows += layer_rows
            ranges.append(mem)
            if progress:
                progress(stop, base.num_layers)
    rows += _final_rows(fronts, h_base, h_prop, base)
    return {"rows": rows, "top1": _top1(fronts, h_base, h_prop, tie_margin),
            "memory": {"front": meter.record(), "layers": ranges}}


def compare_range(base: ModelSource | str, cand: ModelSource | str, start: int, stop: int, runs: dict,
                  h_base: list, h_prop: list, device=None, progress=None,
                  expert_groups: int = 1) -> tuple[list[dict], list, list, dict]:
    """Decoder layers [start, stop) of both checkpoints, one layer resident at a time.

    Args:
        runs: {"base"|"cand": per sample {"calls", "deltas"}}, indexed from layer `start`
            (a Ray task gets only its range's) or from 0 when `start` is 0.
        h_base, h_prop: per sample, the baseline's and the candidate's input of layer `start`.
        expert_groups: > 1: expert groups 2.. of each layer on that many - 1 Ray actors.

    Returns:
        (row stats in forward order, baseline outputs of layer stop - 1, candidate's,
         {"layers": [start, stop], "peak_bytes", "measure"[, "groups": each actor's]}: this
         process's peak above its level before the range's first tensor was read).
    """
    base = base if isinstance(base, ModelSource) else ModelSource(base)
    cand = cand if isinstance(cand, ModelSource) else ModelSource(cand)
    device = torch.device(device) if device is not None else local_device()
    release_freed_tensors()  # a layer's tensors as read, freed, leave no resident holes
    meter = PeakMemory(device.type).start()
    h_base, h_prop = [h.to(device) for h in h_base], [h.to(device) for h in h_prop]
    rows: list[dict] = []
    build = PartBuilder(expert_groups, device)
    try:
        for i in range(start, stop):
            layer_rows, h_base, h_prop = _compare_layer(i, i - start, base, cand, runs, h_base, h_prop, device,
                                                        build)
            rows += [r.stats() for r in layer_rows]
            if progress:
                progress(i + 1, base.num_layers)
        groups = build.memory()
    finally:
        build.close()
    return rows, h_base, h_prop, {"layers": [start, stop], **meter.record(), **groups}


def _compare_layer(i, k, base, cand, runs, h_base, h_prop, device, build):
    """Layer i (entry k of `runs`' calls and deltas): baseline on its inputs, candidate on the
    baseline's (isolated) and on its own (propagated). Returns (rows, next baseline hidden,
    next propagated hidden)."""
    layer = build(base, i)
    parts = _parts(layer)
    prefix = base.layer_prefix(i)
    out_b, seen_b = zip(*[_run_layer(layer, parts, h, r["calls"][k]) for h, r in zip(h_base, runs["base"])])
    del layer
    layer = build(cand, i)
    out_i, seen_i = zip(*[_run_layer(layer, parts, h, r["calls"][k], sb.get("mlp_in"))
                          for h, r, sb in zip(h_base, runs["base"], seen_b)])
    out_p, seen_p = zip(*[_run_layer(layer, parts, h, r["calls"][k]) for h, r in zip(h_prop, runs["cand"])])
    del layer
    attn, mlp, routers = parts
    rows = []
    for part, kind in ((attn, "attention"), (mlp, "moe" if routers else "mlp")):
        if part is None:
            continue
        key = "attention" if kind == "attention" else "mlp"
        row = _Row(prefix + part, kind)
        for sb, si, sp in zip(seen_b, seen_i, seen_p):
            row.add("iso", sb[key], si[key])
            row.add("prop", sb[key], sp[key])
            if kind == "moe":
                row.add_route("iso", sb.get("router"), si.get("router"))
                row.add_route("prop", sb.get("router"), sp.get("router"))
        rows.append(row)
    nxt_b = [o + (r["deltas"][k] if r["deltas"][k] is not None else 0) for o, r in zip(out_b, runs["base"])]
    nxt_p = [o + (r["deltas"][k] if r["deltas"][k] is not None else 0) for o, r in zip(out_p, runs["cand"])]
    return rows, nxt_b, nxt_p


def _final_rows(fronts, h_base, h_prop, base) -> list[dict]:
    norm_b, head_b = fronts["base"]
    norm_c, head_c = fronts["cand"]
    norm_row, logit_row = _Row(_module_name(base, norm_b), "norm"), _Row("logits", "logits")
    with torch.no_grad():
        for hb, hp in zip(h_base, h_prop):
            nb, lb = norm_b(hb), head_b(norm_b(hb))
            ni, li = norm_c(hb), head_c(norm_c(hb))
            np_, lp = norm_c(hp), head_c(norm_c(hp))
            norm_row.add("iso", nb, ni)
            norm_row.add("prop", nb, np_)
            logit_row.add("iso", lb, li)
            logit_row.add("prop", lb, lp)
    return [norm_row.stats(), logit_row.stats()]


def _top1(fronts, h_base, h_prop, tie_margin: float) -> list[int]:
    """[positions where the greedy next token agrees (propagated; a near-tie flip agrees,
    moeflow.evaluation.ties), positions, near-tie flips among the agreeing]."""
    norm_b, head_b = fronts["base"]
    norm_c, head_c = fronts["cand"]
    agree = total = excused = 0
    with torch.no_grad():
        for hb, hp in zip(h_base, h_prop):
            n_agree, n_tie, n = top1_tie_aware(head_b(norm_b(hb)), head_c(norm_c(hp)),  # [1, T, V]
                                               tie_margin)
            agree, excused, total = agree + n_agree, excused + n_tie, total + n
    return [agree, total, excused]


def _module_name(source: ModelSource, module) -> str:
    parent = source.layers_prefix.rpartition(".")[0]
    return f"{parent}.norm" if parent else "norm"


def merge_stats(parts: list[dict]) -> dict:
    """Merge shard statistics (same rows, same order)."""
    first = parts[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        merged = dict(row)
        for other in parts[1:]:
            o = other["rows"][i]
            merged = {**merged, "iso": M.merge(merged["iso"], o["iso"]),
                      "prop": M.merge(merged["prop"], o["prop"]),
                      "route": {m: [merged["route"][m][0] + o["route"][m][0],
                                    merged["route"][m][1] + o["route"][m][1]] for m in ("iso", "prop")}}
        rows.append(merged)
    top1 = [sum(p["top1"][k] for p in parts) for k in range(3)]
    return {"rows": rows, "top1": top1, "memory": [p["memory"] for p in parts]}


def finish(stats: dict) -> dict:
    """Report fields: {"layers": [...], "first_divergent", "final": {...}}."""
    layers = []
    for row in stats["rows"]:
        iso, prop = M.finish(row["iso"]), M.finish(row["prop"])
        overlap = {m: (s / n if n else None) for m, (s, n) in row["route"].items()}
        layers.append({"name": row["name"], "kind": row["kind"], **iso,
                       "router_topk_overlap": overlap["iso"],
                       "propagated": {**prop, "router_topk_overlap": overlap["prop"]}})
    first = next((r["name"] for r in layers if r["status"] == "error"), None)
    logits = next(r for r in layers if r["kind"] == "logits")
    agree, total, excused = stats["top1"]
    memory = stats["memory"]
    return {"first_divergent": first, "layers": layers,
            "final": {"logits_cosine": logits["propagated"]["cosine"],
                      "top1_agreement": agree / total if total else 1.0,
                      "top1_near_ties": excused},
            "memory": memory if isinstance(memory, list) else [memory]}


def compare_checkpoints(base_dir: str | Path, cand_dir: str | Path, samples: list[dict],
                        shards: int = 1, progress=None, layer_workers: int = 1,
                        tie_margin: float = TIE_MARGIN, expert_groups: int = 1) -> dict:
    """Compare two checkpoints on `samples`; shards > 1 splits the samples over Ray tasks,
    layer_workers > 1 the decoder layers, expert_groups > 1 each layer's routed experts (`compare_stats`).

    Returns:
        {"first_divergent": module name | None, "layers": [rows], "final": {...}}
    """
    check_same_architecture(base_dir, cand_dir)
    if not samples:
        raise UserError("compare: the golden set is empty")
    shards = max(1, min(shards, len(samples)))
    if shards == 1:
        return finish(compare_stats(base_dir, cand_dir, samples, progress, layer_workers=layer_workers,
                                    tie_margin=tie_margin, expert_groups=expert_groups))
    # lazy: ray: heavy, loaded only when this runs
    import ray


    task = ray.remote(num_cpus=1, num_gpus=gpus_per_worker())(compare_stats)  # a GPU each where there are
    chunks = [samples[k::shards] for k in range(shards)]
    parts = ray.get([task.remote(str(base_dir), str(cand_dir), c, layer_workers=layer_workers,
                                 tie_margin=tie_margin, expert_groups=expert_groups) for c in chunks])
    return finish(merge_stats(parts))
