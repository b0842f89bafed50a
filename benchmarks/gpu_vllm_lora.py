"""An unmerged expert-LoRA adapter served through the vllm backend, against the local engine
(benchmarks/gpu_check.sh runs it on a machine with a GPU and `make setup-vllm` done).

    .venv/bin/python benchmarks/gpu_vllm_lora.py [--out DIR]            # GPU: serve and compare
    .venv/bin/python benchmarks/gpu_vllm_lora.py --dry-run [--out DIR]  # any host: all but serving

1. a tiny Qwen3-MoE (head_dim 32, float32) and a random PEFT adapter on its attention and its
   fused experts (target_parameters: what moeflow's finetune trains);
2. the vllm backend's Serve config for it with the adapter served as LoRA (not merged): its
   per-expert export (moeflow.training.adapter_layout), checked by vLLM's own LoRA loading
   (moeflow/serving/vllm_lora_check.py), uploaded to an S3-compatible server on 127.0.0.1
   (moto, tests/s3server.py) under deploy.lora_uri, where Ray Serve LLM loads LoRA from;
3. (not with --dry-run) the app started on Ray (its replicas in .venv-vllm, one GPU each),
   greedy completions of the base and of `<base>:a1` over HTTP, then moeflow's local engine
   serving the same base with the fused adapter unmerged; every completion must be equal, and
   the adapter's must differ from the base's (else the adapter did nothing on either side).
Exit status 1 when a completion differs; the JSON summary goes to --out/vllm_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
PROMPTS = ["reverse: abc\nanswer:", "hello world", "kqzm zz", "the experts route"]
NEW = 16
LORA_PREFIX = "s3://moeflow/adapters"  # tests/s3server.py's bucket


def build(root: Path) -> tuple[Path, Path]:
    from moeflow_testing.serving import make_lora_adapter
    from moeflow_testing.tiny import build_debug_model

    base = build_debug_model("qwen3_moe", root / "tiny-moe", head_dim=32, dtype="float32")
    return Path(base), make_lora_adapter(base, root / "a1", seed=5, scale=1.0, experts=True)


def built_config(base: Path, adapter: Path, root: Path, device: str) -> dict:
    """The vllm backend's deployment of base + adapter a1, the adapter as LoRA."""
    from moeflow.core.config import validate
    from moeflow.parallel.vllm_plan import single_device_plan
    from moeflow.serving import vllm_backend as V
    from moeflow.serving.adapter_check import check_adapters
    from moeflow.serving.deployment import decide

    cfg = validate({"model": {"path": str(base), "dtype": "float32"},
                    "deploy": {"backend": "vllm", "dtype": "float32", "max_model_len": 256, "host": "127.0.0.1",
                               "port": 0, "adapters": {"a1": str(adapter)}, "lora_uri": LORA_PREFIX}})
    found = check_adapters(base, {"a1": str(adapter)}, "vllm")  # vLLM's own loading, the export
    built = V.build_run(cfg, decide(cfg, {}), {"vllm": single_device_plan()}, root / "deploy", device=device)
    (a1,) = built["adapters"]
    if a1["served"] != "lora" or not a1["export"]:
        raise SystemExit(f"gpu_vllm_lora: adapter a1 not served as exported LoRA: {a1}")
    return {"cfg": cfg, "built": built, "checks": found}


def greedy(url: str, model: str) -> list[str]:
    import httpx

    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            raise SystemExit(f"gpu_vllm_lora: {model} at {url}: HTTP {r.status_code}: {r.text[:300]}")
        out.append(r.json()["choices"][0]["text"].rstrip("\ufffd"))
    return out


def serve_vllm(done: dict, base: Path) -> dict[str, list[str]]:
    """Upload the export, start the app on a fresh local Ray, the greedy completions."""
    import ray
    from ray import serve

    from moeflow.core.storage import publish
    from moeflow.serving import vllm_backend as V
    from moeflow.serving.app import free_port
    from tests.s3server import s3_server

    with s3_server() as env:
        # Ray Serve LLM reads LoRA with pyarrow (AWS_ENDPOINT_URL_S3) or boto3 (AWS_ENDPOINT_URL)
        os.environ.update(env, AWS_ENDPOINT_URL_S3=env["AWS_ENDPOINT_URL"])
        for src, uri in done["built"]["uploads"].items():
            publish(src, uri)
        ray.init(include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="/tmp/mfv"))
        try:
            url = V.start(done["built"]["serve_config"], "gpu", "127.0.0.1", free_port(), wait_s=900)
            name = base.name
            return {name: greedy(url, name), "a1": greedy(url, f"{name}:a1")}
        finally:
            serve.shutdown()
            ray.shutdown()


def serve_local(base: Path, adapter: Path) -> dict[str, list[str]]:
    """moeflow's engine (no Ray) on the same base, the fused adapter unmerged."""
    from moeflow.serving.app import ServeSettings, free_port
    from moeflow_testing.serving import LocalServer

    settings = ServeSettings(base_dir=str(base), adapters={"a1": str(adapter)}, dtype="float32")
    with LocalServer(settings, free_port()) as server:
        return {base.name: greedy(server.url, base.name), "a1": greedy(server.url, f"{base.name}:a1")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="build, export, check and render; serve nothing")
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="moeflow-vllm-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    base, adapter = build(out)
    done = built_config(base, adapter, out, "gpu")
    summary: dict = {"checks": done["checks"], "uploads": done["built"]["uploads"],
                     "serve_config": done["built"]["serve_config"]}
    status = 0
    if not a.dry_run:
        summary["vllm"] = served = serve_vllm(done, base)
        summary["local"] = ours = serve_local(base, adapter)
        summary["equal"] = served == ours
        summary["adapter_changes_output"] = served[base.name] != served["a1"]
        status = 0 if summary["equal"] and summary["adapter_changes_output"] else 1
    (out / "vllm_lora.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({k: summary[k] for k in ("equal", "adapter_changes_output") if k in summary} or
                     {"dry_run": "built, exported, checked by vLLM's loading; nothing served"}))
    return status


if __name__ == "__main__":
    sys.exit(main())
