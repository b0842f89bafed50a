"""LoRA over a frozen quantised base (moeflow.model.packed_base) against the same run over the
bf16-dequantised base: loss at step N and peak worker memory, per release format.

    .venv/bin/python benchmarks/bench_lora_packed.py [--steps 3] [--layers 8 --experts 32
        --hidden 1024 --moe-intermediate 768] [--formats mxfp4,int4-group,fp8-channel]
        [--out results.json]

One bf16 Qwen3-MoE debug model is built (sized so that routed experts dominate its
weights, as in every large MoE), then each format's release of it (compressed-tensors'
own compressors: MXFP4, INT4 group-32, FP8 per channel). Each run is its own worker
process (a fresh interpreter, as a Ray Train worker is): load the base, put PEFT LoRA
(r=8) on the attention projections, take N AdamW steps on a fixed batch. Peak memory is
the worker's peak RSS (VmHWM); `model` is that peak less the RSS after importing
torch/transformers/peft (the same in both runs), i.e. what the base and training add.
Targets: loss at step N within 2%; peak ≤ 0.6x of the dequantised run. The dequantised
run's peak is its load; `peak_vs_settled` also compares with its RSS after the last step.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # moeflow_testing: in the checkout, not installed
FORMATS = ("mxfp4", "int4-group", "fp8-channel")


def _rss() -> int:
    """Peak RSS of this process since exec (VmHWM). Not ru_maxrss: Linux carries that over
    exec from the forking parent, so a worker started by a large parent reads the parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _now_rss() -> int:
    """RSS now (VmRSS): after the last step, what the run holds once its load transients are gone."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(release: str, mode: str, steps: int) -> dict:
    """One LoRA run in this process; returns losses and memory."""
    import torch
    from peft import LoraConfig, get_peft_model

    import moeflow.model.packed_base as pb

    base = _rss()
    t0 = time.perf_counter()
    model, held = pb.load_packed(release, packed=(mode == "packed"))
    loaded = _rss()
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
    losses = []
    peft.train()
    for _ in range(steps):
        loss = peft(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"mode": mode, "losses": losses, "peak_rss": _rss(), "end_rss": _now_rss(), "base_rss": base,
            "loaded_rss": loaded, "seconds": time.perf_counter() - t0,
            "packed_bytes": sum(p.nbytes for p in held.values()),
            "decodes": sum(p.decodes for p in held.values())}


def _run_worker(release: Path, mode: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", str(release), "--mode", mode,
                          "--steps", str(steps)], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"worker {mode} {release.name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(root: Path, args) -> Path:
    from moeflow_testing.tiny import build_debug_model

    return build_debug_model("qwen3_moe", root / "bf16", max_shard_size="2GB",
                             num_hidden_layers=args.layers, num_experts=args.experts,
                             hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                             intermediate_size=args.moe_intermediate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--mode", default="packed")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.mode, args.steps)))
        return
    from moeflow_testing.releases import ct_release

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-packed-") as tmp:
        bf16 = build(Path(tmp), args)
        for fmt in args.formats.split(","):
            release = ct_release(bf16, Path(tmp) / fmt, fmt)
            packed = _run_worker(release, "packed", args.steps)
            plain = _run_worker(release, "dequantised", args.steps)
            rows.append(_row(fmt, packed, plain))
            print(_line(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


def _row(fmt: str, packed: dict, plain: dict) -> dict:
    a, b = packed["losses"][-1], plain["losses"][-1]
    model = lambda r: max(1, r["peak_rss"] - r["base_rss"])  # noqa: E731 - what the run adds
    return {"format": fmt, "loss_packed": a, "loss_dequantised": b, "loss_rel_diff": abs(a - b) / b,
            "peak_packed_mb": packed["peak_rss"] / 1e6, "peak_dequantised_mb": plain["peak_rss"] / 1e6,
            "peak_ratio": packed["peak_rss"] / plain["peak_rss"],
            "model_ratio": model(packed) / model(plain),
            # the dequantised run's peak is its load (every group decoded in fp32, then cast);
            # against what it holds after the last step the packed peak must be <= 0.6x too
            "end_dequantised_mb": plain["end_rss"] / 1e6,
            "peak_vs_settled": packed["peak_rss"] / plain["end_rss"],
            "import_rss_mb": packed["base_rss"] / 1e6, "packed_experts_mb": packed["packed_bytes"] / 1e6,
            "seconds_packed": packed["seconds"], "seconds_dequantised": plain["seconds"]}


def _line(r: dict) -> str:
    return (f"{r['format']:<12} loss {r['loss_packed']:.5f} vs {r['loss_dequantised']:.5f} "
            f"({100 * r['loss_rel_diff']:.3f}%)  peak RSS {r['peak_packed_mb']:.0f} / "
            f"{r['peak_dequantised_mb']:.0f} MB = {r['peak_ratio']:.2f}x  (above imports "
            f"{r['model_ratio']:.2f}x; imports {r['import_rss_mb']:.0f} MB; vs the dequantised "
            f"run's RSS after its last step {r['peak_vs_settled']:.2f}x)  "
            f"time {r['seconds_packed']:.0f} / {r['seconds_dequantised']:.0f} s")


if __name__ == "__main__":
    main()
