"""Split expert LoRA vs PEFT's `target_parameters` path (grouped_mm), in one run.

    .venv/bin/python benchmarks/bench_split_lora.py                 # block at 128/256/1024 tokens + demo steps
    .venv/bin/python benchmarks/bench_split_lora.py --tokens 256 --demo-steps 0

1. One Qwen3-30B-A3B-shaped MoE block (hidden 2048, 128 experts, top-8, expert
   intermediate 768, LoRA rank 16 on gate_up_proj and down_proj; fp32; the issue's
   shape): forward + backward with PEFT's folded delta (experts grouped_mm) and with the
   split path (moeflow/model/split_lora.py), the same adapter values; seconds (best of
   --repeats) and their ratio, plus the worst relative difference of any LoRA gradient.
   PEFT's cost above the base grows with experts x rank (the delta weight and its
   gradient), the base's with tokens: the ratio falls as tokens per block grow.
2. The demo's expert-LoRA fine-tuning (configs/demo-experts.yaml: the shipped demo base,
   its LoRA on attention + experts, its data, micro-batch and sequence length): training
   steps in this process with experts grouped_mm vs split_lora, tokens/s ratio.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # moeflow_testing: in the checkout, not installed


def _block(tokens_rank: tuple[int, int], seed: int = 0):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    _, rank = tokens_rank
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02).requires_grad_(False)
    conf = LoraConfig(r=rank, lora_alpha=2 * rank,
                      target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    block = inject_adapter_in_model(conf, block)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "lora_" in name:  # B is zero at init: random factors so both get gradients
                p.normal_(0, 0.02)
    return block


def _set_impl(module, impl: str) -> None:
    for m in module.modules():
        if getattr(m, "config", None) is not None and hasattr(m, "num_experts"):
            m.config._experts_implementation = impl


def _fwd_bwd(block, x: torch.Tensor) -> dict:
    inp = x.detach().requires_grad_(True)
    out = block(inp)
    out = out[0] if isinstance(out, tuple) else out
    out.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.requires_grad}
    block.zero_grad(set_to_none=True)
    return grads


def _best(block, x, repeats: int) -> tuple[float, dict]:
    grads = _fwd_bwd(block, x)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        grads = _fwd_bwd(block, x)
        best = min(best, time.perf_counter() - t0)
    return best, grads


def bench_block(tokens: int, rank: int, repeats: int) -> dict:
    from moeflow.model.split_lora import SPLIT_IMPL, enable_split_lora

    peft_block = _block((tokens, rank))
    x = torch.randn(1, tokens, 2048, generator=torch.Generator().manual_seed(1))
    peft_s, peft_grads = _best(peft_block, x, repeats)
    split_block = copy.deepcopy(peft_block)
    enable_split_lora(split_block)
    _set_impl(split_block, SPLIT_IMPL)
    split_s, split_grads = _best(split_block, x, repeats)
    worst = max(float((split_grads[n] - g).norm() / g.norm()) for n, g in peft_grads.items())
    return {"tokens": tokens, "peft_s": peft_s, "split_s": split_s, "ratio": peft_s / split_s,
            "worst_grad_rel": worst}


def bench_demo(steps: int) -> dict:
    """Tokens/s of demo-experts training steps, grouped_mm vs split_lora, same seed and data."""
    from moeflow.core.config import load_config
    from moeflow.training import data as D
    from moeflow.training import steps as T
    from moeflow.training.lora import apply_lora
    from moeflow_testing.demo_data import make_dataset

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "demo-experts.yaml")
    tmp = Path(tempfile.mkdtemp(prefix="mf-bench-split-"))
    train, held_out = make_dataset(tmp / "data", n_train=400, n_eval=8)
    cfg.data.train_file, cfg.data.eval_file = str(train), str(held_out)
    rates = {}
    for impl in ("grouped_mm", "split_lora"):
        torch.manual_seed(cfg.seed)
        model, tok = T.load_base(str(root / "assets" / "demo-base"), "float32", impl)
        model, _, _ = apply_lora(model, cfg.lora)
        model.train()
        ds = D.build_dataset(cfg.data, tok, cfg.seed)
        opt, sched = T.make_optimizer(model, cfg.optimizer, steps)
        tap = T.RouterTap(model, model.config.num_experts_per_tok)
        batches = D.micro_batches(ds.train_rows, cfg.finetune.micro_batch_size, 0, 1, cfg.seed)
        tokens = seconds = 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            _, batch = next(batches)
            T.forward_backward(model, batch, 1.0, tap, model.config.num_experts)
            T.optimizer_step(model, opt, sched, cfg.optimizer.max_grad_norm)
            if step > 0:  # the first step warms up
                tokens += float(batch["real"].sum())
                seconds += time.perf_counter() - t0
        rates[impl] = tokens / seconds
    return {"steps": steps, "grouped_mm_tok_s": rates["grouped_mm"], "split_tok_s": rates["split_lora"],
            "ratio": rates["split_lora"] / rates["grouped_mm"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[128, 256, 1024], help="tokens per block")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--demo-steps", type=int, default=40, help="0: skip the demo fine-tuning part")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(f"torch threads {torch.get_num_threads()}")
    print("block (Qwen3-30B-A3B shape), forward+backward, fp32: PEFT folded vs split")
    for tokens in args.tokens:
        r = bench_block(tokens, args.rank, args.repeats)
        print(f"  tokens {r['tokens']:5d}: PEFT {r['peft_s']:.3f} s  split {r['split_s']:.3f} s  "
              f"split/PEFT speed {r['ratio']:.2f}x  worst LoRA grad rel diff {r['worst_grad_rel']:.1e}")
    if args.demo_steps:
        d = bench_demo(args.demo_steps)
        print(f"demo-experts training, {d['steps']} steps: grouped_mm {d['grouped_mm_tok_s']:.0f} tok/s, "
              f"split_lora {d['split_tok_s']:.0f} tok/s, ratio {d['ratio']:.2f}x")


if __name__ == "__main__":
    main()
