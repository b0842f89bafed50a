"""The planner's activation estimate against measured activation memory, TP1 / TP2 / CP2.

    .venv/bin/python benchmarks/bench_activation.py              # ~3-5 min on 2 idle cores
    .venv/bin/python benchmarks/bench_activation.py --seq 1024 --hidden 256

One tiny Qwen3-MoE (fp32, attention LoRA rank 16) and one micro-batch, run as a
single process, at TP=2 and at CP=2 (gloo ranks, moeflow.training.parallel_check).
Measured on rank 0: every tensor autograd saves for backward (unique storages,
weights excluded) plus the logits' gradient, at the moment backward starts
(parallel_check.ActivationMeter), without recompute, one example per row (packed
rows under SDPA add a [S, S] mask per row that the planner does not model: the
flash-attention varlen kernel of a GPU run builds none). Planned:
moeflow.parallel.memory.activation_bytes for the same model, layout and workload
(act_dtype fp32). The ratio planned / measured must stay within 0.8-1.2; the
script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"TP1": {}, "TP2": {"tp": 2}, "CP2": {"cp": 2}}


def planned(model_dir: str, layout: dict, seq: int, rows: int, rank: int) -> float:
    from moeflow.model.params import spec_from_path
    from moeflow.parallel.memory import Plan, Workload, activation_bytes

    spec = spec_from_path(model_dir)
    cp = layout.get("cp", 1)
    plan = Plan(tp=layout.get("tp", 1), cp=cp, dp=cp)
    work = Workload(seq_len=seq, micro_batch=rows, recompute=False, act_dtype="fp32",
                    lora_rank=rank, lora_targets=("attention",))
    return activation_bytes(spec, plan, work, 0, lora_per_layer=4)  # q, k, v, o per layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from moeflow.training import parallel_check as P
    from moeflow_testing.tiny import build_debug_model

    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-act-") as tmp:
        model = str(build_debug_model("qwen3_moe", Path(tmp) / "m", dtype="float32",
                                      hidden_size=a.hidden, num_attention_heads=8,
                                      num_key_value_heads=4, moe_intermediate_size=a.hidden // 2))
        for name, layout in LAYOUTS.items():
            res = P.run(model, **layout, steps=1, accum=1, rows=a.rows, seq=a.seq, rank=a.rank,
                        packed=False)
            measured = res["peaks"][0]
            plan = planned(model, layout, a.seq, a.rows, a.rank)
            out[name] = {"measured_bytes": measured, "planned_bytes": plan,
                         "ratio": plan / measured}
    worst = max(abs(v["ratio"] - 1) for v in out.values())
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{'layout':8} {'measured':>12} {'planned':>12} {'planned/measured':>17}")
        for name, v in out.items():
            print(f"{name:8} {v['measured_bytes'] / 1e6:10.2f}MB {v['planned_bytes'] / 1e6:10.2f}MB "
                  f"{v['ratio']:17.3f}")
    return 0 if worst <= 0.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
