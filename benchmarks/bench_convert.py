"""Benchmark: `moeflow convert` against `cp -r` and a transformers round trip.

    .venv/bin/python benchmarks/bench_convert.py --gb 2 --workdir /tmp/mfbench

Writes a synthetic Qwen3-MoE checkpoint of about `--gb` GB (real on-disk
layout: per-expert tensors, sharded safetensors + index), then measures in
separate processes, each with its own peak RSS (ru_maxrss from wait4):

- `cp -r` of the checkpoint directory (the I/O floor),
- moeflow convert (in-process, --workers 1, no verification),
- transformers `from_pretrained` + `save_pretrained` (what a user would do),

and converts a checkpoint twice as large to show that peak RSS does not grow
with the checkpoint. Ratios are printed against the baselines measured in the
same run. Everything is deleted at the end (unless --keep).

Targets (issue 3): convert >= 0.5x the speed of cp, faster than the
transformers round trip, peak RSS < 25% of the checkpoint, flat when doubled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
HIDDEN, EXPERTS, MOE_I, HEADS, KV, HEAD_DIM, VOCAB = 1024, 64, 512, 16, 4, 64, 32000


def layer_bytes() -> int:
    experts = EXPERTS * 3 * MOE_I * HIDDEN
    attn = 2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * KV * HEAD_DIM
    return 2 * (experts + attn + EXPERTS * HIDDEN)


def write_checkpoint(out: Path, gb: float, seed: int = 0) -> Path:
    """A Qwen3-MoE checkpoint of about `gb` GB, one shard per layer (+ embeddings)."""
    from safetensors.torch import save_file

    layers = max(1, round(gb * 1e9 / layer_bytes()))
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
             p + "self_attn.k_proj.weight": rand(KV * HEAD_DIM, HIDDEN),
             p + "self_attn.v_proj.weight": rand(KV * HEAD_DIM, HIDDEN),
             p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
             p + "self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
             p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
             p + "mlp.gate.weight": rand(EXPERTS, HIDDEN)}
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = rand(MOE_I, HIDDEN)
            t[q + "up_proj.weight"] = rand(MOE_I, HIDDEN)
            t[q + "down_proj.weight"] = rand(HIDDEN, MOE_I)
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, name))
    name = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    t = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
         "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    save_file(t, str(out / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(t, name))
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=VOCAB,
                  hidden_size=HIDDEN, intermediate_size=2048, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                  moe_intermediate_size=MOE_I, num_experts=EXPERTS, num_experts_per_tok=8,
                  decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# Runs the command from a small process and prints its peak RSS: Linux carries a
# forked child's pre-exec high-water mark (this script's own RSS) into ru_maxrss,
# so the fork must happen in a process without torch and tensors loaded.
LAUNCH = ("import os, subprocess, sys, time; t = time.perf_counter(); "
          "p = subprocess.Popen(sys.argv[1:]); _, st, ru = os.wait4(p.pid, 0); "
          "print('MEASURE', os.waitstatus_to_exitcode(st), time.perf_counter() - t, ru.ru_maxrss)")


def measure(cmd: list[str]) -> tuple[float, float, float | None]:
    """Run `cmd`; return (wall seconds, peak RSS in GB, in-process work seconds if printed)."""
    out = subprocess.run([sys.executable, "-S", "-c", LAUNCH, *cmd], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = out.stdout.splitlines()
    _, code, wall, rss_kb = next(x for x in lines if x.startswith("MEASURE")).split()
    if int(code) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    work = next((float(x.split()[1]) for x in lines if x.startswith("WORK")), None)
    return float(wall), int(rss_kb) * 1024 / 1e9, work


def alternate(repeats: int, cp_cmd: list[str], conv_cmd: list[str], work: Path) -> dict:
    """cp and convert run alternately `repeats` times (the host is shared and noisy,
    so neighbouring runs see similar load); median of the per-pair speed ratios."""
    import statistics

    wall, work_r = [], []
    for _ in range(repeats):
        cp = measure(cp_cmd)
        shutil.rmtree(work / "cp", ignore_errors=True)
        conv = measure(conv_cmd)
        shutil.rmtree(work / "conv", ignore_errors=True)
        wall.append(cp[0] / conv[0])
        work_r.append(cp[0] / conv[2])
    return {"wall": statistics.median(wall), "work": statistics.median(work_r),
            "pairs": [f"{a:.2f}/{b:.2f}" for a, b in zip(wall, work_r)]}


def best_of(repeats: int, cmd: list[str], cleanup: Path | None) -> tuple[float, float, float | None]:
    """Fastest of `repeats` runs (this host is shared and noisy), max peak RSS."""
    runs = []
    for _ in range(repeats):
        runs.append(measure(cmd))
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
    best = min(runs, key=lambda r: r[0])
    return best[0], max(r[1] for r in runs), best[2]


# The model class import (~3 s here: modeling_utils, generation, ...) is a fixed
# per-process cost, done before the work timer; `wall` still includes it.
CONVERT = ("import sys, time, transformers; from moeflow.checkpoint.convert import convert_checkpoint; "
           "transformers.Qwen3MoeForCausalLM; t = time.perf_counter(); "
           "convert_checkpoint(sys.argv[1], sys.argv[2], verify=False, workers=1); "
           "print('WORK', time.perf_counter() - t)")
HF = ("import sys, time, torch, transformers; t = time.perf_counter(); "
      "m = transformers.Qwen3MoeForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16); "
      "m.save_pretrained(sys.argv[2]); print('WORK', time.perf_counter() - t)")
IMPORTS = "import torch, transformers, moeflow.checkpoint.convert"


def size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e9


def warm(path: Path) -> None:
    """Read every shard once so all methods start from the page cache."""
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def run(gb: float, work: Path, repeats: int) -> dict:
    py = sys.executable
    src = write_checkpoint(work / "src", gb)
    size = size_gb(src)
    print(f"synthetic Qwen3-MoE checkpoint: {size:.2f} GB in {work / 'src'}", flush=True)
    rows = {"python imports (idle)": measure([py, "-c", IMPORTS])}
    warm(src)
    rows["cp -r"] = best_of(repeats, ["cp", "-r", str(src), str(work / "cp")], work / "cp")
    rows["moeflow convert"] = best_of(repeats, [py, "-c", CONVERT, str(src), str(work / "conv")],
                                      work / "conv")
    rows["transformers load+save"] = best_of(1, [py, "-c", HF, str(src), str(work / "hf")], work / "hf")
    median = alternate(max(3, repeats), ["cp", "-r", str(src), str(work / "cp")],
                       [py, "-c", CONVERT, str(src), str(work / "conv")], work)
    shutil.rmtree(src)
    src2 = write_checkpoint(work / "src2", 2 * gb, seed=1)
    size2 = size_gb(src2)
    warm(src2)
    rows["cp -r (2x)"] = best_of(repeats, ["cp", "-r", str(src2), str(work / "cp2")], work / "cp2")
    rows["moeflow convert (2x)"] = best_of(repeats, [py, "-c", CONVERT, str(src2), str(work / "conv2")],
                                           work / "conv2")
    shutil.rmtree(src2)
    return {"size_gb": size, "size2_gb": size2, "rows": rows, "median": median}


def report(res: dict) -> None:
    rows, size, size2 = res["rows"], res["size_gb"], res["size2_gb"]
    idle = rows.pop("python imports (idle)")[1]
    print(f"\n{'method':24s} {'GB':>5s} {'wall s':>7s} {'work s':>7s} {'GB/s':>6s} "
          f"{'peak RSS GB':>11s} {'RSS/ckpt':>8s}")
    for name, (wall, rss, work) in rows.items():
        gb = size2 if "2x" in name else size
        w = f"{work:7.2f}" if work is not None else f"{'-':>7s}"
        print(f"{name:24s} {gb:5.2f} {wall:7.2f} {w} {gb / wall:6.3f} {rss:11.3f} {rss / gb:8.1%}")
    cp, conv, hf = rows["cp -r"], rows["moeflow convert"], rows["transformers load+save"]
    cp2, conv2 = rows["cp -r (2x)"], rows["moeflow convert (2x)"]
    print(f"\nwall = whole process incl. interpreter + imports; work = the conversion call (after imports)")
    print(f"idle python with torch+transformers imported: peak RSS {idle:.3f} GB")
    print(f"convert speed vs cp -r (wall / work):   {cp[0] / conv[0]:.2f}x / {cp[0] / conv[2]:.2f}x"
          "   (target >= 0.5)")
    med = res["median"]
    print(f"  median of alternating pairs:          {med['wall']:.2f}x / {med['work']:.2f}x"
          f"   (pairs wall/work: {', '.join(med['pairs'])})")
    print(f"  same at 2x size:                      {cp2[0] / conv2[0]:.2f}x / {cp2[0] / conv2[2]:.2f}x")
    print(f"convert speed vs transformers (wall):   {hf[0] / conv[0]:.2f}x   (target > 1)")
    print(f"convert peak RSS / checkpoint:          {conv[1] / size:.1%}   (target < 25%)")
    print(f"convert peak RSS 2x / 1x:               {conv2[1] / conv[1]:.2f}   (target ~1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size (the 2x run doubles it)")
    parser.add_argument("--workdir", default="/tmp/mfbench")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--repeats", type=int, default=2, help="runs per method (fastest kept)")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        report(run(args.gb, work, args.repeats))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
