"""`moeflow run CONFIG --dry-run [--json]`: every stage priced before anything runs.

Gathers what the estimator needs without weights or Ray (the model from config.json or
`plan.architecture` on the meta device, the planner's LoRA and serving plans, the checkpoint's
and data files' sizes, the traffic profile), prices every enabled stage (moeflow/parallel/estimate.py),
prints the table, and records it as an MLflow run tagged `moeflow.kind=dryrun` (`dryrun.json`,
`dryrun.txt`, `config.yaml`; the totals and `<stage>.est_seconds` as metrics), so two dry runs
compare in the UI. Exit 0, or 1 when a check says a real run would fail; exit 2 (nothing
priced) when a stage needs more memory per device than the spec's device has.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from moeflow.core.config import PipelineConfig, to_yaml
from moeflow.core.errors import UserError
from moeflow.core.hardware import load_hardware
from moeflow.evaluation.suite import load_suite
from moeflow.model.params import count_params, load_config_json, spec_from_path
from moeflow.parallel.estimate import ANCHOR_HOST, ESTIMATORS, Check, Inputs, PipelineEstimate, estimate, probe_host
from moeflow.parallel.memory import DTYPE_BYTES, human, lora_numel, lora_targets, weight_bytes
from moeflow.parallel.planner import evaluate, infeasible_message, plan_with_degrees
from moeflow.parallel.workload import plan_source, serving_inputs, workload_from_config
from moeflow.serving.traffic import load_profile, profile_path
from workflows.dag import registry
from workflows.printer import styled

SAMPLE_BYTES = 8 << 20  # a data file is tokenised on its first 8 MB, then scaled to its size
KIND = "dryrun"


def dry_run(cfg: PipelineConfig) -> tuple[PipelineEstimate, Inputs]:
    """Price the pipeline `cfg` describes. Raises UserError on bad input (exit 2)."""
    # lazy: loads mlflow, ray, which importing this module does not
    from workflows.selection import select, with_plugins

    stages = with_plugins(registry(), cfg)
    order, _, _ = select(stages, cfg)
    inp = gather(cfg, {n: stages[n] for n in order})
    return estimate(inp), inp


def gather(cfg: PipelineConfig, stage_specs: dict[str, Any]) -> Inputs:
    """Everything the estimator reads: plans, sizes, data, profile, free space."""

    src = plan_source(cfg)
    spec = spec_from_path(src)  # builds the model on the meta device (moeflow/model/anatomy.py)
    hw = load_hardware(cfg.hardware.spec, cfg.hardware.nodes)
    counts = count_params(spec)
    start = time.perf_counter()  # the searches the plan stage repeats (its imports are warm)
    lora, work, planned_checks = _lora_plan(cfg, spec, hw, counts)
    serve = serving_inputs(cfg, spec, hw, replace(_workload(cfg), mode="inference"))
    plan_seconds = time.perf_counter() - start
    load = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[cfg.model.dtype]
    src_bytes, src_basis = _checkpoint_bytes(cfg, counts, load_config_json(src))
    inp = Inputs(
        cfg=cfg, hw=hw, spec=spec, counts=counts, stage_specs=stage_specs, lora=lora,
        lora_work=work, serve=serve, src_bytes=src_bytes, src_basis=src_basis,
        converted_bytes=weight_bytes(counts.by_kind, load),
        quantised_bytes=weight_bytes(counts.by_kind, _quant_dtype(cfg.calibrate.scheme)),
        adapter_bytes=4 * _lora_numel(spec, cfg), plan_seconds=plan_seconds,
        suite=_suite(cfg), data=_data(cfg), profile=_profile(cfg),
        storage_free=_free_space(cfg, hw), plan_checks=planned_checks,
        host_probe_s=probe_host() if hw.name == ANCHOR_HOST else None)
    return inp


def _lora_plan(cfg, spec, hw, counts):
    """The plan stage's LoRA plan, re-evaluated at finetune's own micro-batch and recompute."""

    work = _workload(cfg)
    if work.mode != "lora":
        return None, None, []
    result = plan_with_degrees(spec, hw, work, cfg.parallel.degrees(), cfg.plan.runtime,
                               policy=cfg.plan.explicit)
    if result.best is None:
        return None, work, [Check("plan", "fail", infeasible_message(result))]
    ft = cfg.finetune
    ft_work = replace(result.work, micro_batch=ft.micro_batch_size, grad_accum=ft.grad_accum,
                      recompute=ft.gradient_checkpointing)
    cand = evaluate(spec, hw, result.best.plan, ft_work, cfg.plan.runtime, counts)
    notes = [Check("plan", "ok", f"{result.best.label()} on {hw.world_size} devices"
                   + (f"; {result.notes[0]}" if result.notes else ""))]
    return cand, ft_work, notes


def _workload(cfg):
    """The plan's workload, a calibrated checkpoint's dtype from its scheme (deploy.weights)."""
    return workload_from_config(cfg, _quant_dtype(cfg.calibrate.scheme)
                                if cfg.deploy.weights == "calibrated" else None)


def _checkpoint_bytes(cfg, counts, raw: dict) -> tuple[float, str]:
    """The source checkpoint's size: its safetensors files when present, else params x dtype."""

    path = Path(cfg.model.path)
    files = list(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        return float(sum(f.stat().st_size for f in files)), "its files"
    text = raw.get("text_config") or {}
    dtype = (cfg.estimate.source_dtype or raw.get("torch_dtype") or raw.get("dtype")
             or text.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise UserError(f"estimate.source_dtype: unknown dtype {dtype!r}; known: "
                        f"{', '.join(sorted(DTYPE_BYTES))}")
    return float(weight_bytes(counts.by_kind, dtype)), f"absent: params x {dtype}"


def _quant_dtype(scheme: str) -> str:
    # lazy: loads torch, which importing this module does not
    from moeflow.quant.schemes import get_scheme

    return get_scheme(scheme).storage_dtype


def _lora_numel(spec, cfg) -> float:
    return float(sum(lora_numel(t, cfg.lora.rank) for t in lora_targets(spec, cfg.lora.target_modules)))


def _suite(cfg) -> dict[str, float]:
    """Records and (text bytes / bytes_per_token) tokens of the regress suite, and the passes a
    generation over it takes."""

    suite = load_suite(cfg.regress.suite)
    per = cfg.estimate.bytes_per_token
    records = sum(len(t.records) for t in suite.tasks)
    # a record's text, not where its image lies: an image's path is resolved against the checkout
    # and would make the price depend on the directory the repository was cloned into
    prompt = sum(len(json.dumps({k: v for k, v in r.items() if k != "image_path"})) / per
                 for t in suite.tasks for r in t.records)
    gen = sum(len(t.records) * t.spec.max_new_tokens for t in suite.tasks)
    # a layer-streamed regress reads every layer once per pass, and a pass is one call over a
    # task's records (moeflow/evaluation/streamed_runner.py): one per scoring task, one per
    # generated token of a generation task (recomputed); image tasks it skips
    passes = sum(t.spec.max_new_tokens if t.spec.type == "generation" else 0 if t.spec.type == "multimodal"
                 else 1 for t in suite.tasks if t.records)
    return {"records": records, "prompt_tokens": prompt, "gen_tokens": gen, "streamed_passes": passes}


def _data(cfg) -> list[dict[str, Any]]:
    """Each adapter's training file: its tokens (tokenizer, else bytes) and max_steps."""
    ft = cfg.finetune
    items = [("main", cfg.data.train_file, ft.max_steps)]
    items += [(n, a.train_file, a.max_steps or ft.max_steps) for n, a in ft.adapters.items()]
    tok = _tokenizer(cfg.model.path)
    out = []
    for name, path, steps in items:
        row = {"name": name, "path": path, "max_steps": steps, "tokens": None}
        if not path:
            row["basis"] = "data.train_file not set"
        elif not Path(path).is_file():
            row["basis"] = "not found here"
        else:
            row["tokens"], row["basis"] = count_tokens(Path(path), tok, cfg.estimate.bytes_per_token)
        out.append(row)
    return out


def _tokenizer(model_path: str):
    """The checkpoint's fast tokenizer (tokenizers alone: no transformers import), or None."""
    file = Path(model_path) / "tokenizer.json"
    if not file.is_file():
        return None
    # lazy: tokenizers: heavy, loaded only when this runs
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _texts(obj: Any) -> list[str]:
    """The text a record trains on: prompt/completion/text, or the messages' contents."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, list):
        return [s for item in obj for s in _texts(item)]
    if isinstance(obj, dict):
        keys = [k for k in ("prompt", "completion", "text", "content", "messages") if k in obj]
        return [s for k in keys for s in _texts(obj[k])]
    return []


def count_tokens(path: Path, tokenizer, bytes_per_token: float) -> tuple[float, str]:
    """Tokens of a JSONL file: its first SAMPLE_BYTES tokenised, scaled to the file's size."""
    size = path.stat().st_size
    if tokenizer is None:
        return size / bytes_per_token, f"no tokenizer here: {bytes_per_token:g} bytes per token"
    with path.open("rb") as fh:
        head = fh.read(SAMPLE_BYTES)
    lines = head.splitlines()
    if len(head) == SAMPLE_BYTES and len(lines) > 1:
        lines = lines[:-1]  # a cut last line
    used = sum(len(line) + 1 for line in lines)
    texts = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                texts.extend(_texts(json.loads(line)))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{i}: not a JSON line") from None
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    if used >= size:
        return float(tokens), "tokenizer"
    return tokens * size / max(1, used), f"tokenizer on the first {used >> 20} MB, scaled"


def _profile(cfg) -> dict[str, Any] | None:
    """Rate, burst, SLOs and mean lengths (sampled) of the serving stage's traffic profile."""


    if not cfg.serving.profile:
        return None
    prof = load_profile(profile_path(cfg.serving.profile))
    rng = random.Random(0)
    total = sum(c.share for c in prof.mix)
    out_len = sum(c.share / total * sum(c.output_len.draw(rng) for _ in range(100)) / 100
                  for c in prof.mix)
    return {"name": prof.name, "rate": prof.arrivals.rate, "burst_size": prof.arrivals.burst_size,
            "ttft_ms": prof.slo.ttft_ms, "tpot_ms": prof.slo.tpot_ms, "mean_output": out_len}


def _free_space(cfg, hw) -> tuple[float | None, str]:
    """Free space for the outputs: estimate.storage_free_gb, the spec's store, else the local
    filesystem holding workdir (where a local run writes)."""
    if cfg.estimate.storage_free_gb is not None:
        return cfg.estimate.storage_free_gb * 1e9, "estimate.storage_free_gb"
    if hw.storage_free_tb is not None:
        return hw.storage_free_tb * 1e12, f"{hw.name} storage_free_tb"
    if "://" in cfg.workdir:
        return None, f"workdir {cfg.workdir} is remote"
    where = Path(cfg.workdir).resolve()
    while not where.exists():
        where = where.parent
    return float(shutil.disk_usage(where).free), f"local disk at {where}"


# ------------------------------------------------------------ output


def fmt_s(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:,.2f}"


def tables(est: PipelineEstimate, inp: Inputs) -> list[Any]:
    """Time and cost per stage, where each runs with its memory and bytes, the critical path,
    the checks and the assumptions, as rich renderables (each under 100 columns)."""

    hw, price, d = inp.hw, est.price, est.as_dict()
    head = (f"dry run: {inp.cfg.name} on {hw.describe()}\n{est.world} devices; model "
            f"{inp.counts.total / 1e9:,.1f}B params, {inp.counts.active / 1e9:,.1f}B active")
    t = Table(title=head, title_justify="left")
    for col in ("stage", "devices", "time", "device-h", "cost", "basis (largest term)"):
        t.add_column(col, justify="right" if col in ("devices", "time", "device-h", "cost")
                     else "left", overflow="fold")
    for s in est.stages:
        t.add_row(s.name, str(s.devices), fmt_s(s.seconds), f"{s.device_hours:,.2f}",
                  _money(None if price is None else s.device_hours * price), s.basis())
    t.add_section()
    t.add_row("pipeline", "", fmt_s(est.wall_s), f"{est.device_hours:,.2f}", _money(d["cost"]),
              "critical path + pipeline overhead")
    t.add_row("booked", str(est.world), fmt_s(est.wall_s), f"{est.booked_device_hours:,.2f}",
              _money(d["booked_cost"]), "every device for the whole run")
    w = Table(title="where each stage runs", title_justify="left", width=100)
    for col in ("stage", "nodes", "mem/device", "read", "written", "placement (Ray)"):
        w.add_column(col, justify="right" if col in ("nodes", "mem/device", "read", "written")
                     else "left", overflow="fold")
    for s in est.stages:
        w.add_row(s.name, str(s.nodes), human(s.memory_per_device) if s.memory_per_device else "-",
                  human(s.bytes_read), human(s.bytes_written), s.placement)
    return [t, _path_line(est), w, _checks_table(est), _assumptions_table(est)]


def _path_line(est: PipelineEstimate) -> str:
    secs = {s.name: s.seconds for s in est.stages}
    side = ""
    if "finetune" in secs and "calibrate" in secs:
        side = (f"  (finetune {fmt_s(secs['finetune'])} and calibrate "
                f"{fmt_s(secs['calibrate'])} run side by side)")
    return "critical path: " + " -> ".join(est.critical_path) + side


def _checks_table(est: PipelineEstimate):
    t = Table(title="checks (what a real run would find late)", title_justify="left", width=100)
    t.add_column("check")
    t.add_column("", justify="left")
    t.add_column("finding", overflow="fold")
    for c in est.checks:
        mark = styled(*{"ok": ("ok", None), "warn": ("warn", "yellow"), "fail": ("FAIL", "red")}[c.status])
        t.add_row(c.name, mark, c.message)
    return t


def _assumptions_table(est: PipelineEstimate):
    t = Table(title="assumptions (override under estimate:)", title_justify="left")
    t.add_column("figure")
    t.add_column("value and basis", overflow="fold")
    for k, v in est.assumptions.items():
        t.add_row(k, v)
    return t


def render_text(est: PipelineEstimate, inp: Inputs, width: int = 100, parts: int | None = None) -> str:
    """The tables as plain text (`parts`: only the first ones: the stage table, the critical path)."""
    console = Console(record=True, width=width, file=open("/dev/null", "w"), highlight=False, markup=False)
    for part in tables(est, inp)[:parts]:
        console.print(part)
    return console.export_text()


REFUSED = "the dry run refuses what cannot run"


def refusal(est: PipelineEstimate) -> str:
    """What a refused dry run says (exit 2): one line per stage that cannot run as planned."""
    return REFUSED + ":\n" + "\n".join(c.message for c in est.refused)


def record(est: PipelineEstimate, inp: Inputs, text: str) -> tuple[str, str]:
    """The dry run as an MLflow run (tag moeflow.kind=dryrun): returns (tracking uri, run id)."""
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.entities import Metric, Param

    from moeflow.core import tracking as T

    cfg = inp.cfg
    uri = T.resolve_tracking_uri(cfg.tracking.uri)
    client = T.client_for(uri)
    exp = T.experiment_id(client, cfg.experiment, T.artifact_root_for(uri, cfg.tracking.artifact_root))
    run = client.create_run(exp, run_name=f"{cfg.name} (dry run)",
                            tags={T.KIND: KIND, "moeflow.config_name": cfg.name})
    rid, now = run.info.run_id, int(time.time() * 1000)
    d = est.as_dict()
    metrics = {"wall_s": est.wall_s, "device_hours": est.device_hours,
               "booked_device_hours": est.booked_device_hours, "world": est.world}
    if est.price is not None:
        metrics.update(cost=d["cost"], booked_cost=d["booked_cost"])
    for s in est.stages:
        metrics.update({f"{s.name}.est_seconds": s.seconds, f"{s.name}.device_hours": s.device_hours,
                        f"{s.name}.memory_per_device_gb": s.memory_per_device / 1e9})
    params = {"hardware": inp.hw.name, "model": str(cfg.model.path), "critical_path":
              " -> ".join(est.critical_path), "checks_failed": str(len(est.failed))}
    client.log_batch(rid, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                     params=[Param(k, v[:6000]) for k, v in params.items()])
    client.log_text(rid, json.dumps(d, indent=2), "dryrun.json")
    client.log_text(rid, text, "dryrun.txt")
    client.log_text(rid, to_yaml(cfg), "config.yaml")
    client.set_terminated(rid, "FINISHED")
    return uri, rid


def for_run(cfg: PipelineConfig, stage_specs: dict[str, Any]) -> PipelineEstimate | None:
    """The estimate of the stages a pipeline run is about to execute (the runner records it
    beside what they measure); None when none of them has an estimate model (plugins only)."""
    if not set(stage_specs) & set(ESTIMATORS):
        return None
    return estimate(gather(cfg, stage_specs))


def main(cfg: PipelineConfig, console, as_json: bool) -> int:
    """`moeflow run --dry-run`: print, record, and return the exit code (1: a check failed).

    Raises:
        UserError: (exit 2) a stage needs more memory per device than the spec's device: one
            line per such stage naming what it needs and the setting that fixes it; nothing
            is priced (`--json`: the same lines as {"error", "refused"} on stdout, exit 2).
    """
    est, inp = dry_run(cfg)
    if est.refused:
        if as_json:
            print(json.dumps({"error": REFUSED, "exit_code": 2,
                              "refused": [{"check": c.name, "stage": c.name.split(".", 1)[1],
                                           "message": c.message} for c in est.refused]}, indent=2))
            return 2
        raise UserError(refusal(est))
    text = render_text(est, inp)
    uri, rid = record(est, inp, text)
    if as_json:
        print(json.dumps({**est.as_dict(), "mlflow": {"tracking_uri": uri, "run_id": rid}}, indent=2))
    else:
        for part in tables(est, inp):
            console.print(part)
        console.print(f"MLflow: {uri}  dry run {rid} (dryrun.json, dryrun.txt)")
    return 1 if est.failed else 0
