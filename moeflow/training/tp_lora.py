"""LoRA on tensor-parallel projections, as a PEFT `LoraVariant`.

transformers' tensor parallelism (`tp_plan`) shards a Linear's weight as a
DTensor and replaces the module's forward: a column-wise (`colwise`) module
takes the replicated input and returns its slice of the output features; a
row-wise (`rowwise`) one takes its slice of the input features and returns the
all-reduced full output. PEFT's LoRA adds `B(A(x))` of the unsharded shapes to
that result, which is the shape error users hit. The variants here give each
rank the matching piece of the adapter (Megatron's layout) and keep PEFT for
everything else (config, targets, dropout, scaling, enable/disable, unload):

  colwise  A [r, in] replicated, B [out/TP, r] this rank's output rows.
           h = A x is computed whole on every rank; its gradient is partial
           (each rank back-propagates only its output slice), so it is summed
           over the TP group in backward: one all-reduce of r values per token.
  rowwise  A [r, in/TP] this rank's input columns, B [out, r] replicated.
           h = sum over ranks of A_k x_k: one all-reduce of r values per token
           in forward (where the base reduces its own partial sums); the
           gradient of h is already whole.

Either way the only TP traffic LoRA adds is rank-r, against the base's
hidden-sized all-reduce. Expert LoRA (PEFT `target_parameters` on the fused
expert tensors) takes the same layout through moeflow's split expert LoRA
(`expert_colwise` / `expert_rowwise` below: why there). Replicated LoRA tensors get the same full gradient on
every TP rank (the loss is replicated), so data-parallel gradient reduction
runs over the ranks of one TP index only (moeflow.training.parallel). A
module that the TP plan leaves whole (MLA's down-projections, routers) keeps
PEFT's vanilla LoRA.

Saved adapters are gathered to the unsharded PEFT layout, identical to a TP=1
adapter; loading one slices it back (`load_sharded_state`).
"""

from __future__ import annotations

import math
import re
import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from peft.tuners.lora.layer import LoraLayer, LoraVariant, ParamWrapper
from torch import nn

from moeflow.core.errors import UserError
from moeflow.model.split_lora import LOW_RANK, SPLIT_IMPL, grouped
from moeflow.training.parallel import Layout

if TYPE_CHECKING:  # types only
    from peft import PeftModel

COLWISE = ("colwise",)
ROWWISE = ("rowwise",)


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ColwiseLora(LoraVariant):
    """B sharded by output rows; the rank-r intermediate's gradient summed over TP."""

    def __init__(self, group):
        self.group = group

    def forward(self, module, active_adapter, x, result, **kwargs):
        h = module.lora_A[active_adapter](module.lora_dropout[active_adapter](x))  # [..., r]
        h = _SumBackward.apply(h, self.group)
        return result + module.lora_B[active_adapter](h) * module.scaling[active_adapter]

    def merge_safe(self, module, active_adapter, orig_weight):
        raise UserError("merging a tensor-parallel LoRA in place is not supported: save the "
                        "adapter (gathered to the TP=1 layout) and merge it on one device")

    merge_unsafe = merge_safe


class RowwiseLora(ColwiseLora):
    """A sharded by input columns; the rank-r intermediate summed over TP in forward."""

    def forward(self, module, active_adapter, x, result, **kwargs):
        h = module.lora_A[active_adapter](module.lora_dropout[active_adapter](x))  # [..., r] partial
        h = _SumForward.apply(h, self.group)
        return result + module.lora_B[active_adapter](h) * module.scaling[active_adapter]


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward, the gradient times `s` in backward."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.s, None


class _ScaleForward(torch.autograd.Function):
    """Times `s` in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, s):
        return x * s

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Expert LoRA under TP. transformers' `moe_tp_experts` runs every expert's shard on every
# rank: the experts' input gradient is all-reduced where the experts begin and their output
# all-reduced where they end, and in between each rank holds the `packed_colwise` gate|up
# rows and the `rowwise` down columns of every expert. PEFT's ParamWrapper would add a
# whole-shape delta to that shard (and its TP hook fails on it); moeflow's split expert LoRA
# (moeflow.model.split_lora: x·A then ·B per expert, as activations) slots into that forward with
# the same Megatron layout as the Linear variants above and rank-r traffic per routed token
# (a delta-weight path would all-reduce an [E, r, H] gradient every step instead):
#   gate|up  A replicated, B this rank's gate and up rows. t = x·A is whole; its gradient is
#            partial, summed over TP for A's sake. x's own gradient must stay partial (the
#            experts' input all-reduce sums it), so the whole one reaching x is scaled 1/TP.
#   down     A this rank's input columns, B replicated. t = sum over ranks of x_k·A_k (one
#            all-reduce); t·B is then whole on every rank, and scaled 1/TP in forward so the
#            experts' output all-reduce adds it once (backward: the whole gradient, unscaled).

def expert_colwise(group, size: int):
    """The low-rank term of a column-wise sharded expert tensor (moeflow.model.split_lora LOW_RANK)."""

    def low_rank(x, p, q, scale, offsets):
        t = grouped(_ScaleGrad.apply(x, 1.0 / size), p, offsets)  # [S, r] whole
        t = _SumBackward.apply(t, group)
        return grouped(t, q, offsets) * scale  # [S, this rank's outputs]
    return low_rank


def expert_rowwise(group, size: int):
    """The low-rank term of a row-wise sharded expert tensor (moeflow.model.split_lora LOW_RANK)."""

    def low_rank(x, p, q, scale, offsets):
        t = _SumForward.apply(grouped(x, p, offsets), group)  # [S, r] summed over TP
        return _ScaleForward.apply(grouped(t, q, offsets) * scale, 1.0 / size)  # [S, out]
    return low_rank


EXPERT_STYLES = {"packed_colwise": ("colwise", 2), "colwise": ("colwise", 1),
                 "rowwise": ("rowwise", 1)}


def _shard_param_lora(name: str, mod: ParamWrapper, tp_plan: dict[str, str], layout: Layout,
                      seed: int) -> str | None:
    """Give a PEFT ParamWrapper (LoRA on an expert tensor) on a TP-sharded parameter its piece
    of the adapter and the TP low-rank term; None when the plan leaves the tensor whole."""
    key = param_key(name, mod)
    if getattr(mod.get_base_layer(), "_is_expert_parallel", False):
        return _shard_by_expert(key, mod, layout, seed)
    style = _style(tp_plan, key)
    if style is None or style.startswith("replicated"):
        return None
    if style not in EXPERT_STYLES or mod.num_experts <= 1:
        raise UserError(f"lora.target_modules: {key} is tensor-parallel as {style!r}; LoRA on "
                        "a parameter runs on colwise, packed_colwise and rowwise expert "
                        "tensors only: leave it out of the targets, or plan tensor_parallel: 1")
    kind, packs = EXPERT_STYLES[style]
    param = mod.get_param()
    local = param.to_local() if hasattr(param, "to_local") else param
    # PEFT's in/out: the experts hold [E, out, in], or [E, in, out] when `is_transposed`
    out_dim, in_dim = (1, 2) if mod._did_swap_in_out_features else (2, 1)
    n_in, n_out = _features(mod)
    full, dim = (n_out, out_dim) if kind == "colwise" else (n_in, in_dim)
    rows = piece_index(full, packs, layout.tp, layout.tp_rank)
    if full % packs or local.shape[dim] != len(rows):
        raise UserError(f"lora.target_modules: {key} is tensor-parallel as {style!r}, but this "
                        f"rank holds {local.shape[dim]} of its {full} "
                        f"{'output' if kind == 'colwise' else 'input'} features where expert "
                        f"LoRA expects {len(rows)}; plan tensor_parallel: 1 for this model")
    for adapter in list(mod.lora_A):
        a, b = initial_lora(key, _rows(mod.lora_A[adapter]), n_in, n_out, seed)
        if kind == "colwise":
            mod.lora_A[adapter] = _linear(a, mod.lora_A[adapter])
            mod.lora_B[adapter] = _linear(b[rows], mod.lora_B[adapter], (0, n_out, packs))
        else:
            mod.lora_A[adapter] = _linear(a[:, rows], mod.lora_A[adapter], (1, n_in, packs))
            mod.lora_B[adapter] = _linear(b, mod.lora_B[adapter])
    make = expert_colwise if kind == "colwise" else expert_rowwise
    setattr(mod, LOW_RANK, make(layout.tp_group, layout.tp))
    return style


def _whole_low_rank(x, p, q, scale, offsets):
    """The plain low-rank term (no collective): an expert-parallel rank's own experts."""
    return grouped(grouped(x, p, offsets), q, offsets) * scale


def _shard_by_expert(key: str, mod: ParamWrapper, layout: Layout, seed: int) -> str:
    """Expert LoRA on experts that transformers' EP shards by expert, its EP group being the
    TP group (`ep_size == tp_size`): each rank keeps the LoRA of its own experts, A's rows
    and B's columns of them (PEFT's B [out, r·E] is r-major: column i·E + e), and computes
    them with no collective — its experts see every token routed to them (the all-to-all
    dispatch), so their LoRA gradients are whole on their rank."""
    param = mod.get_param()
    local = param.to_local() if hasattr(param, "to_local") else param
    experts = mod.num_experts
    if local.shape[0] * layout.tp != experts or experts % layout.tp:
        raise UserError(f"lora.target_modules: {key} is expert-parallel with {local.shape[0]} "
                        f"of {experts} experts per rank; expert LoRA needs expert_parallel equal "
                        f"to tensor_parallel={layout.tp}, or plan expert_parallel: 1")
    n_in, n_out = _features(mod)
    for adapter in list(mod.lora_A):
        r = mod.r[adapter]
        a, b = initial_lora(key, r * experts, n_in, n_out, seed)
        rows = piece_index(r * experts, 1, layout.tp, layout.tp_rank)  # A: e0·r .. e1·r
        cols = piece_index(r * experts, r, layout.tp, layout.tp_rank)  # B: i·E + e0 .. e1
        mod.lora_A[adapter] = _linear(a[rows], mod.lora_A[adapter], (0, r * experts, 1))
        mod.lora_B[adapter] = _linear(b[:, cols], mod.lora_B[adapter], (1, r * experts, r))
    mod.num_experts = local.shape[0]  # PEFT reshapes the factors by it
    setattr(mod, LOW_RANK, _whole_low_rank)  # split path only: PEFT's would mix DTensors
    return "expert_parallel"


def _style(tp_plan: dict[str, str], name: str) -> str | None:
    """The TP style the plan gives module `name` (plan keys use `*` for layer indices)."""
    generic = re.sub(r"\.\d+(?=\.|$)", ".*", name)
    return tp_plan.get(generic) or tp_plan.get(name)


def shard_bounds(n: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s piece when n rows are cut as DTensor's Shard does
    (torch.chunk: ceil(n / tp) rows each, the last pieces shorter or empty)."""
    size = -(-n // tp)
    start = min(n, rank * size)
    return start, min(n, start + size)


def initial_lora(name: str, rank: int, in_features: int, out_features: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The starting (A [r, in], B [out, r]) of the LoRA on module `name`: PEFT's default
    (A Kaiming-uniform with a = sqrt(5) over the whole input width, B zero), drawn from
    a generator seeded by the run's seed and the module name, so a layer starts the same
    whatever the layout (PEFT draws a sharded layer's A from the global RNG at its local
    width, which differs from rank to rank and from a single process)."""

    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), ..)
    a = (torch.rand(rank, in_features, generator=g) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank)


def init_by_name(peft_model: PeftModel, seed: int) -> int:
    """Re-initialise every LoRA layer with `initial_lora`: module LoRA on Linears, and expert /
    parameter LoRA (PEFT's `ParamWrapper`: A [r·E, in], B [out, r·E], named by the parameter).

    Returns:
        How many LoRA layers were set.
    """

    n = 0
    for name, mod in peft_model.get_base_model().named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        if isinstance(mod, ParamWrapper):
            name = param_key(name, mod)
        elif not isinstance(mod.get_base_layer(), nn.Linear):
            continue
        n_in, n_out = _features(mod)
        for adapter in list(mod.lora_A):
            a, b = initial_lora(name, _rows(mod.lora_A[adapter]), n_in, n_out, seed)
            mod.lora_A[adapter] = _linear(a, mod.lora_A[adapter])
            mod.lora_B[adapter] = _linear(b, mod.lora_B[adapter])
            n += 1
    return n


def _features(mod: LoraLayer) -> tuple[int, int]:
    """(in, out) features of a LoRA layer's whole base: a Linear's own, or PEFT's for a
    ParamWrapper (read from the adapted parameter's global shape)."""
    base = mod if isinstance(mod, ParamWrapper) else mod.get_base_layer()
    n_in, n_out = base.in_features, base.out_features
    assert isinstance(n_in, int) and isinstance(n_out, int), f"{type(base).__name__} has no shape"
    return n_in, n_out


def _rows(lin: nn.Module) -> int:
    """Output rows of a LoRA sub-layer (r, or r x experts for expert LoRA's A)."""
    w = lin.weight
    assert isinstance(w, torch.Tensor), f"{type(lin).__name__} has no weight tensor"
    return int(w.shape[0])


def param_key(name: str, wrapper: ParamWrapper) -> str:
    """The adapted parameter's name in the base model (`model.layers.0.mlp.experts.down_proj`)
    from a PEFT ParamWrapper's module name (nested wrappers add `.base_layer`s)."""
    module = re.sub(r"(\.base_layer)+$", "", name)
    return f"{module}.{wrapper.parameter_name}"


def _linear(weight: torch.Tensor, like: nn.Module,
            tp: tuple[int, int, int] | None = None) -> nn.Linear:
    """A plain bias-free Linear holding `weight`, on `like`'s device and dtype (a PEFT LoRA
    sub-layer: possibly a DTensor with a TP forward that PEFT installed; replaced whole)."""
    w = like.weight
    assert isinstance(w, torch.Tensor), f"{type(like).__name__} has no weight tensor"
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    dtype = w.dtype
    device = w.to_local().device if hasattr(w, "to_local") else w.device
    out.weight = nn.Parameter(weight.to(device=device, dtype=dtype).contiguous(),
                              requires_grad=w.requires_grad)
    if tp is not None:
        out.weight._moeflow_tp = tp  # type: ignore[attr-defined]
    return out


def shard_lora(peft_model: PeftModel, layout: Layout, seed: int) -> dict[str, str]:
    """Give every LoRA layer on a TP-sharded projection its piece of the adapter.

    Call right after `get_peft_model` and `init_by_name(seed)`: each rank keeps its
    slice of the layout-independent start (`initial_lora`), replacing the LoRA
    sub-layers PEFT's own TP integration made (local-width A drawn per rank, and a
    DTensor row-wise A whose forward fails with a shape error under autograd).
    Modules the TP plan shards in another way (packed or gathered outputs,
    vocab-parallel embeddings) are refused in one line.

    Returns:
        {module name: "colwise" | "rowwise"} of the layers made tensor-parallel.
    """

    base = peft_model.get_base_model()
    tp_plan = getattr(base, "tp_plan", None) or {}
    if layout.tp <= 1 or not tp_plan:
        return {}
    done = {}
    for name, mod in base.named_modules():
        if not isinstance(mod, LoraLayer) or not hasattr(mod, "lora_A"):
            continue
        if isinstance(mod, ParamWrapper):  # expert / router tensors (PEFT target_parameters)
            style = _shard_param_lora(name, mod, tp_plan, layout, seed)
            if style:
                done[param_key(name, mod)] = style
            continue
        style = _style(tp_plan, name)
        if style is None or style.startswith("replicated"):
            continue
        if style not in COLWISE + ROWWISE:
            raise UserError(f"lora.target_modules: {name} is tensor-parallel as {style!r}; LoRA "
                            "runs on colwise and rowwise projections only: leave it out of the "
                            "targets, or plan tensor_parallel: 1")
        base_layer = mod.get_base_layer()
        if not isinstance(base_layer, nn.Linear):  # transformers' colwise / rowwise shard Linears
            raise UserError(f"lora.target_modules: {name} is tensor-parallel as {style!r} but is "
                            f"a {type(base_layer).__name__}, not a Linear; leave it out of the "
                            "targets, or plan tensor_parallel: 1")
        n_in, n_out = base_layer.in_features, base_layer.out_features  # whole: the Linear's own
        for adapter in list(mod.lora_A):
            a, b = initial_lora(name, mod.r[adapter], n_in, n_out, seed)
            if style in COLWISE:
                lo, hi = shard_bounds(n_out, layout.tp, layout.tp_rank)
                mod.lora_A[adapter] = _linear(a, mod.lora_A[adapter])
                mod.lora_B[adapter] = _linear(b[lo:hi], mod.lora_B[adapter], (0, n_out, 1))
                mod.lora_variant[adapter] = ColwiseLora(layout.tp_group)
            else:
                lo, hi = shard_bounds(n_in, layout.tp, layout.tp_rank)
                mod.lora_A[adapter] = _linear(a[:, lo:hi], mod.lora_A[adapter], (1, n_in, 1))
                mod.lora_B[adapter] = _linear(b, mod.lora_B[adapter])
                mod.lora_variant[adapter] = RowwiseLora(layout.tp_group)
        done[name] = style
    if any(isinstance(m, ParamWrapper) and getattr(m, LOW_RANK, None) for m in base.modules()):
        # the experts' LoRA as activations (above)
        base.set_experts_implementation(SPLIT_IMPL)  # type: ignore[operator]  # a PreTrainedModel
    return done


def tp_dim(param: torch.Tensor) -> int | None:
    """The dimension a TP-sharded LoRA tensor is cut on (None: whole on every rank)."""
    meta = getattr(param, "_moeflow_tp", None)
    return meta[0] if meta else None


def piece_index(full: int, packs: int, tp: int, rank: int) -> torch.Tensor:
    """Indices of `rank`'s piece of `full` rows cut as DTensor's Shard does, or, for `packs`
    tensors packed along the dimension (gate|up: 2), as transformers' packed styles cut them
    (_StridedShard: each pack's rows cut alike, the rank's pieces concatenated)."""
    n = full // packs
    lo, hi = shard_bounds(n, tp, rank)
    return torch.cat([torch.arange(j * n + lo, j * n + hi) for j in range(packs)])


def gather(param: torch.Tensor, layout: Layout, value: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor of a TP-sharded LoRA parameter (or the tensor itself): every TP
    rank's piece, padded to one size for all_gather, then put back at its rows.
    `value`: a tensor cut like `param` to gather instead (its gradient, an Adam moment)."""
    meta = getattr(param, "_moeflow_tp", None)
    t = (param if value is None else value).detach()
    if not meta or layout.tp <= 1:
        return t.contiguous()
    dim, full, packs = meta
    rows = [piece_index(full, packs, layout.tp, k) for k in range(layout.tp)]
    pad = list(t.shape)
    pad[dim] = max(len(r) for r in rows)
    buf = torch.zeros(pad, dtype=t.dtype, device=t.device)
    buf.narrow(dim, 0, t.shape[dim]).copy_(t)
    parts = [torch.empty_like(buf) for _ in range(layout.tp)]
    dist.all_gather(parts, buf, group=layout.tp_group)
    shape = list(t.shape)
    shape[dim] = full
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    for part, idx in zip(parts, rows):
        out.index_copy_(dim, idx.to(t.device), part.narrow(dim, 0, len(idx)))
    return out


def local_piece(full: torch.Tensor, param: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """This rank's piece of a whole tensor, cut as `param` is (the whole tensor if it is not)."""
    meta = getattr(param, "_moeflow_tp", None)
    if not meta or layout is None or layout.tp <= 1:
        return full
    dim, n, packs = meta
    return full.index_select(dim, piece_index(n, packs, layout.tp, layout.tp_rank).to(full.device))
