"""`deploy.backend: vllm` — a Ray Serve LLM application (vLLM behind the OpenAI API) from a run.

The local backend runs moeflow's own engine, one whole model copy per replica.
Models larger than one device need tensor / pipeline / expert parallelism, a
paged KV cache and FP8 kernels: vLLM's job, which Ray Serve LLM (`ray.serve.llm`)
runs across nodes. This module turns a pipeline run into that application's
config: the checkpoint (converted, or calibrated), the plan's vLLM serving
sub-plan (moeflow.parallel.vllm_plan.vllm_serving_plan), the deploy knobs and the adapters.

    moeflow deploy --run RUN_ID --backend vllm --dry-run --out serve.yaml
    serve run serve.yaml        # or: serve deploy serve.yaml / a KubeRay RayService

Known vLLM limits, checked before anything is written (each decision is stated):
  - PEFT `target_parameters` expert adapters (fused 3-D LoRA, what moeflow trains)
    load wrongly in vLLM as they are (flat `experts.base_layer.lora_A` keys): they are
    exported per expert (moeflow.training.adapter_layout, the layout vLLM's FusedMoE
    LoRA loads) and that copy is served as LoRA;
  - LoRA on MoE experts under expert parallelism needs vLLM's allgather_reducescatter
    all2all backend: expert LoRA under EP is served merged, as a model of its own;
  - Ray Serve LLM loads LoRA adapters only from s3/gs/abfss/azure URIs
    (`dynamic_lora_loading_path` + "/<adapter name>"): `deploy.lora_uri` names
    that prefix and the record says which local dir goes where.
  - `deploy.max_cpu_loras` is vLLM's `max_cpu_loras` and Ray Serve LLM's adapters per replica;
    `deploy.pinned_adapters` has no way through Ray Serve LLM (vLLM's `pin_lora` is neither
    called nor exposed): a pinned adapter served as LoRA is refused (`refuse_pinned`).
With the workdir in a store, every checkpoint a replica loads (the base, a merged
adapter) is named by its store URI (`model_source: {bucket_uri: ...}`, Ray Serve
LLM's cloud mirror), never by a path on the deploying node.
`import ray.serve.llm` needs vLLM; the config model (LLMConfig) imports without
it, at a private path pinned below, so configs validate on any machine.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from moeflow.core.config import PipelineConfig
from moeflow.core.errors import UserError
from moeflow.core.sections.deploy import DeploySection
from moeflow.model.anatomy import EXPERT_COUNT_KEYS
from moeflow.model.params import load_config_json
from moeflow.serving.deployment import Deployment, engine_settings
from moeflow.serving.vllm_worker import EXTENSION as PIPELINE_EXTENSION
from moeflow.training.merge import write_merged

# Ray 2.60: the class `ray.serve.llm.LLMConfig` subclasses; importable without vLLM
LLMCONFIG_MODULE = "ray.llm._internal.serve.core.configs.llm_config"
OPENAI_APP = "ray.serve.llm:build_openai_app"  # args: {"llm_configs": [...]}
DP_OPENAI_APP = "ray.serve.llm:build_dp_openai_app"  # args: {"llm_config": {...}} (engine DP > 1)
APP_NAME = "moeflow"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values
CLOUD_PREFIXES = ("s3://", "gs://", "abfss://", "azure://")
VLLM_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def llm_config_class() -> Any:
    """Ray's LLMConfig model (pinned private path); UserError naming the path if Ray moved it."""
    try:
        return importlib.import_module(LLMCONFIG_MODULE).LLMConfig
    except (ImportError, AttributeError) as exc:
        import ray  # seconds to import: only to name its version in the error

        raise UserError(f"Ray {ray.__version__} has no LLMConfig at {LLMCONFIG_MODULE} "
                        f"(moeflow pins ray 2.60.0): {exc}") from None


# ------------------------------------------------------------ adapters


@dataclass
class AdapterDecision:
    """How one fine-tuned adapter is served by vLLM, and why."""

    name: str
    path: str  # local PEFT dir
    kind: str  # "attention" | "expert_parameters" | "expert_modules"
    rank: int
    served: str  # "lora" | "merged"
    why: str
    uri: str | None = None  # lora: where replicas load it from (<lora_uri>/<name>)
    model_source: str | None = None  # merged: the merged checkpoint dir
    export: str | None = None  # lora of an expert_parameters adapter: its per-expert copy (uploaded)


def adapter_kind(adapter_dir: str | Path) -> tuple[str, int]:
    """("attention" | "expert_parameters" | "expert_modules", rank) from adapter_config.json."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise UserError(f"{path}: not a PEFT adapter (no adapter_config.json)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    rank = int(cfg.get("r") or 8)
    if cfg.get("target_parameters"):
        return "expert_parameters", rank
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    # per-expert Linear modules (Mixtral-style experts.N.w1) name their container "experts"
    if any("expert" in t for t in targets):
        return "expert_modules", rank
    return "attention", rank


def decide_adapters(adapters: dict[str, str], expert_parallel: bool, lora_uri: str | None,
                    merge: str | None = None) -> list[AdapterDecision]:
    """Served as LoRA or merged, per adapter, with the one-line reason.

    Args:
        adapters: {name: local PEFT dir}.
        expert_parallel: the serving plan enables EP.
        lora_uri: cloud prefix replicas load LoRA adapters from (None: not set).
        merge: deploy.merge — this adapter is served merged whatever its kind.
    Raises:
        UserError: an adapter must be served as LoRA but no cloud `deploy.lora_uri` is set.
    """
    out: list[AdapterDecision] = []
    for name, path in adapters.items():
        kind, rank = adapter_kind(path)
        if name == merge:
            served, why = "merged", "deploy.merge names it"
        elif kind.startswith("expert") and expert_parallel:
            served, why = "merged", ("expert LoRA under expert parallelism needs vLLM's "
                                     "allgather_reducescatter all2all backend")
        elif kind == "expert_parameters":
            served, why = "lora", (f"PEFT target_parameters expert LoRA (rank {rank}), exported per "
                                   f"expert: the layout vLLM's fused-MoE LoRA loads")
        else:
            served, why = "lora", f"{kind} LoRA (rank {rank}) is served by vLLM's multi-LoRA"
        dec = AdapterDecision(name, str(path), kind, rank, served, why)
        if served == "lora":
            dec.uri = f"{_cloud_prefix(lora_uri, name, path)}/{name}"
        out.append(dec)
    return out


def _cloud_prefix(lora_uri: str | None, name: str, path: str) -> str:
    if not lora_uri or not lora_uri.startswith(CLOUD_PREFIXES):
        got = f"{lora_uri!r} is not one" if lora_uri else "it is unset"
        raise UserError(f"deploy.lora_uri: Ray Serve LLM loads LoRA adapters only from "
                        f"{'/'.join(p[:-3] for p in CLOUD_PREFIXES)} URIs and {got}; copy {path} to "
                        f"<prefix>/{name} and set deploy.lora_uri: <prefix> (or deploy.merge: true)")
    return lora_uri.rstrip("/")


def refuse_cpu_lora(base_dir: str, decisions: list[AdapterDecision]) -> None:
    """vLLM's CPU build cannot apply LoRA to an MoE model: with LoRA on, vLLM wraps its fused MoE
    layer and runs it through Triton kernels the CPU build lacks (whatever the target modules),
    failing at the first forward. Said before anything starts; merged adapters serve."""
    cfg = load_config_json(base_dir)
    text = cfg.get("text_config") or cfg
    if not any(text.get(k) for k in EXPERT_COUNT_KEYS):
        return
    names = [a.name for a in decisions if a.served == "lora"]
    if names:
        raise UserError(f"deploy.backend vllm on CPU: vLLM's CPU build cannot serve LoRA adapters on an "
                        f"MoE model (its MoE LoRA needs Triton GPU kernels): adapter(s) {', '.join(names)} "
                        f"-- serve one merged (deploy.merge), or deploy on a GPU cluster")


def refuse_pinned(pinned: list[str], decisions: list[AdapterDecision]) -> list[str]:
    """`deploy.pinned_adapters` on the vllm backend, before any merge or start: one served
    merged is a model of its own, resident for the deployment's life (its note returned);
    one served as LoRA is refused, as is a name no adapter has (UserError, one line)."""
    served = {a.name: a for a in decisions}
    for n in (n for n in pinned if n not in served):
        raise UserError(f"deploy.pinned_adapters: {n!r} is not a served adapter "
                        f"(served: {', '.join(sorted(served)) or 'none'})")
    lora = [n for n in dict.fromkeys(pinned) if served[n].served == "lora"]
    if lora:
        raise UserError(f"deploy.pinned_adapters: the vllm backend cannot pin {', '.join(lora)} "
                        "(served as LoRA; Ray Serve LLM's LLMConfig has no pinning and never calls "
                        "vLLM's pin_lora): serve it merged (deploy.merge), use deploy.backend local, "
                        "or remove it from deploy.pinned_adapters")
    return [f"{n}: pinned, and resident as it is served merged (a model of its own)" for n in dict.fromkeys(pinned)]


def cpu_loras(max_loras: int, max_cpu_loras: int | None) -> int:
    """vLLM's `max_cpu_loras` (adapters held in host memory) for deploy.max_cpu_loras (unset:
    4 x max_loras, the local backend's default); below max_loras vLLM refuses it: said here."""
    value = max_cpu_loras if max_cpu_loras is not None else 4 * max_loras
    if value < max_loras:
        raise UserError(f"deploy.max_cpu_loras ({value}) must be >= max_loras ({max_loras})")
    return value


def merge_adapter(base_dir: str, adapter_dir: str, out: Path, dtype: str) -> Path:
    """Base + adapter merged into a plain checkpoint at `out` (reused if already there)."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_merged(base_dir, Path(adapter_dir), out, dtype)


# ------------------------------------------------------------ the application config


def checkpoint_quantized(model_dir: str | Path) -> str | None:
    """The checkpoint's own quantisation method (config.json quantization_config), if any."""
    cfg = load_config_json(model_dir)
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    return (q or {}).get("quant_method") or (q or {}).get("format") if q else None


def engine_kwargs(plan: dict, knobs: dict, dtype: str, quantized: str | None,
                  lora_ranks: list[int], gpu_memory_utilization: float,
                  max_cpu_loras: int | None = None) -> dict:
    """vLLM engine arguments: the plan's parallel layout, the deploy knobs, LoRA (device and
    host-memory adapter slots: deploy.max_loras, deploy.max_cpu_loras), precision."""
    kw: dict[str, Any] = {
        "tensor_parallel_size": plan["tensor_parallel_size"],
        "pipeline_parallel_size": plan["pipeline_parallel_size"],
        "enable_expert_parallel": plan["enable_expert_parallel"],
        "dtype": VLLM_DTYPES[dtype],
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_num_seqs": knobs["max_num_seqs"],
        "max_num_batched_tokens": knobs["max_num_batched_tokens"],
        "enable_chunked_prefill": knobs["enable_chunked_prefill"],
    }  # deploy.max_long_partial_prefills is the local engine's: vLLM 0.29 has no such argument
    if plan["data_parallel_size"] > 1:
        kw["data_parallel_size"] = plan["data_parallel_size"]
    for key in ("max_model_len", "long_prefill_token_threshold"):
        if knobs.get(key):
            kw[key] = knobs[key]
    weights = plan.get("weight_dtype", "bf16")
    if weights in ("fp8", "int8") and not quantized:
        if weights == "int8":
            raise UserError("the vllm serving plan needs int8 weights: serve a calibrated W8A8 "
                            "checkpoint (deploy.weights: calibrated), or hardware with FP8")
        kw["quantization"] = "fp8"  # vLLM quantises the bf16 weights to FP8 as it loads them
    if lora_ranks:
        top = max(lora_ranks)
        kw.update(enable_lora=True, max_loras=knobs["max_loras"],
                  max_cpu_loras=cpu_loras(knobs["max_loras"], max_cpu_loras),
                  max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= top))
    return kw


def llm_config(model_id: str, source: str | dict, plan: dict, kwargs: dict, deploy: DeploySection,
               lora_uri: str | None, lora: bool, device: str = "gpu") -> dict:
    """One LLMConfig mapping (validated later against Ray's model).

    Args:
        device: "gpu", or "cpu" (vLLM's CPU build: Ray Serve LLM's CPU accelerator, one
            CPU per vLLM worker, vLLM's multiprocessing executor).
    """
    cfg: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id, "model_source": source},
        "engine_kwargs": kwargs,
        "deployment_config": {"num_replicas": plan["num_replicas"],
                              "max_ongoing_requests": deploy.max_ongoing_requests},
        # one GPU per vLLM worker; PACK (not STRICT_PACK) lets TP x PP span nodes
        "placement_group_config": {"bundle_per_worker": {"GPU": 1, "CPU": 1}, "strategy": "PACK"},
    }
    if device == "cpu":
        # the CPUs of a CPU host are what vLLM's engine processes compute on (one per worker
        # bundle); the replica actor in front of them waits on IO, so it reserves none
        cfg["deployment_config"]["ray_actor_options"] = {"num_cpus": 0}
        cfg["accelerator_config"] = {"kind": "cpu"}
        cfg["placement_group_config"] = {"bundle_per_worker": {"CPU": 1}, "strategy": "PACK"}
        cfg["engine_kwargs"] = {k: v for k, v in kwargs.items() if k != "gpu_memory_utilization"}
        if int(kwargs.get("pipeline_parallel_size") or 1) > 1:
            # an eager CPU engine's later pipeline stages lack their receive buffer without it
            # (moeflow.serving.vllm_worker); one given by the caller (a meter) carries the same fix
            cfg["engine_kwargs"].setdefault("worker_extension_cls", PIPELINE_EXTENSION)
        return cfg
    if plan.get("ray_accelerator_type"):
        cfg["accelerator_type"] = plan["ray_accelerator_type"]
    if lora and lora_uri:  # decide_adapters refused LoRA without a cloud lora_uri
        # the adapters Serve's router counts a replica as holding: those its engine keeps in
        # host memory (vLLM's max_cpu_loras), not only the max_loras on the device
        cfg["lora_config"] = {"dynamic_lora_loading_path": lora_uri.rstrip("/"),
                              "max_num_adapters_per_replica": kwargs.get("max_cpu_loras",
                                                                         deploy.max_loras)}
    return cfg


def serve_config(llm_configs: list[dict], dp: bool) -> dict:
    """The Serve config file `serve run` / `serve deploy` / a KubeRay RayService accept.

    With engine data parallelism (`data_parallel_size` > 1) Ray Serve LLM builds one
    app per model (build_dp_openai_app): the base answers on "/", each merged
    adapter on "/<its name>".
    """
    if not dp:
        return {"applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": OPENAI_APP,
                                  "args": {"llm_configs": llm_configs}}]}
    apps = []
    for i, cfg in enumerate(llm_configs):
        mid = cfg["model_loading_config"]["model_id"]
        apps.append({"name": APP_NAME if i == 0 else f"{APP_NAME}-{mid}",
                     "route_prefix": "/" if i == 0 else f"/{mid}", "import_path": DP_OPENAI_APP,
                     "args": {"llm_config": cfg}})
    return {"applications": apps}


def validate_serve_config(config: dict) -> list:
    """Check every application of a Serve config against Ray's LLMConfig model.

    Returns:
        The validated LLMConfig objects.
    Raises:
        UserError: the first invalid field, one line.
    """
    cls = llm_config_class()
    out: list[Any] = []
    ids: set[str] = set()
    for app in config.get("applications") or []:
        args, path = app.get("args") or {}, app.get("import_path")
        if path == OPENAI_APP:
            items = args.get("llm_configs") or []
        elif path == DP_OPENAI_APP:
            items = [args.get("llm_config")]
        else:
            raise UserError(f"application {app.get('name')!r}: import_path {path!r} is not a Ray Serve LLM builder")
        for item in items:
            try:
                obj = cls.model_validate(item)
            except Exception as exc:  # pydantic.ValidationError, or a validator's assertion
                first = str(exc).splitlines()
                raise UserError(f"application {app.get('name')!r}: LLMConfig invalid: "
                                f"{' '.join(first[:3])}") from None
            if obj.model_id in ids:
                raise UserError(f"model id {obj.model_id!r} is served twice")
            ids.add(obj.model_id)
            out.append(obj)
    if not out:
        raise UserError("the Serve config has no LLM application")
    return out


# ------------------------------------------------------------ from a run


def model_source(path: str, stored: Mapping[str, str] | None = None) -> str | dict:
    """Where replicas load the checkpoint at `path`: Ray Serve LLM's cloud mirror
    (`{"bucket_uri": uri}`) when it is a store URI or a local copy of one (`stored`:
    local dir -> URI), else the resolved local path (which every replica's node must see)."""
    if path.startswith(CLOUD_PREFIXES):
        return {"bucket_uri": path.rstrip("/")}
    local = str(Path(path).resolve())
    for copy, uri in (stored or {}).items():
        copy = str(Path(copy).resolve())
        if (local == copy or local.startswith(copy + "/")) and uri.startswith(CLOUD_PREFIXES):
            return {"bucket_uri": (uri.rstrip("/") + local[len(copy):]).rstrip("/")}
    return local


def build(cfg: PipelineConfig, base_dir: str, serving: dict | None, adapters: dict[str, str],
          out_dir: Path, merged_dirs: dict[str, str] | None = None, knobs: dict | None = None,
          merge: str | None = None, stored: Mapping[str, str] | None = None,
          device: str = "gpu") -> dict:
    """The vllm deployment of a run: Serve config, adapter decisions, the plan it applies.

    Args:
        cfg: pipeline config (deploy:, model:).
        base_dir: checkpoint to serve (converted, or calibrated).
        serving: the plan stage's serving record (its "vllm" sub-plan is applied).
        adapters: {name: local PEFT dir} of the run (main + tenants + deploy.adapters).
        out_dir: merged checkpoints go under out_dir/merged/<name>.
        merged_dirs: merged checkpoints that already exist {name: dir} (finetune.merge).
        knobs: engine settings (default: deploy: + its serving.yaml, deployment.engine_settings).
        merge: the adapter served merged whatever its kind (deploy.merge, as decided).
        stored: local dir -> store URI it is (or will be published) at; checkpoints under
            one are loaded by replicas from the store (model_source).
        device: "gpu", or "cpu" for vLLM's CPU build (where the cluster has no GPU).
    Returns:
        {"serve_config", "llm_configs", "adapters": [decisions], "plan", "notes"}.
    """
    plan = (serving or {}).get("vllm")
    if not plan:
        raise UserError("deploy.backend vllm: the run's plan has no vLLM serving sub-plan "
                        "(rerun the plan stage of this version; or nothing fits the hardware)")
    d = cfg.deploy
    decisions = decide_adapters(adapters, plan["enable_expert_parallel"], d.lora_uri, merge=merge)
    if device == "cpu":
        refuse_cpu_lora(base_dir, decisions)
    pinned_notes = refuse_pinned(list(d.pinned_adapters), decisions)  # before any merge or export
    for a in decisions:
        if a.served == "lora" and a.kind == "expert_parameters":
            try:
                # lazy: the export builds the base on the meta device (torch); the driver
                # imports this module to hash the stages' code and must not load torch
                from moeflow.training.adapter_layout import export_per_expert

                a.export = str(export_per_expert(base_dir, a.path, out_dir / "vllm-lora" / a.name).resolve())
            except UserError as exc:  # a family stored fused on disk: no per-expert modules to export to
                a.served, a.uri, a.why = "merged", None, f"no per-expert LoRA layout ({exc})"
    base_id = d.served_model_name or Path(cfg.model.path).name or "model"
    knobs = knobs or engine_settings(cfg)
    quantized = checkpoint_quantized(base_dir)
    lora = [a for a in decisions if a.served == "lora"]
    kwargs = engine_kwargs(plan, knobs, d.dtype, quantized, [a.rank for a in lora],
                           d.gpu_memory_utilization, d.max_cpu_loras)
    configs = [llm_config(base_id, model_source(base_dir, stored), plan, kwargs, d, d.lora_uri, bool(lora),
                          device)]
    no_lora = {k: v for k, v in kwargs.items()
               if k not in ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")}
    for a in decisions:
        if a.served == "merged":
            have = (merged_dirs or {}).get(a.name)
            a.model_source = str(Path(have or merge_adapter(base_dir, a.path, out_dir / "merged" / a.name,
                                                             cfg.model.dtype)).resolve())
            configs.append(llm_config(a.name, model_source(a.model_source, stored), plan, no_lora,
                                      d, None, False, device))
    config = serve_config(configs, plan["data_parallel_size"] > 1)
    if device == "cpu":  # the OpenAI router, like the replicas, reserves no CPU (llm_config)
        for app in config["applications"]:
            app["args"]["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0}}
    validate_serve_config(config)
    notes = [f"{a.name}: served {'as ' + base_id + ':' + a.name if a.served == 'lora' else 'merged as model ' + a.name}"
             f" — {a.why}" for a in decisions] + pinned_notes
    if not plan.get("ray_accelerator_type"):
        notes.append(f"hardware {plan.get('hardware')} names no Ray accelerator label: replicas take any GPU")
    if kwargs.get("quantization"):
        notes.append(f"fp8: {plan.get('why_dtype')}; vLLM quantises the bf16 checkpoint as it loads")
    elif quantized:
        notes.append(f"weights: the checkpoint's own {quantized} quantisation (its quantization_config)")
    return {"serve_config": config, "llm_configs": configs, "plan": plan, "notes": notes,
            "adapters": [asdict(a) for a in decisions],
            "uploads": {a.export or a.path: a.uri for a in lora}}


def build_run(cfg: PipelineConfig, dep: Deployment, serving: dict | None, out_dir: Path,
              stored: Mapping[str, str] | None = None, device: str = "gpu") -> dict:
    """`build` for a decided deployment (moeflow.serving.deployment.decide): its checkpoint,
    adapters, merge and lora_uri (deploy.lora_uri, else where the run published its adapters).

    Args:
        cfg: pipeline config, serving.yaml already applied (deployment.apply_serving).
    """
    cfg = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"lora_uri": dep.lora_uri})})
    return build(cfg, dep.checkpoint, serving, dict(dep.adapters), out_dir, dict(dep.merged_dirs),
                 merge=dep.merge, stored=stored, device=device)


def upload_merged(built: dict, out_dir: Path, out_uri: str) -> list[str]:
    """Publish the merged checkpoints `build` wrote under `out_dir` to their place under
    `out_uri` (the stage's output in the store), so replicas started before the stage's own
    publish find them there; returns the URIs published."""
    from moeflow.core.storage import publish  # fsspec / s3fs: only with a store workdir

    root, done = out_dir.resolve(), []
    for a in built["adapters"]:
        src = Path(a["model_source"]).resolve() if a.get("model_source") else None
        if src is not None and src.is_relative_to(root):
            done.append(f"{out_uri.rstrip('/')}/{src.relative_to(root).as_posix()}")
            publish(src, done[-1])
    return done


def write_config(config: dict, path: Path) -> Path:
    """Write the Serve config YAML atomically (temp, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)
    return path


def start(config: dict, device: str, host: str, port: int, wait_s: float = 600.0, tight: bool = False) -> str:
    """Run the application on the connected Ray, its processes in the vLLM environment
    (moeflow.serving.vllm_run); the HTTP base URL once every application runs. `tight`: the
    vLLM plan's "tight_cpu" (vllm_run.TIGHT_ENV in the workers).

    The runtime_env (the vLLM venv's python) is added here, not in the written Serve config:
    a cluster's image brings its own vLLM (`serve deploy` of that file needs none).
    """
    # lazy: vllm_run imports Ray Serve; rendering a Serve config needs neither
    from moeflow.serving import vllm_run

    env = vllm_run.runtime_env(device, tight)
    if device == "cpu":  # one line now, not a replica's failure minutes later
        for app in config["applications"]:
            for llm in app["args"].get("llm_configs") or [app["args"].get("llm_config")]:
                source = llm["model_loading_config"]["model_source"]
                if isinstance(source, str):  # a local dir (a store URI is checked by its replica)
                    vllm_run.check_cpu_head_dim(source)
                    # lazy: reading the release's formats loads torch; only a CPU deploy asks
                    from moeflow.training.merge_vllm import vllm_cpu_refusal

                    why = vllm_cpu_refusal(source, vllm_run.vllm_python() or "python")
                    if why:  # quantised routed experts vLLM's CPU kernels cannot run here
                        raise UserError(why)
    apps = [{**app, "runtime_env": vllm_run.app_runtime_env(env, app, device)} for app in config["applications"]]
    return vllm_run.deploy_config({"applications": apps}, host=host, port=port, wait_s=wait_s)


def serve_and_smoke(cfg: PipelineConfig, built: dict, device: str,
                    notify: Callable[[str], Any] = print) -> dict:
    """Start a built deployment on the connected Ray and smoke-test every served model over
    HTTP, as the local backend does; {"url", "models", "smoke", "device"}."""
    # lazy: launch imports the local engine (torch); only a started deployment is smoke-tested
    from moeflow.serving.launch import pick_port, smoke_test

    d = cfg.deploy
    url = start(built["serve_config"], device, d.host, pick_port(cfg, notify),
                tight=bool(built["plan"].get("tight_cpu")))
    smoke = smoke_test(url, None, d.smoke_max_tokens, metric=None)
    return {"url": url, "models": [m["id"] for m in smoke["models"]], "smoke": smoke, "device": device}
