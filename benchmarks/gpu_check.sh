#!/usr/bin/env bash
# GPU check (<= 5 minutes on one GPU): every stage on the GPU, served outputs equal to
# transformers `generate` there, tokens/s, and the OpenAI contract suite on each backend.
#
#   benchmarks/gpu_check.sh                 # from the repo root, venv in .venv
#   OUT=/tmp/gpu-check benchmarks/gpu_check.sh
#
# 1. device resolution as the stages see it (cuda, bf16, NCCL);
# 2. the demo pipeline planned on a 1-GPU hardware spec of this machine: finetune on a
#    GPU worker (NCCL), regress shards and the deploy replica each ask Ray for a GPU;
# 3. the local backend on a GPU replica (bf16): greedy completions == generate, tokens/s;
# 4. the engine against `generate` in-process on the GPU (benchmarks/gpu_engine_check.py: same
#    tokens, the decode mask, expert counts; benchmarks/bench_engine.py: ratios);
# 5. `make setup-vllm` (vLLM's CUDA build in .venv-vllm), then tests/contract against local
#    and vllm, the vllm deploy of a merged adapter against the local engine, and vLLM's
#    adapter check;
# 6. an unmerged expert-LoRA adapter through the vllm backend (its per-expert export, loaded
#    by Ray Serve LLM from an S3-compatible server on 127.0.0.1) against the local engine
#    serving the fused adapter: greedy completions equal (benchmarks/gpu_vllm_lora.py).
# tests/test_gpu_check_script.py checks what of this a CPU host can: the syntax, the Python
# it calls importing and parsing its arguments, and step 6's --dry-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/moeflow-gpu-check.XXXX)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD MOEFLOW_RAY_TEMP_DIR=${MOEFLOW_RAY_TEMP_DIR:-$(mktemp -d /tmp/mfr.XXXX)}
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$OUT/mlflow.db}
t0=$(date +%s)
step() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

step "devices"
$PY -c "import json; from moeflow.core.devices import describe; d = describe(); print(json.dumps(d)); \
assert d['device'].startswith('cuda') and d['backend'] == 'nccl', d" | tee "$OUT/devices.json"

step "demo pipeline on the GPU"
$PY benchmarks/gpu_check.py hardware --out "$OUT/gpu-local-1.yaml"
# `hardware=PATH`, not `hardware.spec=PATH`: configs/demo.yaml sets `hardware: cpu-local` (a
# string), which --set cannot descend into. regress.shards=2: the shards are Ray tasks asking
# for a GPU each (the demo's 1 evaluates on the regress stage's own GPU; this covers the shards).
# 420 s, not 240: on 2 CPU cores the demo takes ~6 min with this spec (serving stage 144 s,
# finetune 92 s); a timeout that kills it wastes the GPU session.
timeout 420 $PY -m workflows.cli demo --workdir "$OUT/demo-work" \
  --set hardware="$OUT/gpu-local-1.yaml" --set finetune.use_gpu=true --set regress.shards=2 \
  2>&1 | tee "$OUT/demo.log"

step "served greedy == generate on the GPU; tokens/s"
$PY benchmarks/gpu_check.py serve --model "$OUT/demo-work/model" --json "$OUT/serve.json"

step "engine == generate on the GPU, the checked decode mask, expert load counted on the device"
$PY benchmarks/gpu_engine_check.py --device cuda 2>&1 | tee "$OUT/engine-check.txt"

step "engine vs generate on the GPU (in-process ratios)"
$PY benchmarks/bench_engine.py --device cuda --no-http --model "$OUT/demo-work/model" 2>&1 | tail -4 | tee "$OUT/engine.txt"

step "vLLM environment (make setup-vllm: the CUDA build where nvidia-smi finds a GPU)"
timeout 900 make setup-vllm 2>&1 | tail -5 | tee "$OUT/setup-vllm.log"

step "OpenAI contract suite (local, vllm); the vllm deploy of a merged adapter == the local engine"
$PY -m pytest tests/contract tests/test_vllm_serve.py tests/test_adapter_check.py tests/test_vllm_layout.py -q -rs -p no:cacheprovider \
  2>&1 | tee "$OUT/contract.log"

step "an unmerged expert-LoRA adapter through the vllm backend == the local engine"
timeout 1200 $PY benchmarks/gpu_vllm_lora.py --out "$OUT/vllm-lora" 2>&1 | tail -5 | tee "$OUT/vllm-lora.txt"

step "done: results under $OUT"
