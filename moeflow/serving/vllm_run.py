"""Run a vLLM Serve config on Ray: Ray Serve LLM replicas in the project's vLLM environment.

moeflow's own venv has no vLLM (its pins disagree with vLLM's: README, "vLLM"), so
`import ray.serve.llm` fails in the driver. The application is deployed the way
`serve deploy` deploys it: the Serve config goes to the Serve controller, which builds it
in a task. That task, the OpenAI ingress and every LLMServer replica run under a Ray
runtime_env whose `py_executable` is the vLLM venv's python (`make setup-vllm`: same
Ray release, vLLM installed), so nothing of vLLM is imported on the driver's side.

    from moeflow.serving import vllm_run
    url = vllm_run.deploy_config(serve_config, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from moeflow.core.errors import UserError

VENV = ".venv-vllm"  # next to the repository's own .venv (Makefile: setup-vllm)
SETUP = "make setup-vllm"
PYTHON_ENV = "MOEFLOW_VLLM_PYTHON"  # another vLLM environment's python (same Ray release)
# environment of vLLM's CPU build that replicas take from the deploying shell when set there;
# TORCH_COMPILE_DISABLE=1 keeps an enforce_eager engine eager: vLLM still compiles small helpers
# with inductor (the vocab-parallel embedding's mask at TP > 1, the random sampler), which on CPU
# costs each worker 48 + 34 MB while compiling and 19 MB after (benchmarks/vllm_worker_meter.py)
CPU_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
           "TORCH_COMPILE_DISABLE")
# where vLLM's worker processes note their memory level before their weights load, when set in
# the deploying shell (benchmarks/vllm_worker_meter.py, the rehearsal's serving stage)
METER_ENV = "MOEFLOW_VLLM_METER_DIR"


def vllm_python() -> Path | None:
    """The vLLM environment's python: $MOEFLOW_VLLM_PYTHON, else the repository's .venv-vllm,
    else this python where vLLM is installed beside moeflow (a cluster image with ray[llm])."""
    if os.environ.get(PYTHON_ENV):
        return Path(os.environ[PYTHON_ENV])
    path = Path(__file__).resolve().parents[2] / VENV / "bin" / "python"
    if path.is_file():
        return path
    return Path(sys.executable) if importlib.util.find_spec("vllm") is not None else None


def vllm_missing() -> str | None:
    """Why vLLM cannot run from here, in one line naming the command that installs it (None: it can)."""
    python = vllm_python()
    if python is None:
        return f"no vLLM environment ({VENV}): `{SETUP}` installs it"
    if not python.is_file():
        return f"{PYTHON_ENV}={python}: no such python (`{SETUP}` installs {VENV})"
    stamp = list(python.parent.parent.glob(".installed-*"))
    if not stamp and python.parent.parent.name == VENV:
        return f"{VENV} is not fully installed: rerun `{SETUP}`"
    return None


# vLLM CPU workers on a tight device (the vLLM plan's "tight_cpu"): glibc serves every block of
# 64 KB or more by mmap and returns it on free. With its default (a threshold that rises as
# blocks are freed) a worker's load temporaries -- each layer's experts copied to pad and to
# repack them -- stay in its heap: measured on the rehearsal's 20-layer model at TP8, 100 MB
# free but kept per worker, peaks of 216-234 MB; with it 141-142 MB (planned 140, device 150).
TIGHT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}


def runtime_env(device: str, tight: bool = False) -> dict:
    """The Ray runtime_env every process of the app runs under: the vLLM python, and on CPU
    vLLM's CPU settings from the deploying shell (e.g. VLLM_CPU_KVCACHE_SPACE, in GiB), and
    TIGHT_ENV where the plan says the device is tight."""
    if why := vllm_missing():
        raise UserError(f"deploy.backend vllm: {why}")
    env = {k: os.environ[k] for k in CPU_ENV if device == "cpu" and os.environ.get(k)}
    if device == "cpu" and tight:
        env.update(TIGHT_ENV)
    if os.environ.get(METER_ENV):
        env[METER_ENV] = os.environ[METER_ENV]
    # the replicas import the repository's code only through Ray; vLLM's own logs stay quiet
    env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    return {"py_executable": str(vllm_python()), "env_vars": env}


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binding(workers: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `workers` local CPU workers, where vLLM's own
    ("auto": a NUMA node per worker) would refuse the engine: with fewer NUMA nodes than workers
    (one on most small hosts), vLLM's CPU build stops at start ("Not enough allowed NUMA nodes to
    bind threads of 2 local CPUWorkers"). Then the cores this process may use are split into
    `workers` contiguous ranges, one per worker; with fewer cores than workers each worker gets
    one core, in turn. (Giving each every core made each run as many threads as there are cores,
    all spinning against each other's: timed by hand on the rehearsal's TP8 engine on 2 cores, a
    decode step took about 8 times as long, and the start twice as long.) None: the
    deploying shell sets the variable (passed on as it is), or auto can bind.

    The cores are this host's: a CPU cluster whose replicas run on other nodes sets the variable
    for its nodes (or has a NUMA node per worker there)."""
    if os.environ.get(BIND_ENV) or workers <= 1:
        return None
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    if workers <= nodes:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(workers))
    per = len(cpus) // workers
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(workers))


def app_runtime_env(env: dict, app: dict, device: str) -> dict:
    """`env` (runtime_env) for one application of a Serve config: on CPU, with the thread binding
    its largest engine needs (cpu_binding of TP x PP x engine DP workers); where an engine names a
    worker extension of this repository's (moeflow.serving.vllm_worker), the repository on
    PYTHONPATH: vLLM's workers import it, and the vLLM environment has no moeflow installed (on a
    cluster, the job's working_dir brings the same code)."""
    llms = app.get("args", {}).get("llm_configs") or [app.get("args", {}).get("llm_config") or {}]
    ours = [kw.get("worker_extension_cls") for kw in (llm.get("engine_kwargs") or {} for llm in llms)
            if str(kw.get("worker_extension_cls") or "").startswith("moeflow.")]
    if ours:
        path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                           env["env_vars"].get("PYTHONPATH", os.environ.get("PYTHONPATH"))) if p)
        env = {**env, "env_vars": {**env["env_vars"], "PYTHONPATH": path}}
    if device != "cpu":
        return env
    workers = max(int(kw.get("tensor_parallel_size") or 1) * int(kw.get("pipeline_parallel_size") or 1)
                  * int(kw.get("data_parallel_size") or 1) for kw in (llm.get("engine_kwargs") or {} for llm in llms))
    bind = cpu_binding(workers)
    return env if bind is None else {**env, "env_vars": {**env["env_vars"], BIND_ENV: bind}}


def cluster_device() -> str:
    """"gpu" when the connected Ray cluster has GPUs, else "cpu" (vLLM's CPU build)."""
    import ray  # seconds to import: only when deploying

    return "gpu" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def deploy_config(config: dict, *, host: str, port: int, wait_s: float = 600.0) -> str:
    """Deploy a Serve config (its applications carry their runtime_env) on the connected Ray,
    wait until every application runs; the HTTP base URL.

    Raises:
        UserError: an application failed to deploy (its first error line), or did not run
            within `wait_s`.
    """
    # lazy: Ray Serve (seconds to import); only a deployment waits on it
    from ray import serve
    from ray.serve.context import _get_global_client  # Ray 2.60: what `serve run CONFIG` uses
    from ray.serve.schema import ServeDeploySchema

    serve.start(http_options={"host": host, "port": port})
    try:
        schema = ServeDeploySchema.model_validate(config)
    except Exception as exc:  # pydantic.ValidationError: the first line names the field
        raise UserError(f"Serve config invalid: {str(exc).splitlines()[0]}") from None
    client = _get_global_client()
    assert client is not None  # serve.start above connected it
    client.deploy_apps(schema, _blocking=False)
    wait_running([a["name"] for a in config["applications"]], wait_s)
    return f"http://{host}:{port}"


def wait_running(names: list[str], wait_s: float) -> None:
    """Block until the applications `names` run; UserError with Serve's reason if one fails."""
    # lazy: Ray Serve (seconds to import); only a deployment waits on it
    from ray import serve

    deadline = time.monotonic() + wait_s
    while True:
        apps = serve.status().applications
        states = {n: apps.get(n) for n in names}
        for name, app in states.items():
            if app is not None and str(app.status).endswith("DEPLOY_FAILED"):
                raise UserError(f"vllm application {name!r} failed to deploy: {_reason(app)}")
        if all(a is not None and str(a.status).endswith("RUNNING") for a in states.values()):
            return
        if time.monotonic() > deadline:
            raise UserError(f"vllm applications {', '.join(names)} not running within {wait_s:.0f} s "
                            f"(Serve says: {'; '.join(_reason(a) for a in states.values() if a)})")
        time.sleep(1.0)


def _reason(app: Any) -> str:
    """The line of an application's (or its deployments') message that names the error."""
    texts = [app.message or ""] + [d.message or "" for d in app.deployments.values()]
    lines = [ln.strip() for t in texts for ln in t.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else lines[-1] if lines else str(app.status))[:400]


def check_cpu_head_dim(model_dir: str | Path) -> None:
    """vLLM's CPU attention serves only some head sizes (the demo model's 16 is not one): asked
    of vLLM itself (its CPU attention backend) before anything starts; UserError naming both."""
    # lazy: params imports anatomy (transformers); the rest of this module stays light
    from moeflow.model.params import load_config_json

    cfg = load_config_json(model_dir)
    text = cfg.get("text_config") or cfg
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    code = ("import json; from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B; "
            "print(json.dumps(B.get_supported_head_sizes()))")
    proc = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    if proc.returncode != 0:
        raise UserError(f"vLLM's CPU attention could not be asked its head sizes: "
                        f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    if head_dim not in sizes:
        raise UserError(f"{model_dir}: head_dim {head_dim}: vLLM's CPU build serves head sizes "
                        f"{', '.join(map(str, sizes))} only; serve this model with deploy.backend local, "
                        f"or on a GPU cluster")
