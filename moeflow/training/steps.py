"""Plain PyTorch step functions of LoRA fine-tuning (no Ray in here).

The training loop in trainer.py strings these together; each one is usable
and tested on its own in a single process. Axis letters: B micro-batch rows,
S sequence, V vocab, L MoE layers, E experts, K experts per token.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moeflow.core.errors import UserError
from moeflow.model.models import load_model
from moeflow.model.routing import routed_experts, router_modules
from moeflow.training import context_parallel as CP
from moeflow.training.data import Example

log = logging.getLogger("moeflow.training")

if TYPE_CHECKING:  # types only: no transformers / peft import for a step function
    from typing import TypeAlias

    from peft import PeftModel
    from transformers import PreTrainedModel

    from moeflow.core.config import OptimizerSection
    from moeflow.training.parallel import Layout

    CausalLM: TypeAlias = PreTrainedModel | PeftModel  # a causal LM, LoRA-wrapped or not


def load_base(path: str, dtype: str, experts_impl: str = "grouped_mm",
              distributed: dict | None = None):
    """Load the HF checkpoint (safetensors only), frozen, in `dtype`.

    The class is moeflow.model.models' rule (the one regress and deploy use, so the
    adapter loads there): the causal-LM class, or the image-text class for
    Qwen3-VL-MoE / ERNIE-4.5-VL, whose vision tower is then loaded but frozen
    and never targeted (lora.py). A quantised base convert kept as stored
    (`convert.dtype: keep` of an MXFP4 / compressed-tensors release) loads through
    moeflow.model.models too, with its routed experts packed (moeflow.model.packed_base): every
    Ray Train rank holds the packed base and decodes one expert per matmul; its
    experts implementation stays eager (the loop that indexes one expert at a time).

    Args:
        path: checkpoint directory.
        dtype: "bfloat16" | "float16" | "float32".
        experts_impl: transformers experts implementation; grouped_mm's backward
            is several times faster than eager on CPU (benchmarks/bench_operators.py
            --parts experts measures the ratio).
        distributed: kwargs of transformers' `DistributedConfig` (the plan's
            `distributed_config`: fsdp_size / ep_size ...), None for a whole replica.
            Needs an initialised process group; parameters become DTensor shards.

    Returns:
        (model, tokenizer).
    """
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoTokenizer


    kwargs = {}
    if distributed:
        # lazy: transformers: heavy, loaded only when this runs
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**distributed)
    model = load_model(path, getattr(torch, dtype), trust_remote_code=False, **kwargs)
    import moeflow.model.split_lora  # noqa: F401  registers SPLIT_IMPL with transformers (imports peft)
    if experts_impl and getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation(experts_impl)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def local_param_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds (a DTensor counts its local shard only)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor counts its local shard only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def is_sharded(model: nn.Module) -> bool:
    """True when any parameter is a DTensor (FSDP / EP sharded by DistributedConfig)."""
    return any(hasattr(p, "to_local") for p in model.parameters())


def make_optimizer(model: nn.Module, opt_cfg: OptimizerSection,
                   max_steps: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over trainable parameters with warmup + cosine/linear/constant decay.

    Returns:
        (optimizer, LambdaLR scheduler).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    beta1, beta2 = opt_cfg.betas
    opt = torch.optim.AdamW(params, lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay,
                            betas=(beta1, beta2))
    warm, schedule = opt_cfg.warmup_steps, opt_cfg.schedule

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, max_steps - warm))
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - progress
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class RouterTap:
    """Forward hooks on the MoE routers that keep each layer's last routing.

    Hooks (not `output_router_logits`) work for every family, and give the
    router's own top-k indices where it returns them. The latest capture per
    layer is kept, so the recomputation of gradient checkpointing (which runs
    after we read) does not double-count. The routers are the anatomy's
    (routing.router_modules: any family, JetMoE's `*Gating` included); only those
    text tokens pass through are hooked: none in a vision tower, and on
    ERNIE-4.5-VL the text experts' router (`mlp.text_moe.gate`), not the image
    tokens' (`mlp.vision_moe.gate`). A router LoRA-wrapped by PEFT is found
    under its own name.
    """

    def __init__(self, model: nn.Module, top_k: int):
        self.top_k = top_k
        self.latest: dict[int, torch.Tensor] = {}
        self.layer_ids: list[int] = []
        self._handles = []
        # the anatomy's routers (gate / router beside `experts`, `*Router` / `*Gating` classes),
        # language model only, ERNIE-VL's image-token router left out
        for _name, mod, layer, experts in router_modules(model, text_only=True):
            slot = len(self.layer_ids)
            self.layer_ids.append(layer)
            self._handles.append(mod.register_forward_hook(self._hook(slot, experts)))

    def _hook(self, slot: int, num_experts: int):
        def hook(_mod, _inp, out):
            idx = routed_experts(out, self.top_k, num_experts)  # [T, K]
            if idx is not None:
                self.latest[slot] = idx
        return hook

    def remove(self) -> None:
        """Take the hooks off (before the LoRA layers they may sit on are unloaded)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.latest = [], {}

    def counts(self, num_experts: int, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Token counts [L, E] of the last forward (None if the model has no router)."""
        if not self.latest:
            return None
        rows = []
        for slot in range(len(self.layer_ids)):
            if slot not in self.latest:  # this router saw no token in the forward
                rows.append(torch.zeros(num_experts))  # [E]
                continue
            idx = self.latest[slot].cpu()  # [T, K]
            if token_mask is not None and idx.shape[0] == token_mask.numel():
                idx = idx[token_mask.reshape(-1).cpu()]  # the mask may live on the GPU
            rows.append(torch.bincount(idx.reshape(-1), minlength=num_experts).float())  # [E]
        self.latest.clear()
        return torch.stack(rows)  # [L, E]


def packed_positions(model: CausalLM, position_ids: torch.Tensor) -> torch.Tensor:
    """Position ids of packed rows in the form that keeps the model's examples apart.

    M-RoPE models (Qwen3-VL-MoE, ERNIE-4.5-VL) take [4, B, S]: row 0 the text
    positions their packed-sequence mask is built from, rows 1-3 the t/h/w
    rotary positions (all equal for text, which is plain 1-D RoPE). ERNIE-VL
    builds no packed mask from a [B, S] tensor (examples of a row would attend
    to each other); Qwen3-VL expands [B, S] to this same form itself.

    Args:
        position_ids: [B, S], restarting at 0 for each packed example.

    Returns:
        [B, S], or [4, B, S] for an M-RoPE model.
    """
    rope = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
    if "mrope_section" in rope:
        return position_ids[None].expand(4, -1, -1)  # [4, B, S]
    return position_ids


def loss_tokens(batch: dict) -> int:
    """Target tokens of a micro-batch: labels that a next-token loss counts ([B, S] labels,
    shifted by one as the causal-LM loss does, unless the batch is already shifted: a
    context-parallel piece, moeflow.training.context_parallel.split)."""
    labels = batch["labels"] if batch.get("shifted") else batch["labels"][:, 1:]
    return int((labels != -100).sum())


def forward_backward(model: CausalLM, batch: dict, scale: float, tap: RouterTap | None,
                     num_experts: int, *, token_total: int | None = None,
                     aux_scale: float | None = None) -> dict:
    """One micro-batch: forward (LM loss on completion tokens + router aux loss), backward.

    The LM loss is computed here as a SUM over target tokens, so a training step
    can weight every token equally across micro-batches and ranks: the backward
    objective is `sum_loss / token_total + coef * aux * aux_scale`. Without
    `token_total` it is the micro-batch's mean token loss times `scale` (plus the
    aux term times `scale`), the usual single-batch objective.

    Packed rows need `use_cache=False`: transformers detects packed sequences
    from `position_ids` (block-diagonal mask) only without a KV cache; with the
    config's default use_cache=True, examples in one row attend to each other.

    Args:
        batch: {"input_ids", "labels", "position_ids", "real"} each [B, S].
        scale: loss multiplier when `token_total` is None (e.g. 1 / grad_accum).
        tap: router hooks or None.
        num_experts: routed experts per MoE layer (0: dense model).
        token_total: target tokens of the whole step (all micro-batches, all ranks).
        aux_scale: weight of this micro-batch's router aux loss (1 / (micro-batches x ranks)).

    Returns:
        {"loss" (mean token loss of this micro-batch), "loss_sum", "aux_loss", "tokens"
         (target tokens), "counts" ([L, E] or None)}.
    """
    shifted = bool(batch.get("shifted"))
    batch = {k: v.to(model.device) for k, v in batch.items()
             if isinstance(v, torch.Tensor) and k != "positions"}
    kwargs = {}
    if hasattr(model.config.get_text_config(), "output_router_logits") and num_experts:
        kwargs["output_router_logits"] = True  # the model then returns .aux_loss
    out = model(input_ids=batch["input_ids"],
                position_ids=packed_positions(model, batch["position_ids"]), use_cache=False,
                **kwargs)
    counts = tap.counts(num_experts, batch.get("real")) if tap is not None else None
    logits = (out.logits if shifted else out.logits[:, :-1]).float()  # [B, S-1, V]
    targets = batch["labels"] if shifted else batch["labels"][:, 1:]  # [B, S-1]
    n = int((targets != -100).sum())
    loss_sum = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
        reduction="sum")
    aux = router_aux_loss(model, out, batch.get("real"))
    coef = float(getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0)
    if token_total is None:
        objective = loss_sum / max(1, n) * scale
        aux_weight = scale
    else:
        objective = loss_sum / max(1, token_total)
        aux_weight = 1.0 if aux_scale is None else aux_scale
    if aux is not None and coef:
        objective = objective + coef * aux_weight * aux
    objective.backward()
    return {"loss": float(loss_sum.detach()) / max(1, n), "loss_sum": float(loss_sum.detach()),
            "aux_loss": float(aux.detach()) if aux is not None else 0.0, "tokens": n,
            "counts": counts}


def router_aux_loss(model: CausalLM, out, real: torch.Tensor | None) -> torch.Tensor | None:
    """The router's load-balancing loss of a forward over its real tokens only (`real` [B, S]:
    False on padding), or the model's own `aux_loss` where that cannot be computed.

    transformers computes the loss over every token unless the forward got an attention mask,
    and a packed forward has none (its rows are told apart by `position_ids`). So the padding of
    a packed row counts as routed tokens, and the loss sends it gradient. The padding is a
    segment of its own (data.pack) whose token's embedding is zero: its hidden states stay zero
    through every layer (nothing else reaches them, and the layers have no biases), where each
    RMSNorm's backward multiplies by 1 / sqrt(eps), about 1,000. The gradient reaching the
    padding then grows by orders of magnitude per layer going down: non-finite by the bottom
    of a 40-layer model (seen on a random Qwen3-MoE; the LM loss alone never touches the
    padding). Here the loss is the model family's own `load_balancing_loss_func` (the
    function its forward calls, found in its modeling module) with `real` as the mask."""
    logits = getattr(out, "router_logits", None)
    unwrap = getattr(model, "get_base_model", None)  # PEFT's wrapper: the transformers model inside
    base: Any = unwrap() if callable(unwrap) else model
    # the class's own module, or its base's: FSDP2's fully_shard makes a subclass in its own module
    loss_fn = next((fn for cls in type(base).__mro__
                    if (fn := getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None))), None)
    experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
    own = getattr(out, "aux_loss", None)
    if real is None or not logits or loss_fn is None or not experts or not top_k:
        if own is not None and real is not None and not bool(real.all()) and not _WARNED:
            _WARNED.append(True)  # once per process
            log.warning("the router aux loss is %s's own, over padding too (its modeling module has no "
                        "load_balancing_loss_func to mask it with): a deep model may get non-finite "
                        "gradients from it; finetune.router_aux_loss_coef 0 turns it off", type(base).__name__)
        return own
    return loss_fn(logits, experts, top_k, real.to(logits[0].device))


_WARNED: list[bool] = []  # router_aux_loss's fallback said once


def allreduce_sum(t: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """Sum a small CPU tensor over ranks (through the GPU when the backend is NCCL);
    `world` is the size of `group` (default: all ranks)."""
    if world <= 1:
        return t
    if dist.get_backend() == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.cpu()


def accumulate(model: CausalLM, batches: list[dict], tap: RouterTap | None, num_experts: int,
               world: int, layout: Layout | None = None) -> dict:
    """Forward/backward one optimizer step's micro-batches, token-weighted.

    Every target token of the step weighs the same, whichever micro-batch and
    rank it is in: one small all-reduce of the token count first, then each
    micro-batch's summed loss is divided by that global count, and the LoRA
    gradients are then SUMMED over ranks (`allreduce_lora_grads(average=False)`).
    Hence 2 ranks x N micro-batches give the gradient of 1 rank x 2N. The router
    aux loss stays a mean over micro-batches and ranks.

    With a `layout` (moeflow.training.parallel) of TP and CP groups, "ranks" are
    those of the gradient group (DP x CP): TP ranks see the same tokens, and each
    CP rank runs its piece of every row (context_parallel.split) under the
    context-parallel attention; the count of target tokens is then over all pieces.

    Args:
        batches: this rank's micro-batches of the step (whole rows).
        world: ranks the step's tokens are spread over (ignored with a layout).

    Returns:
        {"loss_sum", "aux_loss" (summed over micro-batches), "tokens" (this rank's),
         "token_total" (all ranks'), "counts" ([L, E] summed, or None)}.
    """

    group = None
    if layout is not None:
        world, group = layout.grad_size, layout.grad_group
        if layout.cp > 1:
            batches = [CP.split(b, layout.cp, layout.cp_rank) for b in batches]
    local = sum(loss_tokens(b) for b in batches)
    total = int(allreduce_sum(torch.tensor([float(local)], dtype=torch.float64), world, group)[0])
    loss_sum = aux = 0.0
    counts = None
    for batch in batches:
        scope = (CP.context_parallel(batch["positions"], layout.cp_group, layout.cp)
                 if layout is not None and layout.cp > 1 else contextlib.nullcontext())
        with scope:  # the backward too: recompute (gradient checkpointing) runs attention again
            r = forward_backward(model, batch, 1.0, tap, num_experts, token_total=total,
                                 aux_scale=1.0 / (len(batches) * max(1, world)))
        loss_sum, aux = loss_sum + r["loss_sum"], aux + r["aux_loss"]
        if r["counts"] is not None:
            counts = r["counts"] if counts is None else counts + r["counts"]
    return {"loss_sum": loss_sum, "aux_loss": aux, "tokens": local, "token_total": total,
            "counts": counts}


def allreduce_lora_grads(model: nn.Module, world: int, average: bool = True, group=None) -> int:
    """Combine the trainable (LoRA) gradients over data-parallel ranks.

    One flat bucket, one all-reduce: only LoRA gradients cross the wire, never
    the frozen base (which has no gradients).

    Args:
        world: ranks in `group` (default group: all ranks); under TP the gradient group of
            this rank's TP index (moeflow.training.parallel).
        average: divide the sum by `world` (gradients of per-rank means); False keeps
            the sum (gradients already normalised by the global token count, `accumulate`).

    Returns:
        Bytes all-reduced on this call (0 when world == 1).
    """
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if world <= 1 or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])  # [N_lora]
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if average:
        flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer,
                   sched: torch.optim.lr_scheduler.LRScheduler, max_grad_norm: float | None,
                   layout: Layout | None = None) -> float:
    """Clip (if configured), step, zero grads. Returns the pre-clip grad norm.

    Under TP (a `layout` with tp > 1) the norm is the whole adapter's: replicated
    LoRA tensors once, TP-sharded ones summed over the TP group, so every TP rank
    clips by the same factor (as torch's clip_grad_norm_ would on one device)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if layout is None or layout.tp <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    else:
        norm = _clip_tp(params, max_grad_norm, layout)
    if not finite_everywhere(norm, params[0].device if params else torch.device("cpu")):
        # Megatron's check_for_nan_in_grad: a bf16 run has no loss scaler to skip the step, and
        # AdamW would write NaN into every adapter tensor, which then trains on as if nothing
        # happened. Every rank decides alike (one all-reduce), so none waits on the others.
        opt.zero_grad(set_to_none=True)
        step = sched.last_epoch + 1  # LRScheduler counts the steps taken; this is the next one
        why = ("in the first step, before any update: the base model's forward or backward on this data "
               "(try model.dtype float32)" if step == 1 else
               "training diverged (lower optimizer.lr or set optimizer.max_grad_norm)")
        raise UserError(f"the adapter's gradient norm is {float(norm)} on some rank at step {step}, {why}; "
                        f"stopped before the optimizer step")
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


def finite_everywhere(norm: torch.Tensor | float, device: torch.device) -> bool:
    """Whether the gradient norm is finite on every rank of the default process group (this
    rank's alone without one): a flag summed over the ranks, on `device` (NCCL needs the GPU's)."""
    bad = torch.tensor([0.0 if math.isfinite(float(norm)) else 1.0], device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    return float(bad) == 0.0


@torch.no_grad()
def eval_loss_sum(model: CausalLM, rows: dict, batch_size: int) -> tuple[float, int]:
    """(summed completion-token loss, loss tokens) over packed eval rows.

    Sums, not a mean, so data-parallel ranks can each take some rows and add up.
    No KV cache, so packed examples stay apart (see `forward_backward`).
    """
    model.eval()
    total, count = 0.0, 0
    for i in range(0, rows["input_ids"].shape[0], batch_size):
        b = {k: v[i:i + batch_size].to(model.device) for k, v in rows.items()}
        n = int((b["labels"][:, 1:] != -100).sum())
        if n == 0:  # no loss token: HF's mean loss would be NaN (0 / 0)
            continue
        out = model(input_ids=b["input_ids"], labels=b["labels"],
                    position_ids=packed_positions(model, b["position_ids"]), use_cache=False)
        total += float(out.loss) * n
        count += n
    model.train()
    return total, count


def eval_loss(model: CausalLM, rows: dict, batch_size: int) -> float:
    """Mean completion-token loss over packed eval rows."""
    total, count = eval_loss_sum(model, rows, batch_size)
    return total / max(1, count)


@torch.no_grad()
def generate_completions(model: CausalLM, examples: list[Example], pad_id: int, eos_id: int,
                         tokenizer, batch_size: int = 32) -> list[str]:
    """Greedy completions of each example's prompt (left-padded batches)."""
    model.eval()
    texts = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        width = max(len(e.prompt_ids) for e in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # [B, S]
        mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, S]
        for r, e in enumerate(chunk):
            ids[r, width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            mask[r, width - len(e.prompt_ids):] = 1
        new = max(len(e.completion_ids) for e in chunk) + 2
        # every causal-LM class has GenerationMixin; transformers' PreTrainedModel does not
        out = model.generate(  # type: ignore[operator]
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
            max_new_tokens=new, do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id)
        for row in out[:, width:].cpu():  # [B, new]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    model.train()
    return texts


def exact_hits(predictions: list[str], examples: list[Example]) -> list[bool]:
    """Per example: the prediction equals the reference completion (whitespace-stripped)."""
    return [p.strip() == e.completion.strip() for p, e in zip(predictions, examples, strict=True)]


def _clip_tp(params: list, max_norm: float | None, layout: Layout) -> torch.Tensor:
    """clip_grad_norm_ over an adapter whose TP-sharded tensors are split over the TP group."""
    grads = [(p, p.grad) for p in params if p.grad is not None]
    sq = torch.zeros(2, dtype=torch.float64)  # [replicated, this rank's shards]
    for p, g in grads:
        sq[1 if getattr(p, "_moeflow_tp", None) else 0] += float(g.double().pow(2).sum())
    sharded = sq[1:].clone()
    dist.all_reduce(sharded, group=layout.tp_group)
    norm = torch.sqrt(sq[0] + sharded[0])
    if max_norm:
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            for _, g in grads:
                g.mul_(coef)
    return norm
