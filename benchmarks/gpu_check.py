"""GPU checks of the local serving path (run by benchmarks/gpu_check.sh on a machine with a GPU).

    .venv/bin/python benchmarks/gpu_check.py hardware --out gpu-1.yaml   # a 1-GPU hardware spec
    .venv/bin/python benchmarks/gpu_check.py serve --model demo-work/model [--json out.json]
    .venv/bin/python benchmarks/gpu_check.py serve --device cpu --model assets/demo-base  # dry run, no GPU

`hardware` writes a planner spec for this machine's first GPU (its memory from
CUDA; throughput figures are nominal), so the demo plans one GPU worker.
`serve` starts the local backend on Ray Serve with one GPU per replica and the
default dtype (bf16 on GPU), then checks:
  1. the replica's model sits on the GPU (free GPU memory drops by at least its weights);
  2. greedy completions equal transformers `generate` on the same GPU in the same dtype,
     prompt by prompt;
  3. tokens/s: 16 concurrent streamed completions through HTTP vs `generate` of the same
     16 prompts as one static batch, printed as a ratio measured in this run.
Exit status 1 when an output differs or the model is not on the GPU.
`--device cpu` runs the same script on CPU (float32, a replica without a GPU, no memory
check): a smoke test of the script itself on a machine without one.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = [f"reverse: {w}\nanswer:" for w in ("abc", "kqzm", "hello", "moe", "gpu", "ray", "vllm", "lora",
                                               "token", "expert", "route", "plan", "serve", "check",
                                               "nccl", "bf16")]
NEW = 32


def hardware(out: Path) -> None:
    """Write a 1-node x 1-GPU hardware spec of this machine (memory from CUDA)."""
    import torch
    import yaml

    props = torch.cuda.get_device_properties(0)
    spec = {"name": "gpu-local-1", "accelerator": props.name, "devices_per_node": 1, "nodes": 1,
            "memory_per_device_gb": round(props.total_memory / 1e9, 1), "hbm_bandwidth_gbs": 3000,
            "bf16_tflops": 900, "fp8_tflops": 1800, "intra_node_bandwidth_gbs": 450,
            "inter_node_bandwidth_gbs": 50, "runtime_overhead_gb": 3}
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    print(f"wrote {out}: {props.name}, {spec['memory_per_device_gb']} GB")


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reference(model_dir: str, tok, device: str = "cuda") -> tuple[dict, float, str]:
    """Greedy `generate` per prompt and the static-batch tokens/s, on `device` in the dtype
    the replica serves in (auto: bf16 on the GPU)."""
    import torch

    from moeflow.core.devices import resolve_dtype
    from moeflow.model.models import load_model

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    dtype = resolve_dtype("auto", dev)
    model = load_model(model_dir, dtype).to(dev).eval()
    refs = {}
    for p in PROMPTS:
        ids = torch.tensor([tok(p).input_ids], device=dev)
        gen = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        refs[p] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True).to(dev)
    model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    gen = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    _sync(dev)
    tps = len(PROMPTS) * NEW / (time.perf_counter() - t0)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return refs, tps, str(dtype).replace("torch.", "")


def serve_check(model_dir: str, json_out: str | None, device: str = "cuda") -> int:
    import openai
    import ray
    import torch
    from ray import serve
    from transformers import AutoTokenizer

    from moeflow.serving.app import ServeSettings, free_port, start

    tok = AutoTokenizer.from_pretrained(model_dir)
    gpu = device == "cuda"
    refs, gen_tps, dtype = _reference(model_dir, tok, device)
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    free_before = torch.cuda.mem_get_info(0)[0] if gpu else 0
    ray.init(include_dashboard=False, num_cpus=4, _temp_dir=os.environ.get("MOEFLOW_RAY_TEMP_DIR"))
    try:
        url = start(ServeSettings(base_dir=model_dir), port=free_port(), num_gpus=1 if gpu else 0)
        # the replica's context + weights (None on CPU: nothing to measure)
        on_gpu = free_before - torch.cuda.mem_get_info(0)[0] if gpu else None
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        diffs = []
        for p in PROMPTS:
            got = client.completions.create(model=name, prompt=p, max_tokens=NEW, temperature=0).choices[0].text
            if got != refs[p]:
                diffs.append({"prompt": p, "served": got, "generate": refs[p]})

        def stream(p: str) -> None:  # ignore_eos: exactly NEW tokens each
            for _ in client.completions.create(model=name, prompt=p, max_tokens=NEW, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                pass

        stream(PROMPTS[0])  # warm-up
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            list(pool.map(stream, PROMPTS))
        served_tps = len(PROMPTS) * NEW / (time.perf_counter() - t0)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"dtype": dtype, "prompts": len(PROMPTS), "mismatches": diffs,
              "generate_static_batch_tok_s": round(gen_tps, 1),
              "served_16_streams_tok_s": round(served_tps, 1),
              "ratio_served_vs_generate": round(served_tps / gen_tps, 3),
              "device": device, "replica_gpu_bytes": on_gpu, "weights_bytes": weights,
              "replica_on_gpu": on_gpu >= weights / 2 if gpu else None}
    print(json.dumps(result, indent=2))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return 1 if diffs or (gpu and not result["replica_on_gpu"]) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("hardware", "serve"))
    ap.add_argument("--out", default="gpu-local-1.yaml")
    ap.add_argument("--model", default="demo-work/model")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="serve: cpu is a dry run of this script without a GPU")
    args = ap.parse_args()
    import torch

    if (args.what == "hardware" or args.device == "cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device")
    if args.what == "hardware":
        hardware(Path(args.out))
    else:
        sys.exit(serve_check(args.model, args.json, args.device))


if __name__ == "__main__":
    main()
