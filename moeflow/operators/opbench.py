"""Operator choices measured on the model's own shapes.

One MoE block of the model — built from its own config by transformers (the
router, the fused experts, shared experts where the family has them), with
random weights — is timed for every experts implementation transformers offers
here, forward (serving) and forward + backward (training; with LoRA on the
experts when the training config targets them). The fastest implementation per
mode is the choice; eager is always measured, so the choice is never slower
than eager on the shapes measured.

Axis letters: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

from __future__ import annotations

import copy
import time

from moeflow.core.errors import UserError
from moeflow.model.anatomy import EXPERT_COUNT_KEYS
from moeflow.model.params import spec_from_path
from moeflow.parallel.memory import Plan, dtype_bytes, kv_bytes_per_token

# what runs without GPU kernels; split_lora is grouped_mm with expert LoRA applied split
# (moeflow/model/split_lora.py): the same as grouped_mm without an adapter
CPU_IMPLS = ("eager", "grouped_mm", "batched_mm", "split_lora")


def offered_implementations() -> list[str]:
    """Every experts implementation transformers knows (eager + its registry, which
    moeflow.model.split_lora adds its own to)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import moeflow.model.split_lora  # noqa: F401  registers SPLIT_IMPL (imports peft)

    return ["eager"] + sorted(set(ALL_EXPERTS_FUNCTIONS.keys()) - {"eager"})


def unavailable_reason(impl: str, device: str) -> str | None:
    """Why `impl` cannot run here without trying it (None: try it)."""
    if impl in CPU_IMPLS:
        return None
    if device == "cpu":
        return "needs a CUDA GPU and its kernel from the `kernels` hub (not fetched on CPU)"
    try:
        import kernels  # noqa: F401
    except ImportError:
        return "needs the `kernels` package to fetch its GPU kernel"
    return None


def meta_block(config):
    """The first MoE block of a model built on the meta device from `config`
    (no memory): (block module, router module, router name)."""
    # lazy: torch, transformers: heavy, loaded only when this runs
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from moeflow.model.routing import find_routers

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = AutoModelForImageTextToText.from_config(config)
    routers = find_routers(model)
    if not routers:
        raise UserError(f"{type(model).__name__}: no MoE router found (not a mixture-of-experts model)")
    name, router, _ = routers[0]
    return model.get_submodule(name.rsplit(".", 1)[0]), router, name


def router_width(router, experts: int) -> int:
    """The hidden size a router reads: its [experts, hidden] weight, held by the router
    itself (`weight`) or by a linear inside it (AFMoE's `gate`)."""
    for p in router.parameters():
        if p.dim() == 2 and int(p.shape[0]) == experts:
            return int(p.shape[-1])
    raise UserError(f"{type(router).__name__}: no [experts={experts}, hidden] weight in the router")


def block_shape(block, router) -> dict:
    """{hidden, intermediate, experts, top_k} of a MoE block, read from its fused experts."""
    experts = block.experts
    gate_up = getattr(experts, "gate_up_proj", None)
    down = experts.down_proj
    num = int(down.shape[0])
    hidden = router_width(router, num)
    # down_proj is [E, H, I] (or transposed [E, I, H]): the dim that is not H is I
    inter = int(down.shape[2] if down.shape[1] == hidden else down.shape[1])
    top_k = int(getattr(router, "top_k", 0) or getattr(block, "top_k", 0) or 1)
    return {"hidden": hidden, "intermediate": inter, "experts": num, "top_k": top_k,
            "fused_gate_up": gate_up is not None}


def real_block(block, dtype: str, device: str, seed: int = 0):
    """Materialise a meta block with random weights (std 0.02; biases and buffers 0)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    real = copy.deepcopy(block).to_empty(device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in real.parameters():
            values = torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1 else torch.zeros(p.shape)
            p.copy_(values)
        for b in real.buffers():
            b.zero_()
    return real.to(getattr(torch, dtype))


def _with_lora(block, rank: int):
    """Expert LoRA (PEFT `target_parameters` on the fused expert weights); the rest frozen.
    The wrappers are split-capable: under SPLIT_IMPL the adapter is applied as activations,
    under any other implementation as PEFT's folded weight (what that implementation gets
    in training)."""
    # lazy: peft: heavy, loaded only when this runs; loads torch, transformers, which importing this module does not
    from peft import LoraConfig, inject_adapter_in_model

    from moeflow.model.split_lora import enable_split_lora

    for p in block.parameters():
        p.requires_grad_(False)
    targets = [n for n, _ in block.experts.named_parameters(recurse=False)
               if n in ("gate_up_proj", "down_proj", "up_proj")]
    conf = LoraConfig(r=rank, lora_alpha=2 * rank, target_parameters=[f"experts.{t}" for t in targets])
    block = inject_adapter_in_model(conf, block)
    enable_split_lora(block)
    return block


def _timed(fn, reps: int, min_s: float = 0.05, device: str = "cpu") -> float:
    """Best of `reps` per-call times after one warm-up (seconds); a rep repeats `fn`
    until `min_s` has passed, so sub-millisecond shapes are not timed on noise. On CUDA the
    clock is read after the queued kernels finished (else it times their launches only)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        best = min(best, elapsed / calls)
    return best


def time_block(block, impl: str, tokens: int, hidden: int, dtype: str, device: str,
               backward: bool, reps: int = 2) -> float:
    """Seconds for one forward (or forward + backward) of `tokens` tokens through `block`."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    set_experts_impl(block, impl)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device=device, dtype=getattr(torch, dtype))

    def forward():
        with torch.no_grad():
            block(x)

    def train_step():
        inp = x.detach().requires_grad_(True)  # gradients flow on to earlier layers
        out = block(inp)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()

    return _timed(train_step if backward else forward, reps, device=device)


def set_experts_impl(block, impl: str) -> None:
    """Set the experts implementation of a (possibly PEFT-wrapped) block: transformers'
    experts modules read it from their config at each call."""
    for module in block.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(module, "num_experts"):
            config._experts_implementation = impl


def scaled_experts(shape: dict, dtype: str, max_block_gb: float) -> int:
    """Experts to build so the block's expert weights fit `max_block_gb` (tokens per
    expert is kept by the caller); the model's own count when it fits."""

    per = 3 * shape["hidden"] * shape["intermediate"] * dtype_bytes(dtype)
    fit = max(shape["top_k"], int(max_block_gb * 1e9 // per))
    return min(shape["experts"], fit)


def bench_block(config, *, tokens: int, dtype: str, device: str = "cpu", lora_rank: int | None = None,
                max_block_gb: float = 4.0, reps: int = 2, impls: list[str] | None = None) -> dict:
    """Time every experts implementation on one MoE block of `config`.

    Args:
        config: the model's transformers config (PretrainedConfig).
        tokens: tokens per forward (scaled to the machine by the caller).
        lora_rank: LoRA rank on the experts for forward+backward (None: frozen experts).
        max_block_gb: build fewer experts (same shapes, same tokens per expert) above this.

    Returns:
        {"shape", "tokens", "rows": [{"implementation", "available", "reason",
         "forward_s", "train_s"}], "chosen": {"serving", "training"}}.
    """
    block, router, name = meta_block(config)
    shape = block_shape(block, router)
    experts = scaled_experts(shape, dtype, max_block_gb)
    if experts < shape["experts"]:  # fewer experts, same tokens per expert
        tokens = max(shape["top_k"], tokens * experts // shape["experts"])
        _shrink(config, experts)
        block, router, name = meta_block(config)
    rows = []
    for impl in impls or offered_implementations():
        reason = unavailable_reason(impl, device) or _too_big(impl, shape, tokens, dtype, max_block_gb)
        row = {"implementation": impl, "available": reason is None, "reason": reason}
        if reason is None:
            row.update(_measure(block, impl, tokens, shape["hidden"], dtype, device, lora_rank, reps))
        rows.append(row)
    return {"shape": dict(shape, experts_built=experts), "router": name, "tokens": tokens, "dtype": dtype,
            "lora_rank": lora_rank, "rows": rows, "chosen": choose(rows)}


def _too_big(impl: str, shape: dict, tokens: int, dtype: str, max_gb: float) -> str | None:
    """batched_mm gathers one weight matrix per (token, expert) pair: refuse it when
    those copies exceed `max_gb` rather than run the machine out of memory."""

    if impl != "batched_mm":
        return None
    need = tokens * shape["top_k"] * 3 * shape["hidden"] * shape["intermediate"] * dtype_bytes(dtype)
    if need <= max_gb * 1e9:
        return None
    return (f"copies one expert weight per (token, expert) pair: {need / 1e9:.1f} GB at "
            f"{tokens} tokens > max_block_gb {max_gb:g}")


def _measure(block, impl, tokens, hidden, dtype, device, lora_rank, reps) -> dict:
    try:
        fwd_block = real_block(block, dtype, device)
        forward = time_block(fwd_block, impl, tokens, hidden, dtype, device, backward=False, reps=reps)
        train_block = _with_lora(fwd_block, lora_rank) if lora_rank else fwd_block
        if not lora_rank:
            for p in train_block.parameters():
                p.requires_grad_(False)
        train = time_block(train_block, impl, tokens, hidden, dtype, device, backward=True, reps=reps)
    except Exception as exc:  # a kernel that cannot run here: recorded, never chosen
        return {"available": False, "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"forward_s": round(forward, 6), "train_s": round(train, 6)}


def _shrink(config, experts: int) -> None:
    """Set the routed-expert count on `config` (whichever attribute holds it)."""
    conf = getattr(config, "text_config", None) or config
    for key in EXPERT_COUNT_KEYS:
        if getattr(conf, key, None):
            setattr(conf, key, experts)
            return
    raise UserError(f"{type(conf).__name__}: cannot find its expert count to scale the block down")


# serving: on a tie, a plain kernel over split_lora (without an adapter it is grouped_mm plus
# PEFT's bookkeeping, so a "win" there is timing noise); TIE is what counts as one on a shared host
SERVING_PREFERENCE = ("grouped_mm", "batched_mm", "eager", "split_lora")
TIE = 0.05


def choose(rows: list[dict], tie: float = TIE) -> dict:
    """Fastest available implementation per mode: serving by forward, training by
    forward + backward. Serving times within `tie` of the fastest count as equal and go to
    the first of SERVING_PREFERENCE (an implementation it does not list comes last)."""
    ok = [r for r in rows if r.get("available") and "forward_s" in r]
    if not ok:
        raise UserError("no experts implementation ran on this machine")
    best = min(r["forward_s"] for r in ok)
    tied = [r["implementation"] for r in ok if r["forward_s"] <= best * (1 + tie)]
    rank = {name: i for i, name in enumerate(SERVING_PREFERENCE)}
    return {"serving": min(tied, key=lambda n: rank.get(n, len(rank))),
            "training": min(ok, key=lambda r: r["train_s"])["implementation"]}


def kv_cache(model_dir: str, kv_dtype: str, context: int, tp: int = 1) -> dict:
    """KV-cache bytes per token and per sequence of `context` tokens (per TP rank)."""

    spec = spec_from_path(model_dir)
    layers = range(spec.layers)
    plan = Plan(tp=tp)
    return {"dtype": kv_dtype, "context": context, "tensor_parallel": tp, "attention": spec.attention,
            "bytes_per_token": int(kv_bytes_per_token(spec, plan, layers, 1, kv_dtype)),
            "bytes_per_sequence": int(kv_bytes_per_token(spec, plan, layers, context, kv_dtype))}
