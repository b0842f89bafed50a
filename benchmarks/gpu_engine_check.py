"""The engine on a GPU against `generate` there (benchmarks/gpu_check.sh runs it; any device works).

    .venv/bin/python benchmarks/gpu_engine_check.py [--device cuda]

For a tiny Qwen3-MoE in float32 and bfloat16: prompts of mixed lengths served together
(padded decode steps) give the tokens `generate` gives one prompt at a time; reports whether
decode steps took the ready 4-D mask (the runner's one-time check, moeflow/serving/runner.py)
and whether the expert load counted once per step on the device equals the tokens forwarded.
Exit 1 when the fp32 tokens or any count differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEW = 6


def check(device: str, dtype: torch.dtype) -> bool:
    from moeflow.serving.engine import Engine, EngineConfig, SamplingParams
    from moeflow.serving.metrics import ExpertLoad
    from moeflow_testing.serving import MIXED_PROMPTS as PROMPTS
    from moeflow_testing.serving import IdTokenizer
    from moeflow_testing.tiny_auto import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval().to(device, dtype)
    refs = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    experts = ExpertLoad(model, window_steps=1000)
    engine = Engine(model, IdTokenizer(), EngineConfig(max_num_batched_tokens=512), experts=experts)
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        engine.submit(str(i), p, SamplingParams(max_tokens=NEW, ignore_eos=True),
                      lambda d, row=got[i]: row.extend(d.token_ids))
    t0 = time.perf_counter()
    engine.run_until_idle()
    took = time.perf_counter() - t0
    rows = [got[i] for i in range(len(PROMPTS))]
    forwarded = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NEW - 1)  # the last token is not forwarded
    expected = forwarded * model.config.num_experts_per_tok
    counted = experts.total.sum(-1).tolist()
    equal = sum(a == b for a, b in zip(rows, refs))
    print(f"{dtype}: engine == generate {equal}/{len(refs)} rows; decode mask 4-D: {engine.core.runner.mask4d}; "
          f"expert load per layer {counted} (expected {expected} each); {took:.3f} s", flush=True)
    return (equal == len(refs) or dtype != torch.float32) and all(c == expected for c in counted)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    ok = [check(args.device, dtype) for dtype in (torch.float32, torch.bfloat16)]
    sys.exit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
