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

import copy
from pathlib import Path

import torch

from moeflow.anatomy import router_names, vision_parts
from moeflow.devices import gpus_per_worker, local_device, to_device
from moeflow.errors import UserError
from moeflow.evaluation.ties import TIE_MARGIN, top1_tie_aware
from moeflow.quant import metrics as M
from moeflow.quant.source import ModelSource, architecture

# Legend: T tokens of one sample, H hidden, V vocab, K router top-k.


class _Capture(torch.nn.Module):
    """Stands in for a decoder layer in the front model: records what the model feeds
    layer i (hidden states and kwargs: masks, position embeddings) and passes it on."""

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((hidden_states, args, kwargs))
        return hidden_states


class Front:
    """Everything outside the decoder layers of one checkpoint (embeddings, vision tower,
    rotary/mask preparation, final norm, head), with the layers replaced by captures."""

    def __init__(self, source: ModelSource, dtype=torch.float32, device="cpu"):
        self.sink: list = []
        self.device = torch.device(device)
        model = copy.deepcopy(source.fam.meta)
        parent_name, _, attr = source.layers_prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, torch.nn.ModuleList(_Capture(self.sink) for _ in range(source.num_layers)))
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():  # non-persistent buffers (rotary inv_freq) by the
                model._init_weights(module)  # family's own init; parameters are loaded next
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in source.outer_state().items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if k not in source.fam.optional_keys()]  # tied head
        if unexpected or missing:
            raise UserError(f"{source.path}: tensors outside the decoder layers do not match "
                            f"the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if getattr(source.fam.config.get_text_config(), "tie_word_embeddings", False) or \
                getattr(source.fam.config, "tie_word_embeddings", False):
            model.tie_weights()
        self.model = model.to(dtype).eval().to(self.device)
        self.norm = parent.norm
        self.head = model.get_output_embeddings()
        self.vision = _vision_blocks(model)

    def run(self, inputs: dict) -> dict:
        """Front pass of one sample: layer inputs, between-layer additions, vision outputs.

        Returns:
            {"hidden": [1, T, H] input of layer 0, "calls": [(args, kwargs)] per layer,
             "deltas": [None | [1, T, H]] what the model adds between layer i and i+1
             (Qwen3-VL's deepstack visual features), "vision": {name: tensor}}
        """

        self.sink.clear()
        inputs = to_device(inputs, self.device)
        seen: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_hook(_keep(seen, name)) for name, m in self.vision]
        try:
            base = getattr(self.model, self.model.base_model_prefix)
            with torch.no_grad():
                base(**inputs, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        hidden = [h for h, _, _ in self.sink]
        deltas = []
        for i in range(len(hidden)):
            nxt = hidden[i + 1] if i + 1 < len(hidden) else None
            d = None if nxt is None or nxt is hidden[i] else nxt - hidden[i]
            deltas.append(d if d is not None and bool(d.abs().max() > 0) else None)
        return {"hidden": hidden[0], "calls": [(a, k) for _, a, k in self.sink],
                "deltas": deltas, "vision": seen}

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm output [1, T, H], logits [1, T, V])."""
        with torch.no_grad():
            normed = self.norm(hidden)  # type: ignore[operator]  # torch types a submodule attribute as Tensor | Module
            return normed, self.head(normed)


def _vision_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """Every block of the vision parts (members of their ModuleLists), in forward order."""

    out = []
    for part in vision_parts(model):
        for name, module in model.get_submodule(part).named_modules():
            if isinstance(module, torch.nn.ModuleList):
                out += [(f"{part}.{name}.{i}", m) for i, m in enumerate(module)]
    return out


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


def _keep(store: dict, name: str):
    def hook(_module, _inputs, output):
        t = _first_tensor(output)
        if t is not None:
            store[name] = t.detach()
    return hook


def _parts(layer: torch.nn.Module) -> tuple[str | None, str | None, list]:
    """(attention child, MoE/MLP child, routers) of a decoder layer, by structure:
    the child whose name holds `attn`, the child holding experts (else the one named
    like an MLP), and the routers that choose top-k experts (moeflow.anatomy.router_names:
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
        hooks.append(layer.get_submodule(attn).register_forward_hook(_keep(seen, "attention")))
    if mlp:
        block = layer.get_submodule(mlp)

        def feed(_m, inputs):
            seen["mlp_in"] = inputs[0]
            return None if mlp_input is None else (mlp_input, *inputs[1:])
        hooks.append(block.register_forward_pre_hook(feed))
        hooks.append(block.register_forward_hook(_keep(seen, "mlp")))
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
    return _first_tensor(out), seen


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
                  progress=None, device=None, tie_margin: float = TIE_MARGIN) -> dict:
    """Sufficient statistics of every row for `samples` (mergeable across shards).

    Args:
        device: where the layers run (float32 either way); None: the GPU Ray granted this
            task, else CPU (moeflow.devices.local_device). One decoder layer at a time is there.
        tie_margin: a top-1 flip whose log-odds swing is at most this (nats) still agrees.

    Returns:
        {"rows": [row stats in forward order], "top1": [agree, total, excused near ties]}
    """

    if not samples:
        raise UserError("compare: the golden set is empty")
    device = torch.device(device) if device is not None else local_device()
    base, cand = ModelSource(base_dir), ModelSource(cand_dir)
    fronts = {}
    runs = {}
    for side, src in (("base", base), ("cand", cand)):  # one front alive at a time
        front = Front(src, device=device)
        runs[side] = [front.run(s) for s in samples]
        fronts[side] = (front.norm, front.head)
        del front
    rows: list[_Row] = []
    names = dict.fromkeys(n for r in runs["base"] for n in r["vision"])  # image samples only
    for name in names:
        row = _Row(name, "vision")
        for rb, rc in zip(runs["base"], runs["cand"]):
            if name in rb["vision"] and name in rc["vision"]:
                row.add("iso", rb["vision"][name], rc["vision"][name])  # the tower runs whole:
                row.add("prop", rb["vision"][name], rc["vision"][name])  # rows are propagated
        rows.append(row)
        for r in runs["base"] + runs["cand"]:
            r["vision"].pop(name, None)
    h_base = [r["hidden"] for r in runs["base"]]
    h_prop = [r["hidden"] for r in runs["cand"]]
    for i in range(base.num_layers):
        layer_rows, h_base, h_prop = _compare_layer(i, base, cand, runs, h_base, h_prop, device)
        rows += layer_rows
        if progress:
            progress(i + 1, base.num_layers)
    return {"rows": [r.stats() for r in rows] + _final_rows(fronts, h_base, h_prop, base),
            "top1": _top1(fronts, h_base, h_prop, tie_margin)}


def _compare_layer(i, base, cand, runs, h_base, h_prop, device):
    """Layer i: baseline on its inputs, candidate on the baseline's (isolated) and on its own
    (propagated). Returns (rows, next baseline hidden, next propagated hidden)."""
    layer = base.build_layer(i).to(device)
    parts = _parts(layer)
    prefix = base.layer_prefix(i)
    out_b, seen_b = zip(*[_run_layer(layer, parts, h, r["calls"][i]) for h, r in zip(h_base, runs["base"])])
    del layer
    layer = cand.build_layer(i).to(device)
    out_i, seen_i = zip(*[_run_layer(layer, parts, h, r["calls"][i], sb.get("mlp_in"))
                          for h, r, sb in zip(h_base, runs["base"], seen_b)])
    out_p, seen_p = zip(*[_run_layer(layer, parts, h, r["calls"][i]) for h, r in zip(h_prop, runs["cand"])])
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
    nxt_b = [o + (r["deltas"][i] if r["deltas"][i] is not None else 0) for o, r in zip(out_b, runs["base"])]
    nxt_p = [o + (r["deltas"][i] if r["deltas"][i] is not None else 0) for o, r in zip(out_p, runs["cand"])]
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
    return {"rows": rows, "top1": top1}


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
    return {"first_divergent": first, "layers": layers,
            "final": {"logits_cosine": logits["propagated"]["cosine"],
                      "top1_agreement": agree / total if total else 1.0,
                      "top1_near_ties": excused}}


def compare_checkpoints(base_dir: str | Path, cand_dir: str | Path, samples: list[dict],
                        shards: int = 1, progress=None, tie_margin: float = TIE_MARGIN) -> dict:
    """Compare two checkpoints on `samples`; shards > 1 splits the samples over Ray tasks.

    Returns:
        {"first_divergent": module name | None, "layers": [rows], "final": {...}}
    """
    check_same_architecture(base_dir, cand_dir)
    if not samples:
        raise UserError("compare: the golden set is empty")
    shards = max(1, min(shards, len(samples)))
    if shards == 1:
        return finish(compare_stats(base_dir, cand_dir, samples, progress, tie_margin=tie_margin))
    # lazy: ray: heavy, loaded only when this runs
    import ray


    task = ray.remote(num_cpus=1, num_gpus=gpus_per_worker())(compare_stats)  # a GPU each where there are
    chunks = [samples[k::shards] for k in range(shards)]
    parts = ray.get([task.remote(str(base_dir), str(cand_dir), c, tie_margin=tie_margin)
                     for c in chunks])
    return finish(merge_stats(parts))
