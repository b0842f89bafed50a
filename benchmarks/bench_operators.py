"""The operators stage's claims, each as a ratio measured in this run.

    .venv/bin/python benchmarks/bench_operators.py                       # all parts
    .venv/bin/python benchmarks/bench_operators.py --parts eplb --deepseek-eplb /path/to/eplb.py
    .venv/bin/python benchmarks/bench_operators.py --parts experts --tokens 512

1. eplb: a DeepSeek-V3-shaped harsh load (58 MoE layers x 256 experts, Zipf
   exponent 0.6-1.1 per layer, hot experts at random ids), EP 32 with 32
   redundant experts: mean balancedness (mean/max tokens per rank) of
   moeflow's placement, hierarchical (4 nodes, 8 groups) and global (1 node),
   and its time on one core. With --deepseek-eplb (a local copy of DeepSeek's
   eplb.py, e.g. from github.com/deepseek-ai/EPLB; not shipped here) the same
   load goes through DeepSeek's algorithm in the same run and the ratio is printed.
2. experts: one Qwen3-30B-A3B-shaped MoE block (hidden 2048, expert
   intermediate 768, 128 experts, top-8), forward and forward+backward with
   LoRA on the experts, per experts implementation; ratio of the chosen one to eager.
3. permutation: a tiny Qwen3-MoE with skewed routers, loaded at EP 2 over gloo
   with transformers' DistributedConfig: routed (token, expert) pairs per rank
   on the golden-suite prompts before vs after the expert permutation.
4. dispatch: one layer's tokens of the same block moved by all-to-all vs
   all-gather over 2 gloo ranks (bytes and seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_30B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128)


def zipf_load(layers=58, experts=256, seed=0, tokens=65536) -> np.ndarray:
    """[layers, experts] token counts: per layer a Zipf law (exponent 0.6-1.1) over a
    random order of the experts, sampled for `tokens` x 8 routes."""
    rng = np.random.default_rng(seed)
    out = np.empty((layers, experts))
    for layer in range(layers):
        p = 1.0 / np.arange(1, experts + 1) ** rng.uniform(0.6, 1.1)
        p = p[rng.permutation(experts)]
        out[layer] = rng.multinomial(tokens * 8, p / p.sum())
    return out


def bench_eplb(deepseek: str | None) -> dict:
    import torch

    from moeflow.operators import eplb as E

    torch.set_num_threads(1)
    w = zipf_load()
    ep, phys = 32, 256 + 32
    res = {"load": "58x256 Zipf 0.6-1.1, EP 32, 32 redundant",
           "before": round(float(E.balancedness(E.rank_load_contiguous(w, ep)).mean()), 4)}
    ds = None
    if deepseek:
        spec = importlib.util.spec_from_file_location("deepseek_eplb", deepseek)
        ds = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ds)
    for mode, groups, nodes in (("hierarchical", 8, 4), ("global", 8, 1)):
        start = time.process_time()
        p2l, _, cnt = E.rebalance_experts(w, phys, groups, nodes, ep)
        row = {"moeflow": round(float(E.balancedness(E.rank_load_placed(w, p2l, cnt, ep)).mean()), 4),
               "moeflow_cpu_s": round(time.process_time() - start, 3)}
        if ds is not None:
            start = time.process_time()
            a, _, c = ds.rebalance_experts(torch.tensor(w), phys, groups, nodes, ep)
            row["deepseek"] = round(float(E.balancedness(E.rank_load_placed(w, a.numpy(), c.numpy(), ep)).mean()), 4)
            row["deepseek_cpu_s"] = round(time.process_time() - start, 3)
            row["ratio"] = round(row["moeflow"] / row["deepseek"], 4)
        res[mode] = row
    return res


def bench_experts(tokens: int, dtype: str, reps: int) -> dict:
    from moeflow.operators.opbench import bench_block
    from moeflow_testing.tiny import debug_config

    res = bench_block(debug_config("qwen3_moe", **QWEN3_30B), tokens=tokens, dtype=dtype, lora_rank=16,
                      reps=reps, max_block_gb=6.0)
    rows = {r["implementation"]: r for r in res["rows"]}
    eager = rows["eager"]
    for key, mode in (("training", "train_s"), ("serving", "forward_s")):
        chosen = rows[res["chosen"][key]]
        res[f"{key}_speedup_vs_eager"] = round(eager[mode] / chosen[mode], 2)
    return res


def bench_permutation(work: Path) -> dict:
    from moeflow.operators.dist import ep_rank_load
    from moeflow.operators.placement import apply_permutation, plan_permutation
    from moeflow.operators.profile import calibration_texts, profile_local
    from tests.operators_assets import skewed_checkpoint

    model = skewed_checkpoint("qwen3_moe", work)
    texts, source = calibration_texts(None)
    load = profile_local(str(model), texts)
    plan = plan_permutation(np.asarray(load["counts"]), ep=2)
    placed = apply_permutation(model, work / "placed", load["routers"], plan["perms"], {"ep": 2})
    return {"calibration": source, "texts": len(texts),
            "predicted_balancedness": {"before": plan["before"], "after": plan["after"]},
            "before": ep_rank_load(str(model), texts, 2), "after": ep_rank_load(placed["model_path"], texts, 2)}


def bench_dispatch(tokens: int, dtype: str) -> dict:
    from moeflow.operators.dist import dispatch_bench

    res = dispatch_bench(tokens, QWEN3_30B["hidden_size"], QWEN3_30B["num_experts"],
                         QWEN3_30B["num_experts_per_tok"], dtype)
    res["bytes_ratio_gather_over_a2a"] = round(res["all_gather"]["bytes"] / res["all_to_all"]["bytes"], 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="eplb,experts,permutation,dispatch")
    ap.add_argument("--deepseek-eplb", help="path to DeepSeek's eplb.py to compare against (not shipped)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per timed MoE block")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", help="also write the results here (JSON)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    results: dict = {}
    if "eplb" in parts:
        results["eplb"] = bench_eplb(args.deepseek_eplb)
        print(json.dumps({"eplb": results["eplb"]}, indent=1), flush=True)
    if "experts" in parts:
        results["experts"] = bench_experts(args.tokens, args.dtype, args.reps)
        print(json.dumps({"experts": results["experts"]}, indent=1), flush=True)
    if "permutation" in parts:
        with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
            results["permutation"] = bench_permutation(Path(tmp))
        print(json.dumps({"permutation": results["permutation"]}, indent=1), flush=True)
    if "dispatch" in parts:
        results["dispatch"] = bench_dispatch(args.tokens, args.dtype)
        print(json.dumps({"dispatch": results["dispatch"]}, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
