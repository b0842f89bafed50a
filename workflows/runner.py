"""The pipeline runner: stages as Ray tasks, tracked in MLflow, resumable.

    run_pipeline(cfg)                      # fresh run (reuses cached stages)
    run_pipeline(cfg, resume_run_id=RID)   # continue a failed pipeline run

Decisions per stage, in dependency order: a stage is *reused* when a
finished execution with the same cache key exists (in the resumed run, or
anywhere in the experiment unless caching is off) and every upstream stage
was reused too; otherwise it *runs*. Ready stages run concurrently, each as
one Ray task with its own resources; they hand each other small result
records. A failure fails that stage (its child run FAILED with the message),
skips everything downstream, and lets independent branches finish.

A *resumable* stage (StageSpec.resumable) keeps its partial output: a Ray
retry reruns it in the same out dir, and a resumed pipeline hands it the out
dir of its unfinished attempt with the same cache key. Lines a stage writes
with `ctx.note()` are printed by the driver while it runs. When the pipeline
ends, the parent run gets every stage's headline metrics (`publish`).
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import mlflow
import ray

from moeflow.config import PipelineConfig, flatten, to_yaml
from moeflow.errors import UserError
from tasks.base import NOTES, PROGRESS, StageContext, StageSpec
from workflows import dag, tracking as T
from workflows.raylocal import ray_session

TERMINAL = {"done", "reused", "failed", "skipped"}


@dataclass
class StageState:
    name: str
    state: str = "pending"  # pending|running|done|reused|failed|skipped
    run_id: str | None = None
    attempts: int = 0
    seconds: float | None = None
    error: str | None = None
    key: str = ""
    result: dict | None = None
    started: float = 0.0
    out_dir: str = ""
    note: str = ""  # the latest ctx.note() line (event "note")
    notes_offset: int = 0
    progress: dict | None = None  # {"done", "total", "what"} (event "progress")


@dataclass
class Outcome:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    stages: dict[str, StageState] = field(default_factory=dict)
    tracking_uri: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"


# ----------------------------------------------------------- stage selection


def _check_names(names, known: Mapping[str, StageSpec], what: str) -> None:
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UserError(f"{what}: unknown stage {name!r}{hint}; stages: {', '.join(known)}")


def select(stages: Mapping[str, StageSpec], cfg: PipelineConfig, *, targets=(), only=(),
           from_=(), rerun=()) -> tuple[list[str], set[str], set[str]]:
    """Which stages take part, which must be reused, which are forced to run.

    Returns:
        (selected in dependency order, must_reuse, forced)
    """
    enabled = list(cfg.stages.enabled) if cfg.stages.enabled is not None else list(stages)
    _check_names(enabled, stages, "stages.enabled")
    _check_names(cfg.stages.resources, stages, "stages.resources")
    for opt, names in (("--target", targets), ("--only", only), ("--from", from_),
                       ("--rerun", rerun)):
        _check_names(names, stages, opt)
    selected = set(enabled)
    must_reuse: set[str] = set()
    forced = set(rerun)
    if targets:
        selected = dag.upstream_closure(stages, set(targets))
    if only:
        selected = set(only)
        must_reuse = dag.upstream_closure(stages, set(only)) - selected
        forced |= set(only)
    elif from_:
        forced |= dag.downstream(stages, set(from_)) & selected
        must_reuse = dag.upstream_closure(stages, set(from_)) - forced
    for name in selected:
        for up in stages[name].upstream:
            if up not in selected and up not in must_reuse:
                raise UserError(f"stage {name} needs {up}, which is not enabled "
                                f"(add it to stages.enabled)")
    order = [n for n in stages if n in selected or n in must_reuse]
    return order, must_reuse, forced


def preflight(cfg: PipelineConfig, stages: Mapping[str, StageSpec], order: list[str]) -> None:
    """Cheap checks before anything starts (no MLflow run, no Ray)."""
    needs = [n for n in order if stages[n].needs_model]
    if needs and not Path(cfg.model.path).exists():
        raise UserError(f"model path not found: {cfg.model.path} (model.path; read by "
                        f"{', '.join(needs)})")
    if not order:
        raise UserError("no stages to run (stages.enabled is empty or no stage is installed)")
    if Path(cfg.model.path).exists():  # a checkpoint that needs its own code: only when opted in
        from moeflow.remote_code import refuse_untrusted

        refuse_untrusted(cfg.model.path, cfg.model.trust_remote_code)
    for name in order:
        if stages[name].preflight:
            stages[name].preflight(cfg)


# ----------------------------------------------------------- stage execution


def execute_stage(spec: StageSpec, cfg_json: dict, inputs: dict, out_dir: str,
                  run_id: str, tracking_uri: str, pipeline_run_id: str) -> dict:
    """Body of the Ray task for one stage execution (runs on a worker)."""
    cfg = PipelineConfig.model_validate(cfg_json)
    out = Path(out_dir)
    if out.exists() and not spec.resumable:  # a retried task after worker loss starts clean
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").unlink(missing_ok=True)  # a resumable stage's old record never counts
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        ctx = StageContext(stage=spec.name, config=cfg, inputs=inputs, out_dir=out,
                           mlflow_run_id=run_id, tracking_uri=tracking_uri,
                           pipeline_run_id=pipeline_run_id)
        try:
            code = _remote_code(cfg, inputs)
            result = spec.run(ctx)
        except UserError as exc:
            mlflow.set_tag(T.ERROR, str(exc)[:4000])
            raise
        except BaseException as exc:
            mlflow.set_tag(T.ERROR, f"{type(exc).__name__}: {exc}"[:4000])
            mlflow.log_text(traceback.format_exc(), "error.txt")
            raise
        result = dict(result or {})
        if code:
            result["remote_code"] = code
        json.dumps(result)  # the record must be small JSON; fail here if not
        (out / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True))
        mlflow.log_dict(result, "result.json")
    return result


def _remote_code(cfg: PipelineConfig, inputs: dict) -> dict[str, str]:
    """The checkpoint's own code for this stage (checked against convert's sha256
    record, loaded, logged as `remote_code.<file>` params); {} when it has none."""
    from moeflow.remote_code import stage_record

    code = stage_record(cfg, inputs)
    if code:
        mlflow.log_params({f"remote_code.{name}": sha for name, sha in code.items()})
    return code


def _error_message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UserError):
        return str(cause)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    if isinstance(exc, ray.exceptions.TaskCancelledError):
        return "cancelled"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


# ----------------------------------------------------------- the runner


class _Interrupted(Exception):
    pass


class Runner:
    """One pipeline execution (fresh or resumed) against one MLflow parent run."""

    def __init__(self, cfg: PipelineConfig, stages: Mapping[str, StageSpec], *,
                 on_event: Callable[[str, StageState], None] | None = None):
        self.cfg = cfg
        self.stages = stages
        self.uri = T.resolve_tracking_uri(cfg.tracking.uri)
        self.client = T.client_for(self.uri)
        self.exp_id = T.experiment_id(self.client, cfg.experiment,
                                      T.artifact_root_for(self.uri, cfg.tracking.artifact_root))
        self.on_event = on_event or (lambda kind, st: None)
        self.parent_id = ""
        self.states: dict[str, StageState] = {}
        self.previous: dict[str, list] = {}

    # -- parent run
    def open_parent(self, resume_run_id: str | None) -> dict[str, list]:
        """Create (or reopen) the parent run; returns previous child runs by stage."""
        previous: dict[str, list] = {}
        if resume_run_id:
            parent = T.get_pipeline_run(self.client, resume_run_id)
            self.parent_id = parent.info.run_id
            for run in T.child_runs(self.client, parent):
                if run.info.status in ("RUNNING", "SCHEDULED"):  # its driver was killed
                    self.client.set_tag(run.info.run_id, T.ERROR, "driver lost (killed)")
                    self.client.set_terminated(run.info.run_id, "KILLED")
                    run = self.client.get_run(run.info.run_id)
                previous.setdefault(run.data.tags.get(T.STAGE, ""), []).append(run)
            self.client.update_run(self.parent_id, status="RUNNING")
        else:
            run = self.client.create_run(self.exp_id, run_name=self.cfg.name, tags={
                T.KIND: "pipeline", "moeflow.config_name": self.cfg.name})
            self.parent_id = run.info.run_id
            params = flatten(self.cfg)
            for i in range(0, len(params), 90):  # MLflow batches at most 100 params
                chunk = list(params.items())[i:i + 90]
                self.client.log_batch(self.parent_id, params=[
                    mlflow.entities.Param(k, v[:6000]) for k, v in chunk])
        self.client.log_text(self.parent_id, to_yaml(self.cfg), "config.yaml")
        return previous

    def set_state(self, st: StageState, state: str, event: str | None = None) -> None:
        st.state = state
        self.client.set_tag(self.parent_id, T.STATE_PREFIX + st.name, state)
        if st.run_id:
            self.client.set_tag(self.parent_id, T.STAGE_RUN_PREFIX + st.name, st.run_id)
        self.on_event(event or state, st)

    # -- planning
    def plan(self, order, must_reuse, forced, previous, use_cache) -> None:
        keys: dict[str, str] = {}
        self.previous = previous
        self.client.set_tag(self.parent_id, "moeflow.stages", ",".join(order))
        for name in order:
            spec = self.stages[name]
            data = self.cfg.model_dump(mode="json")
            files = [f for k in spec.fingerprint_keys() for f in dag.lookup_all(data, k)]
            keys[name] = dag.cache_key(name, spec.section_config(self.cfg), spec.code_version(),
                                       {u: keys[u] for u in spec.upstream}, files)
            st = StageState(name=name, key=keys[name],
                            attempts=len(previous.get(name, [])))
            self.states[name] = st
            ups_reused = all(self.states[u].state == "reused" for u in spec.upstream)
            cached = None
            if name not in forced and ups_reused and spec.cacheable:
                cached = self._reusable(previous.get(name, []), keys[name], use_cache)
            if cached is not None:
                st.run_id = cached.info.run_id
                st.result = T.read_result(cached)
                st.seconds = _duration(cached)
                st.out_dir = cached.data.tags.get(T.OUT_DIR, "")
                self.set_state(st, "reused")
            elif name in must_reuse:
                raise UserError(f"stage {name} has no reusable result for its current inputs; "
                                f"run the pipeline without --only/--from first")
            else:
                self.set_state(st, "pending")

    def _reusable(self, previous_runs: list, key: str, use_cache: bool):
        for run in reversed(previous_runs):  # newest first, same pipeline run
            if (run.info.status == "FINISHED" and run.data.tags.get(T.CACHE_KEY) == key
                    and (Path(run.data.tags.get(T.OUT_DIR, "")) / "result.json").is_file()):
                return run
        return T.find_cached(self.client, self.exp_id, key) if use_cache else None

    # -- execution
    def _submit(self, name: str):
        spec, st = self.stages[name], self.states[name]
        res = self.cfg.stages.resources.get(name)
        pick = lambda attr: (getattr(res, attr) if res and getattr(res, attr) is not None  # noqa: E731
                             else getattr(spec, attr))
        gpus = pick("num_gpus")
        gpus = gpus(self.cfg) if callable(gpus) else gpus  # e.g. a GPU when the cluster has one
        st.attempts += 1
        run = self.client.create_run(self.exp_id, run_name=name, tags={
            T.PARENT: self.parent_id, T.STAGE: name, T.ATTEMPT: str(st.attempts),
            T.CACHE_KEY: st.key, T.PIPELINE: self.parent_id})
        st.run_id = run.info.run_id
        out_dir = self._partial_dir(name) if spec.resumable else None
        if out_dir is not None:
            st.note = f"continuing the partial output of an earlier attempt in {out_dir}"
            self.on_event("note", st)
        else:
            out_dir = Path(self.cfg.workdir) / self.parent_id / f"{name}-{st.run_id[:8]}"
        st.out_dir = str(out_dir)
        notes = out_dir / NOTES
        st.notes_offset = notes.stat().st_size if notes.is_file() else 0
        (out_dir / PROGRESS).unlink(missing_ok=True)  # an earlier attempt's, not this one's
        self.client.set_tag(st.run_id, T.OUT_DIR, str(out_dir))
        params = flatten(spec.section_config(self.cfg))
        for i in range(0, len(params), 90):
            self.client.log_batch(st.run_id, params=[
                mlflow.entities.Param(k, v[:6000]) for k, v in list(params.items())[i:i + 90]])
        inputs = {u: self.states[u].result for u in spec.upstream}
        # Pin the stage (and the Ray Train / Serve actors it starts, which inherit
        # its runtime_env) to this cluster: with several Ray instances on one host,
        # Ray's state API cannot otherwise tell which one is "auto".
        env = {"env_vars": {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}}
        task = ray.remote(execute_stage).options(
            name=f"moeflow:{name}", num_cpus=pick("num_cpus"), num_gpus=gpus,
            memory=pick("memory"), max_retries=pick("max_retries"), retry_exceptions=False,
            runtime_env=env)
        st.started = time.time()
        self.set_state(st, "running", "started")
        # exclude_unset: the stage still knows which keys the user set (deploy vs serving.yaml)
        return task.remote(spec, self.cfg.model_dump(mode="json", exclude_unset=True), inputs, str(out_dir),
                           st.run_id, self.uri, self.parent_id)

    def _partial_dir(self, name: str) -> Path | None:
        """Out dir of this pipeline's newest unfinished attempt of `name` with the same
        cache key (a killed driver, a failed attempt), if it still exists."""
        key = self.states[name].key
        for run in reversed(self.previous.get(name, [])):
            out = run.data.tags.get(T.OUT_DIR)
            if (run.info.status != "FINISHED" and run.data.tags.get(T.CACHE_KEY) == key
                    and out and Path(out).is_dir()):
                return Path(out)
        return None

    def _poll_notes(self) -> None:
        """Print new `ctx.note()` lines of running stages; pass on their progress."""
        for st in self.states.values():
            self._poll_progress(st)
            path = Path(st.out_dir) / NOTES if st.out_dir else None
            if st.state != "running" or path is None or not path.is_file():
                continue
            with path.open("rb") as fh:
                fh.seek(st.notes_offset)
                chunk = fh.read()
            end = chunk.rfind(b"\n") + 1  # whole lines only
            st.notes_offset += end
            for line in chunk[:end].decode("utf-8", "replace").splitlines():
                st.note = line
                self.on_event("note", st)

    def _poll_progress(self, st: StageState) -> None:
        path = Path(st.out_dir) / PROGRESS if st.out_dir else None
        if st.state != "running" or path is None or not path.is_file():
            return
        try:
            progress = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return  # being replaced right now: next poll
        if progress != st.progress:
            st.progress = progress
            self.on_event("progress", st)

    def _finish(self, name: str, ref) -> None:
        st = self.states[name]
        self._poll_notes()
        st.seconds = time.time() - st.started
        try:
            st.result = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, none lost
            st.error = _error_message(exc)
            self._close_child(st.run_id, "FAILED", st.error)
            self.set_state(st, "failed")
            for other in dag.downstream(self.stages, {name}) - {name}:
                if other in self.states and self.states[other].state == "pending":
                    self.states[other].error = f"upstream {name} failed"
                    self.set_state(self.states[other], "skipped")
            return
        self._close_child(st.run_id, "FINISHED", None)
        self.set_state(st, "done")

    def _close_child(self, run_id: str, status: str, error: str | None) -> None:
        """Make sure a stage run is terminal (a dead worker leaves it RUNNING)."""
        run = self.client.get_run(run_id)
        if error and not run.data.tags.get(T.ERROR):
            self.client.set_tag(run_id, T.ERROR, error[:4000])
        if run.info.status in ("RUNNING", "SCHEDULED") or (
                status == "FAILED" and run.info.status == "FINISHED"):
            self.client.set_terminated(run_id, status)

    def execute(self) -> None:
        running: dict = {}  # ObjectRef -> stage name
        while True:
            for name, st in self.states.items():
                if st.state == "pending" and all(
                        self.states[u].state in ("done", "reused") for u in self.stages[name].upstream):
                    running[self._submit(name)] = name
            if not running:
                break
            ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            self._poll_notes()
            for ref in ready:
                self._finish(running.pop(ref), ref)
        for st in self.states.values():  # unreachable: upstream never ran
            if st.state == "pending":
                self.set_state(st, "skipped")

    def publish(self) -> None:
        """Headline metrics of every finished or reused stage onto the parent run, as
        `<stage>.<metric>`, so pipelines compare side by side in the MLflow UI; reused
        stage runs linked from the parent (tags `moeflow.reused.<stage>` and the
        table artifact `stages.json`)."""
        from mlflow.entities import Metric

        now, metrics, rows = int(time.time() * 1000), [], []
        for st in self.states.values():
            if st.state in ("done", "reused") and st.result is not None:
                for key, value in headline(st.result).items():
                    metrics.append(Metric(f"{st.name}.{key}", value, now, 0))
                if st.seconds is not None and st.state == "done":
                    metrics.append(Metric(f"{st.name}.seconds", float(st.seconds), now, 0))
            if st.state == "reused" and st.run_id:
                self.client.set_tag(self.parent_id, T.REUSED_PREFIX + st.name, st.run_id)
            rows.append(self._row(st))
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.parent_id, metrics=metrics[i:i + 1000])
        if rows:
            with warnings.catch_warnings():  # pandas' dtype deprecation inside log_table
                warnings.simplefilter("ignore")
                self.client.log_table(self.parent_id, data={k: [r[k] for r in rows] for k in rows[0]},
                                      artifact_file="stages.json")

    def _row(self, st: StageState) -> dict:
        pipeline = ""
        if st.state == "reused" and st.run_id:
            pipeline = self.client.get_run(st.run_id).data.tags.get(T.PIPELINE, "")
        return {"stage": st.name, "state": st.state, "run_id": st.run_id or "",
                "pipeline_run": pipeline or (self.parent_id if st.run_id else ""),
                "seconds": round(st.seconds, 3) if st.seconds is not None else None,
                "link": f"#/experiments/{self.exp_id}/runs/{st.run_id}" if st.run_id else ""}

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: cancel running tasks, close every open run."""
        for st in self.states.values():
            if st.state == "running":
                st.error = "interrupted"
                if st.run_id:
                    self._close_child(st.run_id, "KILLED", "interrupted")
                self.set_state(st, "failed")
            elif st.state == "pending":
                self.set_state(st, "skipped")


HEADLINE_LIMIT = 40  # metrics per stage on the parent run


def headline(result: dict) -> dict[str, float]:
    """A stage's headline metrics: its record's `headline` dict when it has one, else
    its numeric (and boolean) values at the top level and one level down
    (`metrics.eval_loss`, `plan.num_workers`), at most HEADLINE_LIMIT.

    Stage authors: return `"headline": {"tokens_per_s": 812.0, ...}` in the result
    record to choose what the pipeline's parent run shows as `<stage>.<metric>`.
    """
    def number(v):
        if isinstance(v, bool):
            return float(v)
        if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
            return float(v)
        return None

    chosen = result.get("headline")
    items = chosen.items() if isinstance(chosen, dict) else [
        (f"{k}.{k2}" if isinstance(v, dict) else k, v2)
        for k, v in result.items() for k2, v2 in (v.items() if isinstance(v, dict) else [(k, v)])]
    out = {}
    for key, value in items:
        num = number(value)
        if num is not None and len(out) < HEADLINE_LIMIT:
            out[re.sub(r"[^\w\-./ ]", "_", str(key))] = num  # MLflow's metric-name alphabet
    return out


def _duration(run) -> float | None:
    if run.info.end_time and run.info.start_time:
        return (run.info.end_time - run.info.start_time) / 1000.0
    return None


def _absolutize(cfg: PipelineConfig) -> PipelineConfig:
    """Relative paths are relative to the driver's working directory; Ray
    workers may start elsewhere, so the runner passes absolute paths."""
    data = cfg.model_dump(mode="json")

    def fix(node: dict, key: str, must_exist: bool) -> None:
        value = node.get(key)
        if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            if not must_exist or Path(value).exists():
                node[key] = str(Path(value).resolve())

    fix(data, "workdir", False)
    fix(data["model"], "path", False)
    for key in ("train_file", "eval_file"):
        fix(data["data"], key, False)
        for tenant in data["finetune"]["adapters"].values():
            fix(tenant, key, False)
    fix(data["hardware"], "spec", True)
    for section in ("convert", "plan", "operators", "calibrate", "finetune", "deploy", "regress", "serving"):
        for key, value in list(data[section].items()):
            if key.endswith(("path", "_file", "_dir", "_root", "suite", "profile", "golden")):
                fix(data[section], key, True)
    return _keep_fields_set(cfg, PipelineConfig.model_validate(data))


def _keep_fields_set(src, dst):
    """`dst` remembers which keys the user set in `src` (plus those changed here), so
    stages can tell an explicit setting from a default (deploy vs serving.yaml)."""
    from pydantic import BaseModel

    if isinstance(src, BaseModel) and isinstance(dst, BaseModel):
        names = type(src).model_fields
        dst.__pydantic_fields_set__ = set(src.model_fields_set) | {
            n for n in names if getattr(src, n) != getattr(dst, n)}
        for n in names:
            _keep_fields_set(getattr(src, n), getattr(dst, n))
    elif isinstance(src, dict) and isinstance(dst, dict):
        for k in src.keys() & dst.keys():
            _keep_fields_set(src[k], dst[k])
    return dst


def run_pipeline(cfg: PipelineConfig, *, stages: Mapping[str, StageSpec] | None = None,
                 resume_run_id: str | None = None, targets=(), only=(), from_=(), rerun=(),
                 use_cache: bool = True, address: str | None = None,
                 on_event: Callable[[str, StageState], None] | None = None) -> Outcome:
    """Run (or resume) the pipeline; returns the outcome, never leaves runs RUNNING.

    Raises:
        UserError: bad selection or failed preflight — before any MLflow run exists.
    """
    if stages is None:
        from tasks import registry
        stages = registry()
    stages = _with_plugins(stages, cfg)
    cfg = _absolutize(cfg)
    order, must_reuse, forced = select(stages, cfg, targets=targets, only=only,
                                       from_=from_, rerun=rerun)
    preflight(cfg, stages, order)
    sub = {n: stages[n] for n in order}
    runner = Runner(cfg, sub, on_event=on_event)
    previous = runner.open_parent(resume_run_id)
    status = "FAILED"
    old_term = signal.getsignal(signal.SIGTERM)

    def _term(signum, frame):
        raise _Interrupted()

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        old_term = None
    try:
        runner.plan(order, must_reuse, forced, previous, use_cache)
        with ray_session(cfg, address):
            runner.execute()
        ok = all(st.state in ("done", "reused") for st in runner.states.values())
        status = "FINISHED" if ok else "FAILED"
    except (KeyboardInterrupt, _Interrupted):
        runner.interrupt()
        status = "KILLED"
    finally:
        try:
            runner.publish()
        except Exception as exc:  # noqa: BLE001 - the run's own status matters more
            runner.on_event("warning", StageState(name="pipeline", note=f"headline metrics "
                                                  f"not logged: {type(exc).__name__}: {exc}"))
        runner.client.set_terminated(runner.parent_id, status)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return Outcome(run_id=runner.parent_id, status=status, stages=runner.states,
                   tracking_uri=runner.uri)


def enable_only(cfg: PipelineConfig, names, stages: Mapping[str, StageSpec] | None = None
                ) -> PipelineConfig:
    """`moeflow run --stages A,B`: enable just the named stages and those they cannot run
    without (their `upstream`, transitively); optional upstreams (`after`) run only when
    named. Recorded as `stages.enabled`, so a resume keeps the selection."""
    if stages is None:
        from tasks import registry
        stages = registry()
    specs = _plugin_specs(stages, cfg)
    _check_names(list(names), specs, "--stages")
    needed = dag.upstream_closure(specs, set(names))  # unfolded: hard upstreams only
    enabled = cfg.stages.enabled
    off = sorted(n for n in needed if enabled is not None and n not in enabled)
    if off:
        raise UserError(f"--stages: {', '.join(off)} needed but not in stages.enabled")
    stages_cfg = cfg.stages.model_copy(update={"enabled": [n for n in specs if n in needed]})
    return cfg.model_copy(update={"stages": stages_cfg})


def _with_plugins(stages: Mapping[str, StageSpec], cfg: PipelineConfig) -> dict[str, StageSpec]:
    """The stages plus `stages.plugins`, optional edges folded for what is enabled,
    in dependency order."""
    out = dag.with_optional_edges(_plugin_specs(stages, cfg), cfg.stages.enabled)
    return {n: out[n] for n in dag.topological_order(out)}


def _plugin_specs(stages: Mapping[str, StageSpec], cfg: PipelineConfig) -> dict[str, StageSpec]:
    """Add stages from `stages.plugins` modules (each defines STAGE or STAGES)."""
    import importlib

    out = dict(stages)
    for module_name in cfg.stages.plugins:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UserError(f"stages.plugins: cannot import {module_name!r}: {exc}") from None
        specs = list(getattr(module, "STAGES", [])) + [getattr(module, "STAGE", None)]
        specs = [s for s in specs if isinstance(s, StageSpec)]
        if not specs:
            raise UserError(f"stages.plugins: module {module_name} defines no STAGE/STAGES")
        ray.cloudpickle.register_pickle_by_value(module)  # workers need not import it
        for spec in specs:
            out[spec.name] = spec
    return out
