"""Build the demo's pre-trained base: a tiny Qwen3-MoE that knows the demo language.

    python -m moeflow_testing.demo_base assets/demo-base        # a few minutes on 2 CPU cores

A random-initialised debug model (moeflow_testing.tiny) predicts nearly uniformly and
routes nearly evenly, so damage barely moves its metrics and its experts have
no hot spots. This script pre-trains one on the demo language
(moeflow_testing.demo_data.language_docs: letter facts, spellings, "<word> backwards
is <drow>", English-like sentences), deterministically (fixed seeds, a fixed
thread count, batches in a seeded order), and saves it in the real HF layout:
sharded safetensors + index + config.json + tokenizer, plus `demo_base.json`
(the recipe and the measured held-out perplexity and expert-load skew).

It never sees the fine-tuning formats ("min: ...", "reverse: ...\\nanswer:")
nor their words (train and eval of make_dataset, the golden suite's held-out
words): fine-tuning still has the formats to learn.

Routing: no load-balancing auxiliary loss (Qwen3-MoE applies one only with
`output_router_logits`); the learned routing is left skewed on purpose, which
is how the operators stage finds hot experts. The repo ships the result under
assets/demo-base/; `moeflow demo` copies it (rebuild: run this script).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from moeflow.evaluation.probe import probe_model
from moeflow.evaluation.suite import GOLDEN_SUITE, load_suite
from moeflow_testing.demo_data import heldout_words, language_docs
from moeflow_testing.tiny import build_debug_model

ASSET = Path(__file__).resolve().parents[1] / "assets" / "demo-base"
HELDOUT_SEED = 9001  # configs/suites/golden/demo_text.jsonl = language_docs(64, HELDOUT_SEED)
RECIPE = dict(family="qwen3_moe", seed=0, docs=8000, steps=400, batch=16, seq_len=64,
              lr=3e-3, warmup=30, weight_decay=0.01, threads=1, max_shard_size="128KB",
              dtype="bfloat16")  # saved as real checkpoints ship (convert's bf16 is then lossless)


def golden_words() -> set[str]:
    """Words of the golden suite's reverse tasks (kept out of pre-training)."""

    words = set()
    for name in ("reverse_heldout.jsonl", "reverse_format.jsonl"):
        for line in (GOLDEN_SUITE.parent / "golden" / name).read_text().splitlines():
            if line.strip():
                words.add(json.loads(line)["prompt"].split(":")[1].split("\n")[0].strip())
    return words


def golden_prompts() -> list[str]:
    """Every prompt/context/text of the shipped golden suite's text tasks."""

    out = []
    for task in load_suite().tasks:
        for rec in task.records:
            text = rec.get("prompt", "") + rec.get("completion", "") if "completion" in rec \
                else rec.get("prompt") or rec.get("context")
            if text:
                out.append(text)
    return out


def heldout_docs() -> list[str]:
    """Held-out documents of the demo language (the golden `demo_text` task)."""
    return language_docs(64, HELDOUT_SEED, exclude=heldout_words() | golden_words())


def _token_blocks(tokenizer, docs: list[str], seq_len: int):
    """Documents packed into one stream (EOS between them), cut into [N, seq_len + 1]."""
    # lazy: torch: heavy, loaded only when this runs
    import torch

    stream: list[int] = []
    for doc in docs:
        stream += [tokenizer.eos_token_id] + tokenizer(doc, add_special_tokens=False).input_ids
    n = (len(stream) - 1) // seq_len
    flat = torch.tensor(stream[:n * seq_len + 1])
    return torch.stack([flat[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


def pretrain(model, blocks, recipe: dict, log=print) -> list[float]:
    """AdamW with linear warmup and cosine decay on random blocks; returns the losses."""

    # lazy: torch: heavy, loaded only when this runs
    import torch

    gen = torch.Generator().manual_seed(recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"],
                            weight_decay=recipe["weight_decay"])
    steps, warm = recipe["steps"], recipe["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    losses = []
    for step in range(steps):
        batch = blocks[torch.randint(len(blocks), (recipe["batch"],), generator=gen)]  # [B, T+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step:5d}  loss {loss.item():.3f}", flush=True)
    return losses


def build(out_dir: str | Path, recipe: dict | None = None, log=print) -> dict:
    """Pre-train the demo base and write it to `out_dir` (temp dir, then rename).

    Returns:
        The report written as `demo_base.json` (recipe + measured numbers).
    """
    # lazy: torch, transformers: heavy, loaded only when this runs
    import torch
    import transformers


    recipe = dict(RECIPE, **(recipe or {}))
    torch.set_num_threads(recipe["threads"])  # CPU reductions depend on the thread count
    torch.manual_seed(recipe["seed"])
    random.seed(recipe["seed"])
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        init = build_debug_model(recipe["family"], tmp / "init", seed=recipe["seed"],
                                 dtype="float32")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(init))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(init),
                                                                  dtype=torch.float32)
        docs = language_docs(recipe["docs"], recipe["seed"],
                             exclude=heldout_words() | golden_words())
        blocks = _token_blocks(tokenizer, docs, recipe["seq_len"])
        start = time.monotonic()
        losses = pretrain(model, blocks, recipe, log)
        report = {"recipe": recipe, "train_seconds": round(time.monotonic() - start, 1),
                  "train_tokens": recipe["steps"] * recipe["batch"] * recipe["seq_len"],
                  "final_loss": sum(losses[-50:]) / len(losses[-50:])}
        report = save(model, tokenizer, tmp / "final", recipe, report)
        final = tmp / "final"
        if out_dir.exists():
            shutil.rmtree(out_dir)
        final.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def save(model, tokenizer, out: Path, recipe: dict, report: dict) -> dict:
    """Save the trained model in `recipe["dtype"]` (sharded) + tokenizer, measure it, and
    write `demo_base.json` (report + held-out perplexity + expert load).

    Returns:
        The report as written.
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch


    model = model.eval().to(getattr(torch, recipe["dtype"]))
    model.save_pretrained(str(out), max_shard_size=recipe["max_shard_size"])
    tokenizer.save_pretrained(str(out))
    probe = probe_model(out, heldout_docs(), golden_prompts())
    report = dict(report, **{k: probe[k] for k in ("heldout_ppl", "uniform_ppl", "ppl_ratio",
                                                   "expert_load", "load_max_over_mean",
                                                   "max_load_skew")})
    (out / "demo_base.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ASSET
    report = build(out)
    print(f"wrote {out}: held-out ppl {report['heldout_ppl']:.2f} "
          f"({report['ppl_ratio']:.3f} of uniform {report['uniform_ppl']:.0f}), "
          f"max/mean expert load {report['max_load_skew']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
