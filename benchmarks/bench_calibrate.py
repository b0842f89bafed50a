"""Benchmark: `moeflow compare` against msprobe, and its peak memory at 4x the checkpoint size.

    .venv/bin/python benchmarks/bench_calibrate.py                  # both parts
    .venv/bin/python benchmarks/bench_calibrate.py --part msprobe   # needs mindstudio-probe
    .venv/bin/python benchmarks/bench_calibrate.py --part memory --workdir /tmp/mfbench

msprobe: a tiny Qwen3-MoE and a copy with layer 1's attention output projection
damaged are each run whole by transformers under msprobe's PrecisionDebugger
(task tensor, level L0: every module's output dumped), then `msprobe compare`
writes its per-module CSV. moeflow compares the same pair on the same input
ids layer by layer; its propagated rows (attention, MoE block, final norm,
logits) must match msprobe's Cosine and MaxAbsErr to 1e-4. msprobe
(`pip install mindstudio-probe==26.2.0`) is not a moeflow dependency: the part
is skipped when it is missing. (msprobe's hooks crash on a compressed-tensors
model, so the pair is bf16 vs damaged bf16.)

memory: two synthetic Qwen3-MoE checkpoints, L and 4L layers (4x the bytes),
each compared against its own fp8 quantisation in a fresh process; peak RSS
(VmHWM) of the 4x run must stay within 1.3x of the 1x run (streaming: a
layer at a time, never a whole model, never both sides at once). Also reports
the RSS after imports, so the model-dependent part is visible.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
IDS = [[5, 17, 33, 2, 9, 41, 7, 8, 100, 61, 3, 12]]

_DUMP = """
import json, sys, torch
from msprobe.pytorch import PrecisionDebugger
from moeflow.model.models import load_model
model_dir, out = sys.argv[1], sys.argv[2]
cfg = {"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": "L0",
       "tensor": {"scope": [], "list": [], "data_mode": ["forward"]}}
json.dump(cfg, open(out + ".json", "w"))
model = load_model(model_dir, torch.float32).eval()
dbg = PrecisionDebugger(config_path=out + ".json")
dbg.start(model)
with torch.no_grad():
    model(input_ids=torch.tensor(%s))
dbg.stop()
dbg.step()
""" % IDS

# VmHWM (this process image's peak RSS, KiB): unlike ru_maxrss it does not inherit the
# parent's peak through fork
_MEMORY = """
import re, sys, torch
from moeflow.quant.compare import compare_checkpoints
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
before = hwm()
ids = [{"input_ids": torch.arange(1, 65)[None] % 500}] * 4
r = compare_checkpoints(sys.argv[1], sys.argv[2], ids)
print(before, hwm(), r["final"]["logits_cosine"])
"""


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _run(code: str, *args) -> str:
    res = subprocess.run([PY, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env=_env(), timeout=3600)
    if res.returncode:
        raise SystemExit(f"subprocess failed:\n{res.stderr[-3000:]}")
    return res.stdout


def msprobe_part(work: Path) -> bool:
    """True when every compared row agrees with msprobe to 1e-4."""
    import torch

    try:
        import msprobe  # noqa: F401
    except ImportError:
        print("msprobe: skipped (pip install mindstudio-probe==26.2.0 to run it)")
        return True
    from moeflow.quant.compare import compare_checkpoints
    from moeflow_testing.tiny import build_debug_model
    from tests.quant_assets import edited, noisy

    base = build_debug_model("qwen3_moe", work / "base", dtype="bfloat16")
    bad = edited(base, work / "bad", "model.layers.1.self_attn.o_proj.weight", noisy())
    for name, model in (("base", base), ("bad", bad)):
        _run(_DUMP, model, work / f"dump-{name}")
    dump = {n: next((work / f"dump-{n}" / "step0").iterdir()) / "dump.json" for n in ("base", "bad")}
    subprocess.run([str(Path(PY).parent / "msprobe"), "compare", "-tp", str(dump["bad"]), "-gp", str(dump["base"]),
                    "-o", str(work / "cmp")], check=True, capture_output=True, env=_env(),
                   cwd=work, timeout=1800)
    rows = list(csv.DictReader(next((work / "cmp").glob("*.csv")).open()))
    theirs = {}
    for row in rows:
        name = row["NPU Name"]
        if name.startswith("Module.") and name.endswith(".forward.0.output.0"):
            module = name[len("Module."):].rsplit(".", 5)[0]  # drop .Class.forward.0.output.0
            theirs[module] = (float(row["Cosine"]), float(row["MaxAbsErr"]))
    ours = compare_checkpoints(base, bad, [{"input_ids": torch.tensor(IDS)}])
    worst, matched = 0.0, 0
    print(f"{'module':32s} {'moeflow cos':>12s} {'msprobe cos':>12s} {'moeflow max':>12s} {'msprobe max':>12s}")
    for row in ours["layers"]:
        key = "lm_head" if row["kind"] == "logits" else row["name"]
        if key not in theirs:
            continue
        cos, mx = row["propagated"]["cosine"], row["propagated"]["max_abs"]
        tcos, tmx = theirs[key]
        worst = max(worst, abs(cos - tcos), abs(mx - tmx))
        matched += 1
        print(f"{key:32s} {cos:12.6f} {tcos:12.6f} {mx:12.6g} {tmx:12.6g}")
    print(f"msprobe: {matched} rows compared, largest difference {worst:.2e} (limit 1e-4); "
          f"first divergent (isolated) {ours['first_divergent']}")
    return matched > 0 and worst <= 1e-4


def memory_part(work: Path, layers: int, hidden: int) -> bool:
    """True when the 4x checkpoint's peak RSS is within 1.3x of the 1x one's."""
    from moeflow.quant.quantize import default_ignore, quantize_checkpoint
    from moeflow.quant.schemes import get_scheme
    from moeflow.quant.source import ModelSource
    from moeflow_testing.tiny import build_debug_model

    peaks = {}
    for mult in (1, 4):
        src = work / f"m{mult}"
        if not src.exists():
            build_debug_model("qwen3_moe", src, dtype="bfloat16", max_shard_size="50MB",
                              num_hidden_layers=layers * mult, hidden_size=hidden,
                              moe_intermediate_size=hidden, num_experts=16, head_dim=64,
                              num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)
        if not (work / f"q{mult}").exists():
            quantize_checkpoint(src, work / f"q{mult}", get_scheme("fp8"),
                                default_ignore(ModelSource(src)))
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        before, peak, cos = _run(_MEMORY, src, work / f"q{mult}").split()
        peaks[mult] = int(peak)
        print(f"{mult}x: {size / 2**20:8.1f} MiB checkpoint, peak RSS {int(peak) / 2**10:8.1f} MiB "
              f"(after imports {int(before) / 2**10:.1f} MiB), logits cosine {float(cos):.5f}")
    ratio = peaks[4] / peaks[1]
    print(f"memory: peak RSS 4x / 1x = {ratio:.3f} (limit 1.3)")
    return ratio <= 1.3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "msprobe", "memory"), default="all")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=2, help="layers of the 1x checkpoint")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (sets the layer bytes)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mfcal-"))
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    if args.part in ("all", "msprobe"):
        ok &= msprobe_part(work / "msprobe")
    if args.part in ("all", "memory"):
        ok &= memory_part(work / "memory", args.layers, args.hidden)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
