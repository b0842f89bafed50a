"""The rehearsal's serving and deploy stages: a model 4x one 150 MB "device", served by the
engine built for that size -- vLLM through Ray Serve LLM, in the plan's TP / PP layout.

    .venv/bin/python benchmarks/rehearse_serving.py            # ~5-10 min on 2 busy cores
    .venv/bin/python benchmarks/rehearse_serving.py --search   # + the serving stage's search

Needs the vLLM environment (`make setup-vllm`). A random Qwen3-MoE in float32 (20 layers of 16
experts, head_dim 64: vLLM's CPU attention has no head_dim 16) of about 616 MB (4.1x the
device) is written, and:

- the dry run (`moeflow run CONFIG --dry-run --json`, a separate process as a user runs it) on
  cluster/hardware/cpu-budget-node8.yaml (cpu-budget's device, 8 to a node: Ray Serve LLM keeps
  one CPU engine on one node) must plan serving and deploy on vLLM (deploy.backend auto:
  one replica of the local engine would hold the whole model on one device) with a layout whose
  memory per device is within the budget;
- the plan stage runs, and the deploy stage's own steps (moeflow.serving.deployment.decide with
  the plan's record, vllm_backend.build_run, serve_and_smoke) deploy the model on this host's
  Ray (a node of the spec's 8 devices: a Ray of 8 CPUs on this host): the backend auto
  resolves to, the plan's TP / PP / EP, its KV cache size;
- greedy completions through the OpenAI surface, against moeflow's local engine serving the
  whole model on one device (the one-device run): the same text and token counts;
- each vLLM worker process's model-attributable peak: VmHWM minus the resident set just before
  the worker built its model and read its first tensor (benchmarks/vllm_worker_meter.py, loaded
  as vLLM's worker_extension_cls) -- moeflow.core.memmeter's measure, taken inside the worker;
- the serving stage searches the backend that will serve: with auto resolved to vLLM the stage
  runs tasks.serving.tune_vllm, whose candidates (VllmHarness.config) carry the plan's layout;
  `--search` runs that search for real (two more vLLM engines brought up one at a time).

What differs from a GPU deployment, and why: vLLM's CPU build computes in float32 here
(greedy tokens equal to the local engine's need the same precision), runs without
torch.compile (`enforce_eager`: the compile of two workers takes minutes and its memory on
2 cores, and is no part of the model; and TORCH_COMPILE_DISABLE=1, as enforce_eager still
compiles vLLM's small helpers with inductor -- the vocab-parallel embedding's mask at TP > 1,
the random sampler -- 48 + 34 MB per worker while compiling, 19 MB kept, the same for any
model: benchmarks/vllm_worker_meter.py --probe), and its KV cache is the plan's
(`kv_cache_memory_bytes`; vLLM's CPU default is GiBs). The vllm backend binds each worker's
threads to cores of its own, as this host has one NUMA node for two workers
(moeflow.serving.vllm_run.cpu_binding; vLLM's own binding refuses that).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET_SPEC = ROOT / "cluster" / "hardware" / "cpu-budget-node8.yaml"
SERVED = dict(hidden_size=384, moe_intermediate_size=384, num_experts=16, num_experts_per_tok=2,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=768)
SERVED_LAYERS = 20  # 616 MB in float32: 4.1x the device
PROMPTS = ["reverse: abc\nanswer:", "hello world", "kqzm zz", "the quick brown fox"]
NEW = 8
METER_CLS = "benchmarks.vllm_worker_meter.WorkerMeter"
EAGER_ENV = "TORCH_COMPILE_DISABLE"  # torch.compile off in the workers too (module docstring)
# checkpoint shards in the proportion a release's have to its devices (5 GB files on 80-141 GB
# devices): a worker maps one file at a time as it loads, and the mapped pages it reads count
# in its resident set until the file is closed
SHARD = "10MB"


def build_served(work: Path) -> Path:
    """The served model: a random float32 Qwen3-MoE (HF format) of 4x the device."""
    from moeflow_testing.tiny import build_debug_model

    return build_debug_model("qwen3_moe", work / "served", num_hidden_layers=SERVED_LAYERS,
                             max_shard_size=SHARD, dtype="float32", **SERVED)


# the serving search's traffic: short chat turns at a rate the plan's 8 CPU workers of a float32
# model serve on this host's 2 cores (about 1 s a decode step of 2 sequences at TP8), every
# request within the SLOs (configs/traffic/demo.yaml's bursts of 64 would measure only queueing)
PROFILE = {"name": "rehearsal-chat", "arrivals": {"process": "poisson", "rate": 0.2},
           "mix": [{"name": "chat", "share": 1, "prompt_len": {"dist": "fixed", "value": 16},
                    "output_len": {"dist": "fixed", "value": 8}}],
           "num_requests": 8, "slo": {"ttft_ms": 20000, "tpot_ms": 5000, "percentile": 90}}
# the candidates the search may try: engine batches whose KV cache (2 x 512 tokens planned) and
# steps fit the device; the deploy: default (2 sequences, 512 tokens a step) always runs first
SEARCH = {"max_num_seqs": [2], "max_num_batched_tokens": [256, 512], "enable_chunked_prefill": [True],
          "long_prefill_token_threshold": [None], "max_long_partial_prefills": [1], "num_replicas": [1],
          "max_ongoing_requests": [8]}


def raw_config(model: Path, hardware: str, work: Path) -> dict:
    """The pipeline config: deploy.backend auto, float32, a small batch and context (2 x 512)."""
    import yaml

    profile = work / "traffic.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    return {"model": {"path": str(model), "dtype": "float32"}, "hardware": hardware,
            "workdir": str(work / "runs"), "plan": {"batch": 2, "context": 512},
            "finetune": {"micro_batch_size": 1, "gradient_checkpointing": True},
            # the stages serving and deploy need upstream; operators and calibrate are the
            # rest of the rehearsal (benchmarks/rehearse_streamed.py)
            "stages": {"enabled": ["convert", "plan", "finetune", "regress", "serving", "deploy"]},
            "serving": {"max_candidates": 2, "budget_s": 60, "profile": str(profile), "rate_points": 0,
                        "search": SEARCH},
            "deploy": {"backend": "auto", "dtype": "float32", "max_model_len": 512, "max_num_seqs": 2,
                       "max_num_batched_tokens": 512, "host": "127.0.0.1", "port": 0}}


def dry_run(raw: dict, work: Path) -> dict:
    """`moeflow run CONFIG --dry-run --json` (its own process): exit code, the serving and deploy rows."""
    import subprocess

    import yaml

    path = work / "serving-rehearsal.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}")
    proc = subprocess.run([sys.executable, "-m", "workflows.cli", "run", str(path), "--dry-run", "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    try:
        rec = json.loads(proc.stdout)
    except ValueError:
        return {"exit": proc.returncode, "error": (proc.stderr or proc.stdout).strip()[-400:], "stages": {}}
    rows = {s["stage"]: {k: s.get(k) for k in ("devices", "memory_per_device_bytes", "placement")}
            for s in rec["stages"] if s["stage"] in ("serving", "deploy")}
    return {"exit": proc.returncode, "stages": rows}


def plan_stage(cfg, out: Path) -> dict:
    """The plan stage's record (tasks.plan.run), as deploy and serving read it."""
    from tasks.base import StageContext
    from tasks.plan import run

    out.mkdir(parents=True, exist_ok=True)
    return run(StageContext(stage="plan", config=cfg, inputs={}, out_dir=out))


def greedy(url: str, model: str) -> list[tuple[str, int]]:
    """(text, completion tokens) per prompt, temperature 0. A completion that ends inside a
    multi-byte UTF-8 character ends in U+FFFD in moeflow's text and without it in vLLM's
    (tests/test_vllm_serve.py): the text is compared without trailing U+FFFD."""
    import httpx

    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0})
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        out.append((body["choices"][0]["text"].rstrip("\ufffd"), body["usage"]["completion_tokens"]))
    return out


RSS_KINDS = ("RssAnon", "RssFile", "RssShmem")


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}


class Sampler:
    """Each metered worker's resident set by kind (anonymous, file-backed: the checkpoint's
    mapped pages, shared memory: vLLM's TP buffers and queues), sampled every `every` s; the
    highest of each seen. A breakdown of the peak; the peak itself is VmHWM's (worker_peaks)."""

    def __init__(self, meter_dir: Path, every: float = 0.05):
        import threading

        self.meter_dir, self.every, self.high = meter_dir, every, {}
        self.stop_ = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_.wait(self.every):
            for path in self.meter_dir.glob("*.json"):
                pid = int(path.stem)
                try:
                    st = _status(pid)
                except OSError:  # gone
                    continue
                got = {k: int(st[k].split()[0]) * 1024 for k in RSS_KINDS if k in st}
                got["sum"] = sum(got.values())
                high = self.high.setdefault(pid, {})
                for k, v in got.items():
                    high[k] = max(high.get(k, 0), v)

    def __enter__(self) -> "Sampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_.set()
        self.thread.join()


def worker_peaks(meter_dir: Path, sampled: dict | None = None) -> list[dict]:
    """Each vLLM worker that noted its level (benchmarks/vllm_worker_meter.py): its VmHWM now,
    minus that level. Read while the workers live (before the application is deleted)."""
    out = []
    for path in sorted(meter_dir.glob("*.json")):
        rec = json.loads(path.read_text())
        fields = _status(rec["pid"])
        hwm = int(fields["VmHWM"].split()[0]) * 1024
        out.append({"pid": rec["pid"], "name": fields["Name"], "base_bytes": rec["base_bytes"],
                    "hwm_bytes": hwm, "peak_bytes": None if rec["base_bytes"] is None
                    else hwm - rec["base_bytes"], "measure": rec["measure"],
                    "now": {k: int(fields[k].split()[0]) * 1024 for k in RSS_KINDS if k in fields},
                    "at_start": rec.get("at_start", {}),
                    "sampled_high": (sampled or {}).get(rec["pid"], {})})
    return out


@contextmanager
def rehearsal_engine(serving: dict):
    """The vllm backend's engine arguments with the rehearsal's added (module docstring): eager,
    the worker meter, and the plan's KV cache (vLLM's CPU default is GiBs), for every engine
    built meanwhile -- deploy's, and each candidate the serving search brings up."""
    from moeflow.serving import vllm_backend as V

    real, eager = V.engine_kwargs, os.environ.get(EAGER_ENV)
    added = dict(enforce_eager=True, worker_extension_cls=METER_CLS,
                 kv_cache_memory_bytes=serving["vllm"]["kv_cache_bytes_per_device"])
    V.engine_kwargs = lambda *a, **kw: dict(real(*a, **kw), **added)  # type: ignore[assignment]
    os.environ[EAGER_ENV] = "1"  # vllm_run.runtime_env passes it on (CPU_ENV)
    try:
        yield
    finally:
        V.engine_kwargs = real  # type: ignore[assignment]
        if eager is None:
            os.environ.pop(EAGER_ENV, None)
        else:
            os.environ[EAGER_ENV] = eager


def deploy_vllm(cfg, plan_rec: dict, out: Path, meter_dir: Path) -> dict:
    """The deploy stage's steps for deploy.backend auto (tasks/deploy.py _run_vllm), the engine
    arguments of the rehearsal added (module docstring); greedy completions and worker peaks."""
    from ray import serve

    from moeflow.serving import vllm_backend as V
    from moeflow.serving import vllm_run
    from moeflow.serving.deployment import decide

    dep = decide(cfg, {"plan": plan_rec})  # auto: the backend the plan stage chose
    serving = plan_rec["plan"]["serving"]
    device = vllm_run.cluster_device()
    os.environ[vllm_run.METER_ENV] = str(meter_dir)  # vllm_run.runtime_env hands it to the workers
    try:  # the engine arguments and TORCH_COMPILE_DISABLE both while it builds and while it starts
        with rehearsal_engine(serving), Sampler(meter_dir) as sampler:
            built = V.build_run(cfg, dep, serving, out, device=device)
            rec = V.serve_and_smoke(cfg, built, device)
            model = built["llm_configs"][0]["model_loading_config"]["model_id"]
            completions = greedy(rec["url"], model)
        peaks = worker_peaks(meter_dir, sampler.high)
    finally:
        os.environ.pop(vllm_run.METER_ENV, None)
        serve.shutdown()
    return {"backend": dep.backend, "engine_kwargs": built["llm_configs"][0]["engine_kwargs"],
            "completions": completions, "workers": peaks, "models": rec["models"]}


def local_one_device(model: Path) -> list[tuple[str, int]]:
    """moeflow's engine holding the whole model (one device with room for it): its completions."""
    from ray import serve

    from moeflow.serving.app import ServeSettings, free_port, start

    url = start(ServeSettings(base_dir=str(model), dtype="float32"), port=free_port())
    try:
        return greedy(url, model.name)
    finally:
        serve.shutdown()


def search_backend(cfg, plan_rec: dict, out: Path) -> dict:
    """Which search the serving stage runs, and the layout of the candidate it brings up first."""
    from moeflow.serving import vllm_run
    from moeflow.serving.deployment import decide, resolved_backend
    from moeflow.serving.tune import Candidate
    from moeflow.serving.vllm_search import VllmHarness
    from tasks.serving import default_knobs

    backend = resolved_backend(cfg, {"plan": plan_rec})
    if backend != "vllm":
        return {"backend": backend}
    serving = plan_rec["plan"]["serving"]
    dep = decide(cfg, {"plan": plan_rec}, backend="vllm")
    harness = VllmHarness(cfg, dep, serving, out, vllm_run.cluster_device())
    cand = Candidate("default", default_knobs(cfg, {"num_replicas": serving["vllm"]["num_replicas"]}))
    cand.app = "moeflow-vllm-tune-0"
    kw = harness.config(cand)["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]
    return {"backend": backend, "candidate_layout": {k: kw.get(k) for k in
                                                     ("tensor_parallel_size", "pipeline_parallel_size",
                                                      "enable_expert_parallel")}}


def run_search(cfg, plan_rec: dict, out: Path) -> dict:
    """The serving stage for real (tasks.serving.run): vLLM candidates one at a time."""
    from tasks.base import StageContext
    from tasks.serving import run

    out.mkdir(parents=True, exist_ok=True)
    with rehearsal_engine(plan_rec["plan"]["serving"]):
        rec = run(StageContext(stage="serving", config=cfg, inputs={"plan": plan_rec}, out_dir=out))
    report = json.loads(Path(rec["report_path"]).read_text())
    measured = [c for c in report.get("candidates") or [] if c.get("final")]
    return {"chosen": rec["chosen"], "goodput_rps": rec["goodput_rps"], "message": rec["message"],
            "backend": report.get("backend"), "candidates": len(report.get("candidates") or []),
            "measured": [{k: c.get(k) for k in ("name", "config", "goodput_rps")}
                         | {m: c["final"].get(m) for m in ("num_prompts", "completed", "failed", "request_goodput",
                                                           "output_throughput", "mean_ttft_ms", "mean_tpot_ms")}
                         for c in measured]}


def rehearse(work: Path, search: bool = False) -> dict:
    """Build, dry-run, plan, deploy on vLLM, serve the same model locally; the record (`checks`)."""
    import ray

    from moeflow.core.config import validate
    from moeflow.core.hardware import load_hardware

    hw = load_hardware(str(BUDGET_SPEC))
    budget = hw.memory_bytes
    work.mkdir(parents=True, exist_ok=True)
    model = build_served(work)
    raw = raw_config(model, str(BUDGET_SPEC), work)
    cfg = validate(raw)
    rec: dict = {"budget_bytes": budget, "checkpoint_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")),
                 "dry_run": dry_run(raw, work)}
    started = not ray.is_initialized()
    temp = tempfile.mkdtemp(prefix="/tmp/mfrs")  # Ray's own, short (socket paths)
    try:
        if started:  # one node of the spec: a CPU (Ray's bundle) per device
            ray.init(num_cpus=hw.devices_per_node, include_dashboard=False, _temp_dir=temp,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        elif ray.cluster_resources().get("CPU", 0) < hw.devices_per_node:
            raise RuntimeError(f"the connected Ray has {ray.cluster_resources().get('CPU', 0):g} CPUs: the serving "
                               f"rehearsal needs a node of {hw.devices_per_node} (call it without Ray started)")
        plan_rec = plan_stage(cfg, work / "plan")
        serving = plan_rec["plan"]["serving"]
        rec["plan"] = {"backend": serving["backend"], "why": serving["backend_why"], "vllm": serving["vllm"]}
        rec["search"] = search_backend(cfg, plan_rec, work / "search")
        meter = work / "meter"
        meter.mkdir()
        rec["deploy"] = deploy_vllm(cfg, plan_rec, work / "deploy", meter)
        rec["one_device"] = local_one_device(model)
        if search:
            rec["search"]["run"] = run_search(cfg, plan_rec, work / "serving")
    finally:
        if started:
            ray.shutdown()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
    rec["completions_equal"] = rec["deploy"]["completions"] == rec["one_device"]
    return rec


def peaks(rec: dict) -> dict[str, list]:
    """The stage processes' peaks, as rehearse_streamed prints them."""
    return {"deploy: vLLM workers": [w["peak_bytes"] for w in rec["deploy"]["workers"]]}


def checks(rec: dict) -> list[str]:
    """What failed (empty: the serving / deploy rehearsal holds)."""
    bad, budget = [], rec["budget_bytes"]
    v = rec.get("plan", {}).get("vllm") or {}
    if rec["checkpoint_bytes"] < 4 * budget:
        bad.append(f"the served checkpoint ({rec['checkpoint_bytes']} B) is not 4x the device")
    dry = rec["dry_run"]
    if dry["exit"] != 0 or set(dry["stages"]) != {"serving", "deploy"}:
        bad.append(f"dry run: exit {dry['exit']}, {dry.get('error') or dry['stages']}")
    for stage, row in dry["stages"].items():
        if "vLLM" not in (row["placement"] or "") or (row["memory_per_device_bytes"] or 0) > budget:
            bad.append(f"dry run {stage}: {row['placement']}, {row['memory_per_device_bytes']} B per device")
    if rec.get("plan", {}).get("backend") != "vllm" or rec.get("deploy", {}).get("backend") != "vllm":
        bad.append("deploy.backend auto did not resolve to vllm")
    if max(v.get("tensor_parallel", 1), v.get("pipeline_parallel", 1), v.get("expert_parallel", 1)) < 2:
        bad.append(f"the vLLM plan does not split the model: {v}")
    workers = rec.get("deploy", {}).get("workers") or []
    if len(workers) != v.get("devices_per_replica", 0) * v.get("num_replicas", 0):
        bad.append(f"{len(workers)} vLLM workers measured, the plan has "
                   f"{v.get('devices_per_replica')} x {v.get('num_replicas')}")
    planned = v.get("memory_per_device_gb", 0) * 1e9
    if planned > budget:
        bad.append(f"the vLLM plan's {planned / 1e6:.1f} MB per device is over the {budget / 1e6:.0f} MB budget")
    for w in workers:  # within the device (the plan's own figure: open_items)
        if w["peak_bytes"] is None or w["peak_bytes"] > budget:
            bad.append(f"vLLM worker {w['pid']}: peak {w['peak_bytes']} B over the {budget:.0f} B device "
                       f"(or unmeasured)")
    layout = rec.get("search", {}).get("candidate_layout") or {}
    if rec.get("search", {}).get("backend") != "vllm" or layout.get("tensor_parallel_size") != v.get(
            "tensor_parallel") or layout.get("pipeline_parallel_size") != v.get("pipeline_parallel"):
        bad.append(f"the serving search does not search the vLLM layout deploy serves: {rec.get('search')}")
    if "run" in rec.get("search", {}) and rec["search"]["run"].get("backend") not in (None, "vllm"):
        bad.append(f"the serving search ran on {rec['search']['run']['backend']}")
    for c in rec.get("search", {}).get("run", {}).get("measured", []):  # end to end: every request served
        if not c.get("completed") or c.get("failed"):
            bad.append(f"serving search candidate {c['name']}: {c.get('completed')} completed, "
                       f"{c.get('failed')} failed")
    if not rec.get("completions_equal"):
        bad.append("vLLM's greedy completions differ from the local engine's on one device")
    return bad


def open_items(rec: dict) -> list[str]:
    """Measured, not failed (printed): a worker above the plan's figure per device (within the
    device: checks), a serving search that measured no candidate end to end."""
    out = []
    planned = (rec.get("plan", {}).get("vllm") or {}).get("memory_per_device_gb", 0) * 1e9
    for w in rec.get("deploy", {}).get("workers") or []:
        if w["peak_bytes"] is not None and w["peak_bytes"] > planned:
            out.append(f"vLLM worker {w['pid']}: peak {w['peak_bytes'] / 1e6:.1f} MB, above the plan's "
                       f"{planned / 1e6:.1f} MB per device by {(w['peak_bytes'] - planned) / 1e6:.1f} MB")
    run = rec.get("search", {}).get("run")
    if run is not None and not run.get("measured"):
        out.append(f"the serving search measured no vLLM candidate: {run.get('message')}")
    return out


def report(rec: dict) -> list[str]:
    """The lines the rehearsal prints."""
    mb, v = 1e6, rec["plan"]["vllm"]
    lines = [f"served model {rec['checkpoint_bytes'] / mb:.0f} MB float32 "
             f"({rec['checkpoint_bytes'] / rec['budget_bytes']:.2f}x a {rec['budget_bytes'] / mb:.0f} MB device)",
             f"  plan: {rec['plan']['backend']} ({rec['plan']['why']})",
             f"  vLLM layout TP{v['tensor_parallel']} PP{v['pipeline_parallel']} EP{v['expert_parallel']} "
             f"DP{v['data_parallel']}, {v['weight_dtype']}, planned {v['memory_per_device_gb'] * 1e3:.0f} MB "
             f"per device, KV cache {v['kv_cache_bytes_per_device'] / mb:.1f} MB",
             "  planned per device, MB: " + ", ".join(f"{k} {x:.1f}" for k, x in v["memory_parts_mb"].items())]
    for stage, row in rec["dry_run"]["stages"].items():
        lines.append(f"  dry run {stage}: {row['placement']}; {row['memory_per_device_bytes'] / mb:.0f} MB per device")
    for w in rec["deploy"]["workers"]:
        lines.append(f"  vLLM worker {w['name']} (pid {w['pid']}): peak {w['peak_bytes'] / mb:.1f} MB above "
                     f"{w['base_bytes'] / mb:.0f} MB before its first tensor; resident then / after serving: "
                     + ", ".join(f"{k[3:]} {w['at_start'].get(k, 0) / mb:.0f} / {v / mb:.0f}"
                                 for k, v in w["now"].items())
                     + " MB; highest sampled "
                     + ", ".join(f"{k.removeprefix('Rss')} {v / mb:.0f}" for k, v in w["sampled_high"].items()) + " MB")
    run = rec["search"].get("run")
    lines.append(f"  serving search backend: {rec['search']['backend']}, candidate layout "
                 f"{rec['search'].get('candidate_layout')}")
    if run:
        lines.append(f"  serving search: {run['candidates']} candidates, chosen {run['chosen']}, "
                     f"goodput {run['goodput_rps']} req/s; {run['message']}")
        for c in run["measured"]:
            lines.append(f"    measured {c['name']}: {c}")
    lines.append(f"  greedy completions equal to the local engine on one device: {rec['completions_equal']}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true", help="run the serving stage's vLLM search too")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args()
    from moeflow.serving.vllm_run import vllm_missing

    if why := vllm_missing():
        print(f"error: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="moeflow-rehearse-serving-") as tmp:
        rec = rehearse(Path(tmp), args.search)
    print("\n".join(report(rec)))
    if args.json:
        args.json.write_text(json.dumps(rec, indent=1))
    for line in open_items(rec):
        print("OPEN:", line)
    bad = checks(rec)
    for line in bad:
        print("FAIL:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
