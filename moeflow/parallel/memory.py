"""Memory per device of a parallel plan: weights, KV cache, activations, LoRA
states and a stated runtime overhead.

Rank layout (Megatron order, TP innermost): `rank = tp + TP * (dp + DP * pp)`.
The DP index splits as `dp = replica * FSDP + fsdp`, and as `dp = seq * CP + cp`:
the CP ranks of one sequence (context parallelism, LoRA training) are data
ranks to the weights (same weights, FSDP shards over them too) and split the
tokens of one sequence, so they divide every activation; an EP group is EP
consecutive ranks of the TP x DP grid (EP is a multiple of TP, so it holds
whole TP groups), matching transformers' `DistributedConfig` mesh where
`efsdp = FSDP * TP / EP` ranks hold the same experts and FSDP-shard them.

Sharding of each tensor of the `moeflow.model.params` inventory, in this order:
  1. PP: decoder layers split as evenly as possible, earlier stages take the
     remainder; embedding (and vision tower) on the first stage, final norm and
     head on the last (a tied embedding is repeated there).
  2. TP: column-parallel (dim 0) q/k/v/gate/up, MLA q_b/kv_b, embedding and
     head (vocab-parallel); row-parallel (dim 1) o/down; replicated norms,
     routers, MLA down-projections (q_a, kv_a) and the vision tower. Experts are
     TP-sharded on their intermediate dim only when EP == 1.
  3. EP: routed experts split on the expert dim in contiguous blocks.
  4. FSDP: every tensor is cut on dim 0 as `torch.chunk` does (FSDP2
     `fully_shard`), dense tensors over FSDP ranks, experts over efsdp ranks.
A piece is `torch.chunk`'s: ceil(n / k) rows, the last pieces shorter or empty.

    python -c "from moeflow.parallel.memory import *"   # library; see moeflow.parallel.planner
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeflow.core.errors import UserError
from moeflow.model.params import EXPERT_KINDS, ModelSpec, Tensor

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1,
    # release formats, scales included: 4-bit codes plus an 8-bit exponent per 32 (MXFP4),
    # an fp8 scale per 16 (NVFP4), a bf16 scale per group of 32 (INT4 as Kimi-K2 ships it)
    "mxfp4": 4.25 / 8, "nvfp4": 4.5 / 8, "int4": 4.5 / 8}
QUANTIZABLE = ("attention", "dense_mlp", "experts", "vision_experts", "shared_experts")
FRAGMENTATION = 0.05  # allocator fragmentation, a share of everything allocated
ADAM_BYTES = 16  # per trainable parameter: fp32 weight + grad + AdamW m + v


def human(nbytes: float) -> str:
    """Decimal GB / MB / KB with 3 significant digits (device budgets are decimal)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise UserError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Plan:
    """Parallel degrees. world = TP * PP * DP; EP subdivides TP x DP; FSDP and CP
    subdivide DP (DP / CP distinct sequences, each split over CP ranks)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them (transformers' efsdp)."""
        if self.ep <= 1:
            return self.fsdp
        return max(1, self.fsdp * self.tp // self.ep)

    def coords(self, rank: int) -> dict[str, int]:
        """pp stage, dp / fsdp / tp / ep / efsdp indices of a global rank, and the index of its
        sequence (`replica`: the DP ranks split into CP ranks sharing one sequence). The one
        rank order: the trainer's process groups (moeflow.training.parallel) are built from it,
        so each rank loads what the plan gave that rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world {self.world}")
        tp, rest = rank % self.tp, rank // self.tp
        dp, pp = rest % self.dp, rest // self.dp
        grid = dp * self.tp + tp  # position in the TP x DP grid
        return {"pp": pp, "dp": dp, "tp": tp, "fsdp": dp % self.fsdp, "cp": dp % self.cp,
                "replica": dp // self.cp, "ep": grid % self.ep, "efsdp": (grid // self.ep) % self.efsdp}

    def as_dict(self) -> dict[str, int]:
        return {"tensor_parallel": self.tp, "pipeline_parallel": self.pp,
                "expert_parallel": self.ep, "data_parallel": self.dp, "fsdp": self.fsdp,
                "context_parallel": self.cp}


def chunk_size(n: int, k: int, i: int) -> int:
    """Length of piece i when `torch.chunk` cuts n rows into k pieces."""
    if k <= 1:
        return n
    c = -(-n // k)
    return max(0, min(c, n - i * c))


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """Decoder layers held by pipeline stage `stage` (earlier stages take the remainder)."""
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def rank_numel(t: Tensor, plan: Plan, c: dict) -> int:
    """Elements of tensor `t` held by the rank with coordinates `c` (stage not checked)."""
    shape = list(t.shape)
    if plan.tp > 1 and t.tp_dim is not None and not (t.kind in EXPERT_KINDS and plan.ep > 1):
        shape[t.tp_dim] = chunk_size(shape[t.tp_dim], plan.tp, c["tp"])
    if t.kind in EXPERT_KINDS:
        if plan.ep > 1:
            shape[0] = chunk_size(shape[0], plan.ep, c["ep"])
        shape[0] = chunk_size(shape[0], plan.efsdp, c["efsdp"])
    elif plan.fsdp > 1:
        shape[0] = chunk_size(shape[0], plan.fsdp, c["fsdp"])
    return math.prod(shape)


# ------------------------------------------------------------ weights per rank


def stage_tensors(spec: ModelSpec, plan: Plan, stage: int,
                  tensors: list[Tensor] | None = None) -> list[Tensor]:
    """Tensors (of `tensors`, default all) held by pipeline stage `stage`."""
    layers = stage_layers(spec.layers, plan.pp, stage)
    first, last = stage == 0, stage == plan.pp - 1
    out = []
    for t in spec.tensors if tensors is None else tensors:
        if t.layer is not None:
            if t.layer in layers:
                out.append(t)
        elif t.kind in ("embed", "vision", "projector"):
            if first or (last and t.kind == "embed" and spec.tie_embeddings and plan.pp > 1):
                out.append(t)
        elif last:  # final norm, head
            out.append(t)
    return out


def planned_rank_numel(spec: ModelSpec, plan: Plan, rank: int) -> dict[str, int]:
    """Parameter elements rank `rank` holds under `plan`, by kind.

    This is the exact count the runtime must see after loading by the plan
    (`sum(p.numel() for p in model.parameters())` of the rank's local shards,
    buffers excluded); finetune and deploy check it.
    """
    c = plan.coords(rank)
    by_kind: dict[str, int] = {}
    for t in stage_tensors(spec, plan, c["pp"]):
        by_kind[t.kind] = by_kind.get(t.kind, 0) + rank_numel(t, plan, c)
    return by_kind


def planned_rank_bytes(spec: ModelSpec, plan: Plan, rank: int, dtype: str = "bfloat16") -> int:
    """Bytes of base-model parameters on rank `rank` when loaded in one `dtype`.

    Args:
        spec: the model (moeflow.model.params.model_spec / spec_from_path).
        plan: parallel degrees (moeflow.parallel.memory.Plan or Plan(**plan_degrees(record))).
        rank: global rank, TP innermost (see module docstring).
        dtype: the dtype every parameter is loaded in (model.dtype).
    Returns:
        Exact bytes of the rank's parameter shards.
    """
    # a load dtype has whole bytes per element, so the product is already a whole number
    return int(sum(planned_rank_numel(spec, plan, rank).values()) * dtype_bytes(dtype))


def weight_bytes(numel_by_kind: dict[str, int], weight_dtype: str,
                 precision: dict[str, str] | None = None) -> int:
    """Bytes of a rank's weights: matmul weights in `weight_dtype`, the rest
    (norms, routers, embeddings, head, vision) in bf16; kinds in `precision` (the
    checkpoint's stored formats, ModelSpec.precision) in theirs. Scales of fp8/int8
    (one fp32 per 128x128 block or per row) are under 0.1% and not counted; those of
    the 4-bit formats are (DTYPE_BYTES)."""
    low = dtype_bytes(weight_dtype)
    precision = precision or {}

    def per(kind: str) -> float:
        if kind in precision:
            return dtype_bytes(precision[kind])
        return low if kind in QUANTIZABLE else max(2, low)
    return round(sum(n * per(k) for k, n in numel_by_kind.items()))


def precision_label(weight_dtype: str, precision: dict[str, str] | None) -> str:
    """What the weights are held in, for reports: "bf16" or "experts mxfp4, rest bf16"."""
    if not precision:
        return weight_dtype
    kinds: dict[str, list[str]] = {}
    for kind, fmt in sorted(precision.items()):
        kinds.setdefault(fmt, []).append(kind)
    return ", ".join(f"{'/'.join(k)} {f}" for f, k in kinds.items()) + f", rest {weight_dtype}"


# ------------------------------------------------------------ workload


@dataclass(frozen=True)
class Workload:
    """What the devices must hold besides weights.

    lora: `micro_batch` sequences of `seq_len` per DP rank per micro-batch,
    `grad_accum` micro-batches per step (the pipeline's micro-batches).
    `recompute`: activation recomputation per layer (gradient checkpointing);
    None lets the planner choose (off when activations fit without it).
    inference: `batch` concurrent sequences per DP replica, each caching
    `context` tokens; prefill runs `prefill_chunk` tokens at a time.
    """

    mode: str = "lora"
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: bool | None = None
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("attention",)
    batch: int = 1
    context: int = 4096
    prefill_chunk: int = 2048
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    act_dtype: str = "bf16"

    def __post_init__(self):
        if self.mode not in ("lora", "inference"):
            raise UserError(f"plan mode must be lora or inference (got {self.mode!r})")
        for d in (self.weight_dtype, self.kv_dtype, self.act_dtype):
            dtype_bytes(d)


_TARGET_ALIASES = {"attention": ("attention",), "experts": ("experts", "vision_experts"),
                   "shared_experts": ("shared_experts",), "router": ("router",),
                   "mlp": ("dense_mlp",), "dense_mlp": ("dense_mlp",)}


def lora_targets(spec: ModelSpec, targets: tuple[str, ...]) -> list[Tensor]:
    """Base tensors that get a LoRA adapter: kind aliases (attention, experts,
    shared_experts, router, mlp) or module names (q_proj, ...). Norms, biases,
    sinks and vision towers are never adapted."""
    kinds = {k for a in targets for k in _TARGET_ALIASES.get(a, ())}
    names = {a for a in targets if a not in _TARGET_ALIASES}
    out = []
    for t in spec.tensors:
        if len(t.shape) < 2 or t.kind in ("norm", "embed", "head", "vision", "projector"):
            continue
        module = t.name.rsplit(".", 2)[-2] if t.name.endswith(".weight") else t.name.rsplit(".", 1)[-1]
        if t.kind in kinds or module in names:
            out.append(t)
    return out


def lora_numel(t: Tensor, rank: int) -> int:
    """LoRA A + B elements for one base tensor: r (in + out), per expert for 3-D."""
    if len(t.shape) == 3:
        return t.shape[0] * rank * (t.shape[1] + t.shape[2])
    return rank * (t.shape[0] + t.shape[1])


# ------------------------------------------------------------ per-device breakdown


@dataclass
class Breakdown:
    """Bytes per device of the fullest rank of a plan (components sum to total)."""

    parts: dict[str, float]
    budget: float
    stage: int
    rank: int
    weights_numel: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def over_by(self) -> float:
        return self.total - self.budget

    def as_dict(self) -> dict:
        return {"parts_gb": {k: round(v / 1e9, 4) for k, v in self.parts.items()},
                "total_gb": round(self.total / 1e9, 4), "budget_gb": round(self.budget / 1e9, 4),
                "stage": self.stage, "rank": self.rank, "weights_numel": self.weights_numel}


def kv_bytes_per_token(spec: ModelSpec, plan: Plan, layers: range, context: int,
                       kv_dtype: str) -> float:
    """KV-cache bytes of one sequence of `context` tokens over `layers`, per TP rank.

    GQA/MHA: 2 (K and V) x kv_heads / TP (at least one head: heads are replicated
    when TP > kv_heads) x head_dim. MLA: the compressed latent + rope key
    (kv_lora_rank + qk_rope_head_dim), the same on every TP rank. Sliding-window
    layers cache at most `window` tokens.
    """
    b = dtype_bytes(kv_dtype)
    if spec.attention == "mla":
        per = (spec.kv_lora_rank + spec.qk_rope_head_dim) * b
    else:
        per = 2 * math.ceil(spec.kv_heads / plan.tp) * spec.head_dim * b
    windows = spec.layer_windows or (None,) * spec.layers
    return sum(per * min(context, windows[i] or context) for i in layers)


def _layer_act_elems(spec: ModelSpec, plan: Plan, moe: bool, r_targets: int, lora_r: int) -> float:
    """Activation elements per token of one decoder layer kept for backward
    (memory-efficient attention: no seq^2 scores stored; packed rows under SDPA also
    keep a [S, S] mask per row, which flash-attention's varlen path does not build).

    Routed experts keep, per (token, expert) pair, the gathered input (H) and the
    gate, up and activation outputs (3 I), the intermediate cut by TP when the experts
    are TP-sharded (EP 1); the router its fp32 logits and probabilities (2 E).
    Measured against the saved tensors of transformers' grouped_mm experts
    (benchmarks/bench_activation.py)."""
    H, tp = spec.hidden, plan.tp
    attn = (2 * spec.heads + 2 * spec.kv_heads) * spec.head_dim / tp
    if moe:
        inter = spec.moe_intermediate / (tp if plan.ep == 1 else 1)
        mlp = (spec.experts_per_tok * (3 * inter + H)
               + 3 * spec.shared_intermediate / tp + 2 * spec.num_experts)
    else:
        dense = next((t.shape[0] for t in spec.tensors if t.kind == "dense_mlp"), 4 * H)
        mlp = 3 * dense / tp
    return 6 * H + attn + mlp + r_targets * lora_r


def activation_bytes(spec: ModelSpec, plan: Plan, work: Workload, stage: int,
                     lora_per_layer: int) -> float:
    """Activation bytes of the fullest rank of `stage` (see Workload)."""
    a = dtype_bytes(work.act_dtype)
    layers = stage_layers(spec.layers, plan.pp, stage)
    moe = set(spec.moe_layers)
    last = stage == plan.pp - 1
    vocab = -(-spec.vocab // plan.tp)
    if work.mode == "inference":
        C = work.prefill_chunk
        per = max(_layer_act_elems(spec, plan, i in moe, 0, 0) for i in layers) if layers else 0
        logits: float = work.batch * vocab * 4 if last else 0
        return C * per * a + logits
    T = work.micro_batch * work.seq_len / plan.cp  # CP: each rank holds 1/CP of the tokens
    # the loss runs on whole rows of logits: transformers gathers the TP-sharded LM head's
    # output (colwise_gather_output) before it
    vocab = spec.vocab
    full = [_layer_act_elems(spec, plan, i in moe, lora_per_layer, work.lora_rank) * T * a
            for i in layers]
    if work.recompute is not False:  # keep each layer's input, recompute one layer at a time
        stored = len(full) * T * spec.hidden * a + (max(full) if full else 0)
    else:
        stored = sum(full)
    in_flight = min(plan.pp - stage, max(1, work.grad_accum))  # 1F1B warm-up depth
    logits = 2 * T * vocab * 4 if last else 0  # fp32 logits + their gradient
    return stored * in_flight + logits


@dataclass
class _Index:
    """Layers grouped by structure, so a plan costs O(distinct layer shapes), not O(tensors)."""

    layer_sig: list[int]  # decoder layer -> signature id
    sigs: list[list[Tensor]]  # signature id -> the tensors of its first layer
    outside: list[Tensor]  # tensors outside decoder layers


_INDEX: dict[int, tuple[ModelSpec, _Index]] = {}


def _index(spec: ModelSpec) -> _Index:
    hit = _INDEX.get(id(spec))
    if hit and hit[0] is spec:
        return hit[1]
    per_layer: dict[int, list[Tensor]] = {}
    outside: list[Tensor] = []
    for t in spec.tensors:
        (outside if t.layer is None else per_layer.setdefault(t.layer, [])).append(t)
    keys: dict[tuple, int] = {}
    sigs: list[list[Tensor]] = []
    layer_sig: list[int] = []
    for i in range(spec.layers):
        ts = per_layer.get(i, [])
        key = tuple((t.name.split(f".{i}.", 1)[-1], t.shape, t.kind, t.tp_dim) for t in ts)
        if key not in keys:
            keys[key] = len(sigs)
            sigs.append(ts)
        layer_sig.append(keys[key])
    idx = _Index(layer_sig, sigs, outside)
    _INDEX[id(spec)] = (spec, idx)
    return idx


def _stage_numels(spec: ModelSpec, plan: Plan, stage: int, c: dict, work: Workload):
    """(numel by kind, LoRA numel, largest FSDP-gathered layer numel, LoRA targets per layer)."""
    idx = _index(spec)
    counts: dict[int, int] = {}
    for i in stage_layers(spec.layers, plan.pp, stage):
        counts[idx.layer_sig[i]] = counts.get(idx.layer_sig[i], 0) + 1
    first_layer = {sid: ts for sid, ts in enumerate(idx.sigs) if sid in counts}
    outside = stage_tensors(spec, plan, stage, idx.outside)
    groups = [(ts, counts[sid]) for sid, ts in first_layer.items()] + [(outside, 1)]
    target_ids = {id(t) for t in lora_targets(spec, work.lora_targets)} if work.mode == "lora" else set()
    flat = Plan(plan.tp, plan.pp, plan.ep, plan.dp, 1)
    by_kind: dict[str, int] = {}
    lora, gather, per_layer = 0.0, 0, 0
    for ts, n in groups:
        layer_gather, n_targets = 0, 0
        for t in ts:
            local = rank_numel(t, plan, c)
            by_kind[t.kind] = by_kind.get(t.kind, 0) + n * local
            if id(t) in target_ids:  # adapters shard like the module they adapt
                lora += n * lora_numel(t, work.lora_rank) * local / t.numel
                n_targets += 1
            if plan.fsdp > 1:
                layer_gather += rank_numel(t, flat, flat.coords(0)) - local
        gather = max(gather, layer_gather)  # FSDP units: each layer, and the root
        per_layer = max(per_layer, n_targets if ts is not outside else 0)
    return by_kind, lora, gather, per_layer


def stage_breakdown(spec: ModelSpec, plan: Plan, work: Workload, budget: float,
                    overhead: float, stage: int) -> Breakdown:
    """Memory of the fullest rank of one pipeline stage (its first rank: torch.chunk
    gives the first pieces the most rows)."""
    rank = stage * plan.tp * plan.dp
    c = plan.coords(rank)
    by_kind, lora, gather, per_layer = _stage_numels(spec, plan, stage, c, work)
    experts = {k: v for k, v in by_kind.items() if k in EXPERT_KINDS}
    dense = {k: v for k, v in by_kind.items() if k not in EXPERT_KINDS}
    wb = dtype_bytes(work.weight_dtype)
    parts = {"weights_dense": float(weight_bytes(dense, work.weight_dtype, spec.precision)),
             "weights_experts": float(weight_bytes(experts, work.weight_dtype, spec.precision))}
    if work.mode == "lora":
        parts["lora_states"] = lora * ADAM_BYTES
        parts["fsdp_gather"] = 2.0 * gather * wb  # current + prefetched unit
        parts["kv_cache"] = 0.0
    else:
        layers = stage_layers(spec.layers, plan.pp, stage)
        parts["kv_cache"] = work.batch * kv_bytes_per_token(spec, plan, layers, work.context,
                                                            work.kv_dtype)
    parts["activations"] = activation_bytes(spec, plan, work, stage, per_layer)
    parts["overhead"] = overhead + FRAGMENTATION * sum(parts.values())
    return Breakdown(parts=parts, budget=budget, stage=stage, rank=rank,
                     weights_numel=sum(by_kind.values()))


def memory_for_plan(spec: ModelSpec, plan: Plan, work: Workload, budget: float,
                    overhead: float) -> Breakdown:
    """Per-device memory of `plan`: the breakdown of its fullest rank.

    Args:
        spec: model; plan: degrees; work: workload.
        budget: device memory in bytes; overhead: fixed runtime bytes per device.
    Returns:
        Breakdown of the stage whose first rank needs the most memory.
    """
    stages = sorted({0, plan.pp - 1, plan.pp // 2})  # first, middle, last cover all shapes
    return max((stage_breakdown(spec, plan, work, budget, overhead, s) for s in stages),
               key=lambda b: b.total)
