"""Stage `serving` (step 5): pick engine settings for the traffic users will send.

    moeflow run configs/demo.yaml --only serving     # after convert..regress are cached
    moeflow tune-serving configs/demo.yaml            # the same, as its own command

With deploy.backend vllm (or auto resolved to it by the plan) the candidates are vLLM
engines brought up one at a time through the vllm backend (moeflow/serving/vllm_search.py).

Replays `serving.profile` (a traffic profile: arrivals, prompt/output lengths,
adapter popularity, SLOs) against candidate settings of the deploy: knobs
(max_num_seqs, max_num_batched_tokens, chunked prefill, replicas,
max_ongoing_requests, ...), each deployed for real on Ray Serve, within
`serving.budget_s` (moeflow/serving/tune.py). Writes serving.yaml (the chosen
knobs, which deploy applies), report.json, the table, the plots, and the same
settings as `vllm serve` arguments and a Ray Serve LLM config.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from moeflow.core.devices import gpus_per_worker
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.core.sections.deploy import DeploySection
from moeflow.parallel.vllm_plan import SEARCH_LOCAL_ONLY
from moeflow.serving.deployment import decide, resolved_backend
from moeflow.serving.launch import settings_for
from moeflow.serving.traffic import load_profile, profile_path
from moeflow.serving.tune_space import ENGINE_KNOBS, KNOBS, engine_fields, make_candidates, memory_limits
from tasks.base import StageContext, StageSpec

if TYPE_CHECKING:
    from moeflow.serving.app import ServeSettings

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def default_knobs(cfg, plan_serving: dict | None) -> dict:
    """What deploy would run without serving.yaml: the deploy: knobs, replicas as deploy picks them."""
    d = cfg.deploy
    knobs = {k: getattr(d, k) for k in KNOBS if k in DeploySection.model_fields}
    knobs["num_replicas"] = d.num_replicas or int((plan_serving or {}).get("num_replicas") or 1)
    return knobs


def search_space(cfg) -> tuple[dict, list[str]]:
    """{knob: values} to search and notes on knobs left out (the engine lacks them)."""
    space, notes = {}, []
    have = engine_fields()
    for key, values in cfg.serving.search.model_dump().items():
        if key in ENGINE_KNOBS and key not in have:
            # said whether or not the search lists it
            notes.append(f"{key}: a knob of neither moeflow's engine (which prefills any number of short "
                         f"prompts per step and limits only long ones, max_long_partial_prefills) nor vLLM 0.29 "
                         f"(its V1 scheduler has no partial-prefill limits); not searched or measured here"
                         f"{' although serving.search lists it' if values else ''}, not rendered")
            continue
        if values:
            space[key] = values
    return space, notes


def _model_facts(base_dir: str, max_model_len: int | None) -> tuple[int, int]:
    """(vocab size, context) of the served model from its config.json."""
    # lazy: transformers: heavy, loaded only when this runs
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(base_dir).get_text_config()
    return int(text.vocab_size), int(max_model_len or text.max_position_embeddings)


def _replica_cpus(cfg, cands) -> float:
    """Ray CPUs per candidate replica so every candidate fits next to this stage."""
    # lazy: ray: heavy, loaded only when this runs
    import ray

    if cfg.serving.replica_cpus:
        return cfg.serving.replica_cpus
    free = ray.available_resources().get("CPU", 1.0)
    total = sum(c.knobs["num_replicas"] for c in cands)
    return max(0.01, min(cfg.deploy.num_cpus, int(100 * free / total) / 100))


def _replica_gpus(cfg, cands) -> float:
    """Ray GPUs per candidate replica: deploy's `num_gpus` (auto: 1 when the cluster has GPUs),
    shared when the candidates' replicas outnumber the free GPUs.

    All candidates are up at once and only one is driven at a time, so candidates sharing a
    GPU are measured alone on it, as each would run once deployed; 0 on a cluster without GPUs.
    """
    # lazy: ray: heavy, loaded only when this runs
    import ray


    want = gpus_per_worker(cfg.deploy.num_gpus)
    if want <= 0:
        return 0.0
    free = ray.available_resources().get("GPU", 0.0)
    total = sum(c.knobs["num_replicas"] for c in cands)
    share = int(100 * free / total) / 100  # Ray accepts GPU fractions in hundredths
    if share <= 0:
        raise UserError(f"serving: {total} candidate replica(s) need a GPU each (deploy.num_gpus "
                        f"{cfg.deploy.num_gpus}) but the cluster has {free:g} free; lower "
                        f"serving.max_candidates, or set deploy.num_gpus: 0 to tune on CPUs")
    return min(want, share)


def _settings(ctx: StageContext) -> ServeSettings:
    """ServeSettings as deploy builds them for the local engine, on the converted checkpoint
    (serve.yaml of an earlier run not applied), with the operators stage's experts
    implementation when that stage is part of the pipeline."""
    from moeflow.serving.app import api_key_from_env  # imports the engine (torch)

    deploy_ = ctx.config.deploy.model_copy(update={"serving_config": None, "weights": "converted"})
    cfg = ctx.config.model_copy(update={"deploy": deploy_})
    dep = decide(cfg, {"convert": ctx.input("convert"), "finetune": ctx.input("finetune"),
                       "operators": ctx.inputs.get("operators")}, backend="local")
    return settings_for(cfg, dep, api_key_from_env(cfg.deploy.api_key_env), stored=ctx.stored)


def tune(ctx: StageContext) -> dict:
    """Deploy the candidates, run the search; the outcome and what describes it."""
    # lazy: loads numpy, which importing this module does not
    from moeflow.serving.tune import Budget, Candidate, Driver, Harness, search, warm_up

    budget = Budget(ctx.config.serving.budget_s)
    cfg, sec = ctx.config, ctx.config.serving
    profile = load_profile(profile_path(sec.profile))
    settings = _settings(ctx)
    plan = (ctx.inputs.get("plan", {}).get("plan") or {}).get("serving") or {}
    vocab, context = _model_facts(settings.base_dir, cfg.deploy.max_model_len)
    hw = load_hardware(cfg.hardware.spec, cfg.hardware.nodes)

    # the local engine keeps its KV cache in the compute dtype; auto: bf16 on GPU replicas, fp32 on CPU
    on_gpu = gpus_per_worker(cfg.deploy.num_gpus) > 0
    dtype = _DTYPES[cfg.deploy.dtype] if cfg.deploy.dtype != "auto" else ("bf16" if on_gpu else "fp32")
    limits = memory_limits(settings.base_dir, hw, plan, context, dtype, dtype)
    space, notes = search_space(cfg)
    default = default_knobs(cfg, plan)
    knobs = make_candidates(space, default, limits, sec.max_candidates, seed=cfg.seed)
    cands = [Candidate("default" if i == 0 else f"c{i}", k) for i, k in enumerate(knobs)]
    limit = sec.budget_s + 600  # the search stops itself; this only catches a wedged replica
    phases = {}  # seconds into the budget at the end of each phase (report.json: where it went)
    gpus = _replica_gpus(cfg, cands)
    with Harness(settings, num_cpus=_replica_cpus(cfg, cands), num_gpus=gpus, ready_timeout_s=limit) as harness:
        harness.deploy(cands)
        phases["deployed"] = _progress(ctx, budget, f"{len(cands)} candidates up "
                                       f"({sum(c.knobs['num_replicas'] for c in cands)} replicas)")
        models = harness.served_models(cands[0])
        driver = Driver(profile, models=models, base=settings.name(), vocab=vocab, max_model_len=context,
                        api_key=settings.api_key)
        warm_up(driver, cands)
        phases["warmed_up"] = _progress(ctx, budget, "warmed up; probing")
        outcome = search(driver, harness, cands, budget, eta=sec.eta, rate_step=sec.rate_step,
                         rate_points=sec.rate_points)
        phases["searched"] = budget.seconds - budget.left()
    phases["torn_down"] = budget.seconds - budget.left()
    facts = {"limits": limits, "notes": notes, "profile": profile, "settings": settings,
             "plan": plan, "context": context, "hw": hw, "budget": budget, "phases": phases,
             "replica_gpus": gpus}
    return {"outcome": outcome, **facts}


def tune_vllm(ctx: StageContext) -> dict:
    """deploy.backend vllm: vLLM candidates brought up one at a time through the vllm backend
    (moeflow/serving/vllm_search.py), measured on the same traffic as the local search."""
    # lazy: Ray Serve, numpy and the vllm backend, loaded only when this runs
    from types import SimpleNamespace

    from moeflow.serving import vllm_run
    from moeflow.serving.app import api_key_from_env, free_port
    from moeflow.serving.tune import Budget, Candidate, Driver
    from moeflow.serving.vllm_search import VllmHarness, candidate_space, search_one_at_a_time

    budget = Budget(ctx.config.serving.budget_s)
    deploy_ = ctx.config.deploy.model_copy(update={"serving_config": None})
    cfg, sec = ctx.config.model_copy(update={"deploy": deploy_}), ctx.config.serving
    profile = load_profile(profile_path(sec.profile))
    dep = decide(cfg, ctx.inputs, backend="vllm")
    serving = (ctx.inputs.get("plan", {}).get("plan") or {}).get("serving") or {}
    if not serving.get("vllm"):
        raise UserError("serving: deploy.backend vllm, but the run's plan has no vLLM serving sub-plan "
                        "(rerun the plan stage of this version; or nothing fits the hardware)")
    plan = serving["vllm"]
    device = vllm_run.cluster_device()
    vocab, context = _model_facts(dep.checkpoint, cfg.deploy.max_model_len)
    hw = load_hardware(cfg.hardware.spec, cfg.hardware.nodes)
    dtype = _DTYPES[cfg.deploy.dtype] if cfg.deploy.dtype != "auto" else ("bf16" if device == "gpu" else "fp32")
    limits = memory_limits(dep.checkpoint, hw, plan, context, dtype, dtype)
    local_space, notes = search_space(cfg)
    default = default_knobs(cfg, {"num_replicas": plan.get("num_replicas")})
    knobs = make_candidates(candidate_space(local_space), default, limits, sec.max_candidates, seed=cfg.seed)
    cands = [Candidate("default" if i == 0 else f"c{i}", k) for i, k in enumerate(knobs)]
    api_key = api_key_from_env(cfg.deploy.api_key_env)
    base = cfg.deploy.served_model_name or Path(cfg.model.path).name or "model"

    def make_driver(models: list[str]) -> Driver:
        return Driver(profile, models=models, base=base, vocab=vocab, max_model_len=context, api_key=api_key)

    phases: dict[str, float] = {}
    with VllmHarness(cfg, dep, serving, Path(ctx.out_dir) / "candidates", device,
                     host="127.0.0.1", port=free_port(), ready_timeout_s=sec.budget_s + 600) as harness:
        outcome, _ = search_one_at_a_time(make_driver, harness, cands, budget, rate_step=sec.rate_step,
                                          rate_points=sec.rate_points)
        phases["searched"] = budget.seconds - budget.left()
    phases["torn_down"] = budget.seconds - budget.left()
    notes.append(f"vLLM candidates on {device}, started one at a time: "
                 + ", ".join(f"{s:.0f} s" for s in harness.up_s))
    # what write_outputs reads of the local search's ServeSettings
    served = SimpleNamespace(base_dir=dep.checkpoint, adapters=dict(dep.adapters), merge=dep.merge,
                             experts_implementation="vllm", name=lambda: base)
    return {"outcome": outcome, "limits": limits, "notes": notes, "profile": profile, "settings": served,
            "plan": plan, "context": context, "hw": hw, "budget": budget, "phases": phases,
            "replica_gpus": 1.0 if device == "gpu" else 0.0, "backend": "vllm"}


def _progress(ctx: StageContext, budget, what: str) -> float:
    """A progress line on the terminal; returns the seconds spent so far."""
    spent = budget.seconds - budget.left()
    ctx.note(f"{spent:5.1f} s  {what}")
    return round(spent, 2)


def _summary(c, slo_pct: float) -> dict:
    run = c.final or c.probe
    return {"name": c.name, "config": c.knobs, "goodput_rps": run["request_goodput"],
            "slo_attainment": run["slo_attainment"], "p99_ttft_ms": run["p99_ttft_ms"],
            "p99_tpot_ms": run["p99_tpot_ms"], "p99_e2el_ms": run["p99_e2el_ms"],
            f"p{slo_pct:g}_ttft_ms": run[f"p{slo_pct:g}_ttft_ms"], "max_rate_rps": c.max_rate}


def write_outputs(ctx: StageContext, t: dict) -> dict:
    """serving.yaml, report.json, table, renderings, plots under out_dir; returns their paths."""
    # lazy: loads numpy, which importing this module does not
    from moeflow.serving import render

    o, profile, settings, plan = t["outcome"], t["profile"], t["settings"], t["plan"]
    out = Path(ctx.out_dir)
    rate = profile.arrivals.rate
    slo = dict(profile.slo.model_dump(), rate_rps=rate)
    report = {"slo": slo, "profile": profile.name, "message": o.message, "slo_met": o.slo_met,
              "default": _summary(o.default, profile.slo.percentile),
              "chosen": _summary(o.chosen, profile.slo.percentile),
              "candidates": [c.as_dict() for c in o.candidates],
              "limits": {"max_num_seqs": t["limits"].max_num_seqs, "max_replicas": t["limits"].max_replicas,
                         "why": t["limits"].why},
              "notes": t["notes"], "probe_s": o.unit_s,
              # what every candidate loaded with: the operators stage's choice, else transformers' default
              "experts_implementation": settings.experts_implementation or "grouped_mm",
              "budget_s": ctx.config.serving.budget_s,
              "elapsed_s": ctx.config.serving.budget_s - t["budget"].left(), "over_budget": o.over_budget,
              "phases_s": t["phases"], "replica_gpus": t.get("replica_gpus", 0.0),
              "backend": t.get("backend", "local")}
    g_def = o.default.final["request_goodput"]
    report["goodput_ratio"] = o.chosen.final["request_goodput"] / g_def if g_def else None
    title = f"serving search: {profile.name} at {rate:g} req/s, SLO {_slo_text(profile)}"
    table = render.table_text(o.candidates, o.chosen, title) + o.message + "\n" + "".join(
        f"note: {n}\n" for n in t["notes"])
    lora = ctx.config.lora.rank if settings.adapters and not settings.merge else None
    common = dict(model=settings.base_dir, served_name=settings.name(), max_model_len=t["context"],
                  lora_rank=lora, max_loras=ctx.config.deploy.max_loras, plan=plan,
                  max_cpu_loras=ctx.config.deploy.max_cpu_loras)
    files = {
        "serving.yaml": render.serving_yaml(o.chosen.knobs, f"moeflow serving stage, run {ctx.mlflow_run_id}\n"
                                            f"{o.message}"),
        "vllm_serve_args.txt": render.vllm_args(o.chosen.knobs, adapters=settings.adapters, **common) + "\n",
        "ray_serve_llm.yaml": yaml.safe_dump(render.ray_llm_config(o.chosen.knobs, **common), sort_keys=False),
        "table.txt": table,
    }
    for name, text in files.items():
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    ctx.write_json("report.json", report)
    finalists = [c for c in o.candidates if c.final]
    figs = {"goodput_vs_rate.png": render.plot_rates(finalists, out / "goodput_vs_rate.png", rate),
            "latency_cdf.png": render.plot_cdfs(finalists, out / "latency_cdf.png", profile.slo.limits())}
    return {"report": report, "table": table, "files": files, "figs": figs}


def _slo_text(profile) -> str:
    limits = ", ".join(f"{k} <= {v:g} ms" for k, v in profile.slo.limits().items())
    return f"{limits} for {profile.slo.percentile:g}% of requests"


def _log_mlflow(outputs: dict, out: Path) -> None:
    # lazy: matplotlib, mlflow: heavy, loaded only when this runs
    import matplotlib.pyplot as plt
    import mlflow

    figs = outputs["figs"]
    if mlflow.active_run() is None:
        for fig in figs.values():
            plt.close(fig)
        return
    report = outputs["report"]
    chosen, default = report["chosen"], report["default"]
    mlflow.log_params({f"chosen.{k}": v for k, v in chosen["config"].items()})
    mlflow.log_param("experts_implementation", report["experts_implementation"])
    mlflow.log_metrics({"goodput_rps": chosen["goodput_rps"], "default_goodput_rps": default["goodput_rps"],
                        "slo_attainment": chosen["slo_attainment"], "p99_ttft_ms": chosen["p99_ttft_ms"],
                        "p99_tpot_ms": chosen["p99_tpot_ms"], "p99_e2el_ms": chosen["p99_e2el_ms"],
                        "slo_met": float(report["slo_met"]), "search_s": report["elapsed_s"]})
    if report.get("goodput_ratio") is not None:
        mlflow.log_metric("goodput_ratio_vs_default", report["goodput_ratio"])
    mlflow.set_tag("moeflow.serving.result", report["message"][:4000])
    for name in ("serving.yaml", "report.json", "table.txt", "vllm_serve_args.txt", "ray_serve_llm.yaml"):
        mlflow.log_artifact(str(out / name), "serving")
    for name, fig in figs.items():
        mlflow.log_figure(fig, f"serving/{name}")
        plt.close(fig)


def _refuse_too_large(ctx: StageContext) -> None:
    """Before any candidate starts: the plan found the model larger than one device."""
    s = ((ctx.inputs.get("plan") or {}).get("plan") or {}).get("serving") or {}
    if s.get("local_fits") is False:
        raise UserError(f"serving: one replica needs {s['local_memory_gb']:,.1f} GB on one device, over "
                        f"{s['device_gb']:g} GB: {SEARCH_LOCAL_ONLY}")


def run(ctx: StageContext) -> dict:
    """Tune the serving knobs on the traffic profile; write serving.yaml for deploy.

    Returns:
        {"serving_yaml", "report_path", "chosen": {deploy knob: value}, "goodput_rps",
         "default_goodput_rps", "slo_met", "message"}
    """
    # lazy: ray: heavy, loaded only when this runs; loads numpy, which importing this module does not
    import ray

    from moeflow.serving.render import deploy_knobs

    backend = resolved_backend(ctx.config, ctx.inputs)
    if backend == "local":
        _refuse_too_large(ctx)
    if not ray.is_initialized():
        raise UserError("the serving stage needs a Ray runtime (run it through `moeflow run` or "
                        "`moeflow tune-serving`)")
    regress = ctx.inputs.get("regress")
    if regress is not None and regress.get("passed") is False:
        raise UserError("serving: the regress stage did not pass; refusing to tune its deployment")
    outputs = write_outputs(ctx, tune_vllm(ctx) if backend == "vllm" else tune(ctx))
    _log_mlflow(outputs, Path(ctx.out_dir))
    print(outputs["table"], flush=True)
    report = outputs["report"]
    return {"serving_yaml": str(Path(ctx.out_dir) / "serving.yaml"),
            "report_path": str(Path(ctx.out_dir) / "report.json"),
            "chosen": deploy_knobs(report["chosen"]["config"]),
            "goodput_rps": round(report["chosen"]["goodput_rps"], 3),
            "default_goodput_rps": round(report["default"]["goodput_rps"], 3),
            "slo_met": report["slo_met"], "message": report["message"]}


def _preflight(cfg) -> None:
    """A malformed or missing profile fails before anything runs (one line naming the key)."""

    load_profile(profile_path(cfg.serving.profile))


STAGE = StageSpec(
    name="serving", run=run, upstream=("convert", "plan", "finetune", "regress"),
    after=("operators",),  # candidates load with its experts kernel, as deploy will
    sections=("model", "deploy", "lora", "serving", "hardware"), num_cpus=0.5,
    fingerprint=("model.path", "serving.profile", "hardware.spec"),
    preflight=_preflight,
    description="replay a traffic profile against candidate engine settings on Ray Serve; "
                "pick the best goodput within the latency SLOs (serving.yaml)",
)
