"""Family matrix: every MoE model type of the installed transformers through the
whole pipeline (convert -> plan -> finetune -> regress -> deploy smoke).

For each model type (moeflow_testing.tiny_auto.moe_model_types) a tiny config is
derived from the family's own default config, a random checkpoint is written
in the real layout by `save_pretrained` (bf16, sharded, with a tokenizer), and
configs/demo.yaml, pointed at it and cut to a few training steps, drives the
stages. Two modes:

- default (fast, in-process): each stage's own code without Ray processes —
  convert_checkpoint (with its verification), tasks.plan.run, the finetune
  preflight + worker setup + training steps of moeflow.training.trainer at
  world size 1, the regress evaluation (moeflow.evaluation, base and
  adapter), and the serving app (Service + OpenAI API, one completion of the
  adapter over HTTP through an ASGI client);
- `--full`: `moeflow run` (`workflows.runner.run_pipeline`) with all eight
  stages as in production — operators, calibrate and serving included — (Ray
  tasks, Ray Train, Ray Serve); minutes per family on a 2-core host. Every
  passing run records the golden suite's baseline in one shared store, as a
  user's store holding the demo's does (regress compares with baselines of its
  own architecture only). `--kinds` picks families covering architecture kinds
  (MLA, hybrid linear attention, sliding window, image-text, shared experts,
  grouped routing), read from each family's config.

The table (family, each stage's result, the reason when not) goes to
docs/families.md and to an MLflow run of its own.

    nice -n 5 .venv/bin/python benchmarks/families.py                 # all types
    .venv/bin/python benchmarks/families.py --families olmoe glm4_moe --out /tmp/f.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("convert", "plan", "finetune", "regress", "deploy")
FULL_STAGES = ("convert", "plan", "operators", "calibrate", "finetune", "regress", "serving", "deploy")
KINDS = ("mla", "hybrid_linear", "sliding_window", "image_text", "shared_experts", "grouped_routing")
# the full mode's cuts: each stage's real path at a size 2 shared cores finish in minutes; the
# gates' thresholds are not the question (random tiny weights), so they are opened
FULL_OVERRIDES = [
    "operators.max_calibration=16", "operators.max_tokens=32", "operators.bench_tokens=64",
    "operators.bench_reps=1", "operators.dispatch=false", "calibrate.samples=8",
    "calibrate.max_tokens=32", "calibrate.min_logits_cosine=0.9", "calibrate.min_top1_agreement=0.5",
    "calibrate.max_plan_steps=2", "calibrate.plan_step=8", "regress.calibrated_max_kl=100",
    "regress.calibrated_min_token_agreement=0", "regress.record_baseline=families",
    "serving.budget_s=30", "serving.max_candidates=1", "serving.rate_points=0"]


# the tiny configs shrink expert groups to one (8 experts), which drops group-limited routing;
# these keep a kind the shrink would lose (DeepSeek-V3: 2 groups of 4, top-1 group)
KEEP_KIND = {"deepseek_v3": {"n_group": 2, "topk_group": 1}}


def kinds(config: dict) -> list[str]:
    """Architecture kinds of a config.json dict (text config included), from its keys."""
    cfgs = [config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]

    def any_key(*keys):
        return any(c.get(k) not in (None, 0, False, [], "") for c in cfgs for k in keys)

    types = {t for c in cfgs for t in (c.get("layer_types") or []) if isinstance(t, str)}
    found = []
    if any_key("kv_lora_rank"):
        found.append("mla")
    if types - {"full_attention", "sliding_attention", "chunked_attention"} or any_key(
            "linear_attn_config", "layers_block_type", "hybrid_override_pattern", "attn_layer_period",
            "linear_num_value_heads", "mamba_d_state"):
        found.append("hybrid_linear")
    if "sliding_attention" in types or any_key("sliding_window"):
        found.append("sliding_window")
    if "vision_config" in config:
        found.append("image_text")
    if any_key("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size",
               "moe_shared_expert_intermediate_size", "moe_num_shared_experts"):
        found.append("shared_experts")
    if any(isinstance(c.get("n_group"), int) and c["n_group"] > 1 for c in cfgs):
        found.append("grouped_routing")
    return found


def matrix_config(model: Path, data: dict, workdir: Path, tracking: str, steps: int,
                  full: bool = False) -> dict:
    """configs/demo.yaml pointed at `model`, cut to `steps` training steps and a
    small eval, no extra tenants; the regress gate compares nothing that a few
    random steps cannot meet (the matrix asks whether each stage works)."""
    from moeflow.core.config import apply_overrides, read_yaml

    raw = read_yaml(REPO / "configs" / "demo.yaml")
    raw["finetune"].pop("adapters", None)
    raw.pop("regress", None)
    return apply_overrides(raw, [
        f"model.path={model}", f"data.train_file={data['train']}", f"data.eval_file={data['eval']}",
        f"workdir={workdir}", f"tracking.uri={tracking}", "experiment=moeflow-families",
        f"finetune.max_steps={steps}", "finetune.checkpoint_every=1000",
        "finetune.max_eval_examples=8", "optimizer.warmup_steps=1", "regress.shards=1",
        "regress.compare_base=false", "regress.target_tasks=[]", "deploy.port=0",
        "deploy.smoke_max_tokens=2"] + (FULL_OVERRIDES if full else [
        # the fast mode's stages only: calibrate's fp8 copy of random tiny weights would be gated
        # by regress, and serving's rate search takes a minute a family
        f"stages.enabled=[{','.join(STAGES)}]"]))


def _reason(text: str | None) -> str:
    line = (text or "").strip().splitlines()
    return (line[-1] if line else "")[:240].replace("|", "/")


def run_family(model_type: str, root: Path, data: dict, tracking: str, steps: int,
               full: bool = False, dtype: str = "bfloat16") -> dict:
    """Build, then run the stages on one family; a row of the matrix."""
    from moeflow.core.config import validate
    from moeflow_testing.tiny import build_debug_model

    row = {"family": model_type, "build": "fail", "reason": "", "seconds": 0.0,
           **{s: "-" for s in (FULL_STAGES if full else STAGES)}}
    start = time.time()
    try:
        model = build_debug_model(model_type, root / "models" / model_type, dtype=dtype,
                                  max_shard_size="200KB", **KEEP_KIND.get(model_type, {}))
        raw = json.loads((model / "config.json").read_text())
        row["architecture"], row["kinds"] = raw["architectures"][0], kinds(raw)
        row["build"] = "ok"
    except Exception as exc:  # the derived tiny config does not build: the row says why
        row["reason"] = f"build: {type(exc).__name__}: {_reason(str(exc))}"
        row["seconds"] = round(time.time() - start, 1)
        return row
    cfg = validate(matrix_config(model, data, root / "runs" / model_type, tracking, steps, full))
    if not full:
        _run_in_process(cfg, root / "runs" / model_type, row, steps)
    else:
        _run_pipeline(cfg, row)
    row["reason"] = row["reason"].replace(str(root), "<workdir>")
    row["seconds"] = round(time.time() - start, 1)
    return row


def _stage(row: dict, name: str, fn):
    """Run one stage function; record ok, or FAIL with its one-line reason."""
    t0 = time.time()
    try:
        out = fn()
    except Exception as exc:  # the matrix records the failure and moves on
        row.setdefault("stage_seconds", {})[name] = round(time.time() - t0, 1)
        row[name] = "FAIL"
        row["reason"] = f"{name}: {type(exc).__name__}: {_reason(str(exc))}"
        return None
    row[name] = "ok"
    row.setdefault("stage_seconds", {})[name] = round(time.time() - t0, 1)
    return out


def _run_in_process(cfg, out: Path, row: dict, steps: int) -> None:
    """The stages' own functions, in this process (see module docstring)."""
    import mlflow

    import tasks.plan
    from moeflow.checkpoint.convert import convert_checkpoint
    from tasks.base import StageContext

    shutil.rmtree(out, ignore_errors=True)  # a family rerun starts clean
    out.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(cfg.tracking.uri)
    mlflow.set_experiment("moeflow-families")
    with mlflow.start_run(run_name=row["family"]):
        mlflow.set_tag("moeflow.family", row["family"])
        conv = _stage(row, "convert", lambda: convert_checkpoint(cfg.model.path, out / "converted"))
        if conv is None:
            return
        base = str(out / "converted")
        (out / "plan").mkdir(exist_ok=True)
        plan = _stage(row, "plan", lambda: tasks.plan.run(StageContext(
            stage="plan", config=cfg, inputs={"convert": {"output_dir": base}}, out_dir=out / "plan")))
        if plan is None:
            return
        adapter = _stage(row, "finetune", lambda: _finetune(cfg, base, plan["plan"], out, steps))
        if adapter is None:
            return
        if _stage(row, "regress", lambda: _regress(cfg, base, adapter)) is None:
            return
        _stage(row, "deploy", lambda: _serve_once(cfg, base, adapter))
        mlflow.log_dict(row, "row.json")


def _finetune(cfg, base: str, plan: dict, out: Path, steps: int) -> str:
    """The finetune stage's preflight, worker setup and training steps at world size 1;
    returns the saved adapter dir."""
    import math

    from transformers import AutoTokenizer

    from moeflow.training import data as D
    from moeflow.training import driver as DR
    from moeflow.training import trainer as TR
    from moeflow.training.worker import AdapterJob, WorkerConfig

    # world size 1: every degree 1, whatever layout the plan picked for its devices (a plan of
    # tensor_parallel 2 on cpu-local's two devices otherwise fails the driver's check)
    plan = dict(plan, num_workers=1, data_parallel=1, tensor_parallel=1, expert_parallel=1, context_parallel=1,
                pipeline_parallel=1, fsdp=1, distributed_config={"tp_size": 1, "pp_size": 1, "ep_size": 1})
    DR.preflight(cfg, base, plan)
    tok = AutoTokenizer.from_pretrained(base)
    ds = D.build_dataset(cfg.data, tok, cfg.seed)
    worker = WorkerConfig.build(cfg, base,
                                planned_rank_bytes=tuple(DR.planned_bytes(plan, base, cfg.model.dtype, 1)))
    w = TR._setup(worker, TR._load(worker, 0, 1), AdapterJob("adapter", cfg.finetune, ds))
    if w.plan_check.get("plan/bytes_match") != 1.0:
        raise RuntimeError(f"loaded parameters differ from the plan: {w.plan_check}")
    for _ in range(steps):
        m = TR._train_step(w)
        if not math.isfinite(m["loss"]):
            raise RuntimeError(f"non-finite training loss {m['loss']}")
    adapter = out / "adapter"
    w.model.save_pretrained(str(adapter))
    return str(adapter)


def _regress(cfg, base: str, adapter: str) -> dict:
    """The regress stage's evaluation of the base and the adapter on the golden suite."""
    from moeflow.evaluation.runners import evaluate
    from moeflow.evaluation.suite import load_suite

    sec = cfg.regress
    base_res, adapted = evaluate(load_suite(sec.suite), base, [None, adapter], shards=1,
                                 dtype=sec.dtype, batch_size=sec.batch_size, seed=cfg.seed)
    return {"base": base_res, "adapter": adapted}


def _serve_once(cfg, base: str, adapter: str) -> dict:
    """The deploy stage's server (Service + OpenAI API) in process: one completion of
    the fine-tuned adapter over HTTP through an ASGI client."""
    from fastapi.testclient import TestClient

    from moeflow.serving.api import create_app
    from moeflow.serving.app import Service
    from moeflow.serving.deployment import decide
    from moeflow.serving.launch import settings_for

    dep = decide(cfg, {"convert": {"output_dir": base}, "finetune": {"adapter_dir": adapter}})
    service = Service(settings_for(cfg, dep, None))
    try:
        with TestClient(create_app(service)) as client:
            r = client.post("/v1/completions", json={"model": "adapter", "prompt": "min 3 1 2 =",
                                                     "max_tokens": 2, "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/completions: {r.status_code} {r.text[:200]}")
            return r.json()
    finally:
        service.close()


def _run_pipeline(cfg, row: dict) -> None:
    from moeflow.core.errors import UserError
    from workflows.runner import run_pipeline

    try:
        try:
            outcome = run_pipeline(cfg, use_cache=False)
        finally:  # the deploy stage's app lives as long as this shared Ray: its replica would
            _undeploy()  # hold the CPUs the next family's finetune waits for (forever, on 2 cores)
        for name in FULL_STAGES:
            st = outcome.stages.get(name)
            row[name] = {"done": "ok", "reused": "ok", "failed": "FAIL"}.get(st.state, st.state) \
                if st else "-"
            if st and st.state == "failed" and not row["reason"]:
                row["reason"] = f"{name}: {_reason(st.error)}"
    except Exception as exc:  # preflight refusals are one-line UserErrors; the time limit
        if TIMED_OUT:
            row["reason"] = f"time limit: no result within {TIMED_OUT.pop()} s on this host"
            return
        row["reason"] = f"{'preflight' if isinstance(exc, UserError) else type(exc).__name__}: " \
                        f"{_reason(str(exc))}"
        for name in FULL_STAGES:
            row[name] = "refused"


TIMED_OUT: list[int] = []


def _undeploy() -> None:
    """Delete the Serve applications a family's pipeline left on the shared Ray."""
    import ray
    from ray import serve

    if ray.is_initialized():
        for name in serve.status().applications:
            serve.delete(name)


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raise TimeoutError in this (main) thread after `seconds`; the stage running
    then is recorded as failed with that reason."""
    import signal

    def _alarm(signum, frame):
        TIMED_OUT.append(seconds)  # raised inside Ray's C code it may surface as another error
        raise TimeoutError(f"no result within {seconds} s on this host")

    if not seconds:
        yield
        return
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _stages(row: dict) -> tuple[str, ...]:
    return FULL_STAGES if "operators" in row else STAGES


def passed(row: dict) -> bool:
    return row["build"] == "ok" and all(row[s] == "ok" for s in _stages(row))


def render(rows: list[dict], transformers_version: str) -> str:
    """docs/families.md: the fast mode's table and its pass rate."""
    ok = sum(passed(r) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    lines = [
        "# MoE families through the whole pipeline",
        "",
        f"Every MoE model type of transformers {transformers_version} with a causal-LM or "
        "image-text class, as a tiny random bf16 checkpoint derived from the family's own "
        "default config (`moeflow_testing.tiny_auto`), run through convert -> plan -> finetune "
        "(a few steps) -> regress -> deploy (one completion through the served API) by "
        "`benchmarks/families.py`.",
        "",
        f"**{ok} of {len(rows)} pass ({100 * ok / max(1, len(rows)):.0f}%)**, "
        f"{seconds / 60:.0f} min of family runs on a shared 2-core host; a family with no "
        "result within the per-family limit is listed with that reason.",
        "",
        "First failing step: " + ", ".join(
            f"{k} {v}" for k, v in sorted(_first_failures(rows).items())) + ".",
        "",
    ] + _table(rows, STAGES)
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], stages) -> list[str]:
    lines = ["| family | class | kinds | build | " + " | ".join(stages) + " | s | reason |",
             "|---|---|---|---|" + "---|" * len(stages) + "---|---|"]
    for r in sorted(rows, key=lambda r: r["family"]):
        lines.append(f"| {r['family']} | {r.get('architecture', '')} | {', '.join(r.get('kinds', []))} "
                     f"| {r['build']} | " + " | ".join(r[s] for s in stages)
                     + f" | {r['seconds']:.0f} | {r['reason']} |")
    return lines


FULL_HEADING = "## Full mode: all eight stages through `moeflow run`"


def render_full(rows: list[dict], transformers_version: str, previous: str) -> str:
    """`previous` (the fast table's page) with its full-mode section replaced."""
    ok = sum(passed(r) for r in rows)
    covered = sorted({k for r in rows if passed(r) for k in r.get("kinds", [])})
    section = [
        FULL_HEADING, "",
        "`benchmarks/families.py --full`: configs/demo.yaml pointed at each tiny random bf16 "
        "checkpoint and run by `workflows.runner.run_pipeline` on a local Ray with all eight "
        "stages (operators, calibrate and serving cut to a few samples and one candidate; "
        "the gates' thresholds opened: random weights), each passing run recording the golden "
        "suite's baseline in one shared store, where every later family's regress looks for one "
        f"of its own architecture (transformers {transformers_version}).",
        "",
        f"**{ok} of {len(rows)} run all eight stages**; kinds covered by a passing family: "
        f"{', '.join(covered) or 'none'}.",
        "",
    ] + _table(rows, FULL_STAGES)
    head = previous.split(FULL_HEADING)[0].rstrip("\n") if previous else "# MoE families"
    return head + "\n\n" + "\n".join(section) + "\n"


def _full_section(previous: str) -> str:
    """The full-mode section of the page, kept when the fast table is rewritten."""
    return ("\n" + FULL_HEADING + previous.split(FULL_HEADING, 1)[1]) if FULL_HEADING in previous else ""


def pick_kinds(families: list[str], wanted: list[str], per_kind: int) -> list[str]:
    """Families in order, each taken while one of its kinds has fewer than `per_kind`."""
    from moeflow_testing.tiny_auto import tiny_config

    count = dict.fromkeys(wanted, 0)
    out = []
    for family in families:
        try:
            found = kinds(tiny_config(family).to_dict())
        except Exception:  # a family whose tiny config does not build brings no kind
            continue
        if any(count.get(k, per_kind) < per_kind for k in found):
            out.append(family)
            for k in found:
                if k in count:
                    count[k] += 1
    return out


def _first_failures(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        step = next((s for s in ("build",) + _stages(r) if r[s] not in ("ok", "-")), None)
        if step:
            out[step] = out.get(step, 0) + 1
    return out


def log_mlflow(rows: list[dict], md: Path, tracking: str) -> None:
    import mlflow

    mlflow.set_tracking_uri(tracking)
    mlflow.set_experiment("moeflow-families")
    with mlflow.start_run(run_name="family-matrix"):
        ok = sum(passed(r) for r in rows)
        mlflow.log_metrics({"families": len(rows), "passed": ok,
                            "pass_rate": ok / max(1, len(rows))})
        mlflow.log_artifact(str(md))
        mlflow.log_dict({"rows": rows}, "families.json")


def main(argv: list[str] | None = None) -> int:
    import transformers

    from moeflow_testing.demo_data import make_dataset
    from moeflow_testing.tiny_auto import moe_model_types
    from workflows.raylocal import ray_session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", help="model types (default: every MoE type)")
    ap.add_argument("--out", default=str(REPO / "docs" / "families.md"))
    ap.add_argument("--workdir", default=None, help="default: a temp dir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tracking", default=None, help="MLflow URI (default: sqlite in workdir)")
    ap.add_argument("--full", action="store_true", help="every stage through run_pipeline on Ray")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per family (0: none)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in workdir/rows.json")
    ap.add_argument("--kinds", nargs="*", choices=KINDS, help="pick families covering these kinds")
    ap.add_argument("--per-kind", type=int, default=2, help="families per kind with --kinds")
    ap.add_argument("--float32", nargs="*", default=[], help="families whose checkpoint is fp32 (else bf16)")
    args = ap.parse_args(argv)
    transformers.logging.set_verbosity_error()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="moeflow-families-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    tracking = args.tracking or f"sqlite:///{root}/mlflow.db"
    train, eval_ = make_dataset(root / "data", seed=0)
    data = {"train": train, "eval": eval_}
    families = args.families or moe_model_types()
    if args.kinds:  # the first families (in order) that bring a kind not covered yet
        families = pick_kinds(families, args.kinds, args.per_kind)
    done = json.loads((root / "rows.json").read_text()) if args.resume and (root / "rows.json").exists() else []
    rows = [r for r in done if r["family"] in families]
    seen = {r["family"] for r in rows}
    with ray_session(None) if args.full else contextlib.nullcontext():
        for i, family in enumerate(families, 1):
            if family in seen:
                continue
            with _time_limit(args.timeout):
                row = run_family(family, root, data, tracking, args.steps, args.full,
                                 dtype="float32" if family in args.float32 else "bfloat16")
            rows.append(row)
            print(f"[{i}/{len(families)}] {family}: {'PASS' if passed(row) else 'FAIL'} "
                  f"({row['seconds']} s) {row['reason']}", flush=True)
            (root / "rows.json").write_text(json.dumps(rows, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    previous = out.read_text() if out.is_file() else ""
    tmp.write_text(render_full(rows, transformers.__version__, previous) if args.full
                   else render(rows, transformers.__version__) + _full_section(previous))
    tmp.replace(out)
    log_mlflow(rows, out, tracking)
    ok = sum(passed(r) for r in rows)
    print(f"{ok}/{len(rows)} families pass; table: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
