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

import json
import signal
import time
from pathlib import Path
from typing import Callable, Mapping

import mlflow
import ray
from mlflow.entities import Metric

from moeflow.core import storage
from moeflow.core import tracking as T
from moeflow.core.config import PipelineConfig, flatten, to_yaml
from moeflow.core.errors import UserError
from moeflow.core.storage.stage import has_partial, read_live
from tasks.base import NOTES, PROGRESS, StageSpec
from workflows import dag
from workflows.dag import registry
from workflows.execute import (
    BIND_RETRIES,
    TRANSIENT_BIND,
    error_message,
    execute_stage,
    release_orphaned_placement_groups,
)
from workflows.outcome import Outcome, StageState, publish_stages
from workflows.raylocal import ray_session
from workflows.selection import (
    SELECTION_TAG,
    absolutize,
    preflight,
    recorded_selection,
    select,
    with_plugins,
)

# ----------------------------------------------------------- the runner


class _Interrupted(BaseException):
    """SIGTERM, raised by its handler wherever the driver is. A BaseException, as
    KeyboardInterrupt is: the driver's best-effort `except Exception` blocks (a stage's
    ray.get, the placement-group sweep's GCS call) must not swallow it -- one did, and a
    SIGTERMed run went on waiting for its stage."""


class Runner:
    """One pipeline execution (fresh or resumed) against one MLflow parent run."""

    def __init__(self, cfg: PipelineConfig, stages: Mapping[str, StageSpec], *,
                 on_event: Callable[[str, StageState], None] | None = None):
        self.cfg = cfg
        self.stages = stages
        self.uri = T.resolve_tracking_uri(cfg.tracking.uri)
        self.client = T.client_for(self.uri)
        artifacts = cfg.tracking.artifact_root
        if artifacts is None and storage.is_uri(cfg.workdir):  # no shared disk: artifacts in the store
            artifacts = storage.join(cfg.workdir, "mlflow-artifacts")
        self.exp_id = T.experiment_id(self.client, cfg.experiment,
                                      T.artifact_root_for(self.uri, artifacts))
        self.on_event = on_event or (lambda kind, st: None)
        self.parent_id = ""
        self.resuming = False  # set by run_pipeline before plan()
        self.states: dict[str, StageState] = {}
        self.previous: dict[str, list] = {}
        self._live_seen: dict[tuple[str, str], list] = {}
        self.estimated: dict[str, float] = {}  # stage -> the dry run's seconds (record_estimate)
        self.started = 0.0  # when a fresh run's stages began (after its estimate)

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
            self.estimated = {k[:-len(".est_seconds")]: v for k, v in parent.data.metrics.items()
                              if k.endswith(".est_seconds") and k != "pipeline.est_seconds"}
        else:
            run = self.client.create_run(self.exp_id, run_name=self.cfg.name, tags={
                T.KIND: "pipeline", "moeflow.config_name": self.cfg.name})
            self.parent_id = run.info.run_id
            params = flatten(self.cfg)
            for i in range(0, len(params), 90):  # MLflow batches at most 100 params
                chunk = list(params.items())[i:i + 90]
                self.client.log_batch(self.parent_id, params=[
                    mlflow.entities.Param(k, v[:6000]) for k, v in chunk])
        self.client.set_tag(self.parent_id, T.DRIVER, T.driver_tag())  # `status` tells a killed one
        self.client.log_text(self.parent_id, to_yaml(self.cfg), "config.yaml")
        return previous

    def record_estimate(self) -> None:
        """The dry run's estimate of this run, before any stage starts (its host probe sees no
        stage of ours): `<stage>.est_seconds` and `pipeline.est_seconds` on the parent run,
        every term in `estimate.json`; publish() adds what each stage measured beside it.
        An estimate that cannot be made is a tag and a warning; the run goes on without it."""
        try:
            # lazy: the dry run loads the planner and the meta model; only a run needs it
            from workflows.dryrun import for_run

            est = for_run(self.cfg, dict(self.stages))
        except Exception as exc:  # noqa: BLE001 - the estimate never stops the pipeline
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            self.client.set_tag(self.parent_id, T.ESTIMATE_ERROR, why)
            self.on_event("warning", StageState(name="pipeline", note=f"no dry-run estimate: {why}"))
            return
        if est is None:
            return
        now = int(time.time() * 1000)
        self.estimated = {s.name: s.seconds for s in est.stages if s.terms}
        metrics = [Metric(f"{k}.est_seconds", v, now, 0) for k, v in self.estimated.items()]
        self.client.log_batch(self.parent_id, metrics=[
            *metrics, Metric("pipeline.est_seconds", est.wall_s, now, 0)])
        self.client.log_text(self.parent_id, json.dumps(est.as_dict(), indent=1), "estimate.json")

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
            elif name in forced and self.resuming and ups_reused and spec.cacheable:
                # a resumed --rerun/--only: what this pipeline run itself finished counts, no other's
                cached = self._reusable(previous.get(name, []), keys[name], use_cache=False)
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
                    and T.has_record(run.data.tags.get(T.OUT_DIR, ""))):
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
            out_dir = storage.join(self.cfg.workdir, self.parent_id, f"{name}-{st.run_id[:8]}")
        st.out_dir = str(out_dir)
        notes = self._live(st, NOTES)
        st.notes_offset = len(notes) if notes is not None else 0
        if storage.is_uri(st.out_dir):
            storage.remove(storage.join(st.out_dir, "_live", PROGRESS))
        else:
            (Path(out_dir) / PROGRESS).unlink(missing_ok=True)  # an earlier attempt's, not this one's
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
            resources=dict(res.resources) if res and res.resources else None,  # custom: place it
            runtime_env=env)
        st.started = time.time()
        self.set_state(st, "running", "started")
        # exclude_unset: the stage still knows which keys the user set (deploy vs serving.yaml)
        return task.remote(spec, self.cfg.model_dump(mode="json", exclude_unset=True), inputs, str(out_dir),
                           st.run_id, self.uri, self.parent_id)

    def _partial_dir(self, name: str) -> str | None:
        """Out dir of this pipeline's newest unfinished attempt of `name` with the same
        cache key (a killed driver, a failed attempt), if it still exists."""
        key = self.states[name].key
        for run in reversed(self.previous.get(name, [])):
            out = run.data.tags.get(T.OUT_DIR)
            if (run.info.status != "FINISHED" and run.data.tags.get(T.CACHE_KEY) == key
                    and out and _has_partial(out)):
                return out
        return None

    def _poll_notes(self) -> None:
        """Print new `ctx.note()` lines of running stages; pass on their progress."""
        for st in self.states.values():
            self._poll_progress(st)
            if st.state != "running" or not st.out_dir:
                continue
            chunk = (self._live(st, NOTES) or b"")[st.notes_offset:]
            end = chunk.rfind(b"\n") + 1  # whole lines only
            st.notes_offset += end
            for line in chunk[:end].decode("utf-8", "replace").splitlines():
                st.note = line
                self.on_event("note", st)

    def _live(self, st: StageState, name: str) -> bytes | None:
        """A running stage's notes/progress file: in its out dir, or mirrored to the store
        (`_live/`, read at most every 2 s) when the stage works on another node's scratch."""
        if not st.out_dir:
            return None
        if not storage.is_uri(st.out_dir):
            path = Path(st.out_dir) / name
            try:
                return path.read_bytes() if path.is_file() else None
            except OSError:
                return None

        now, seen = time.time(), self._live_seen.setdefault((st.name, name), [0.0, None])
        if now - seen[0] >= 2.0:
            seen[0], seen[1] = now, read_live(st.out_dir, name)
        return seen[1]

    def _poll_progress(self, st: StageState) -> None:
        if st.state != "running":
            return
        try:
            progress = json.loads(self._live(st, PROGRESS) or b"null")
        except (OSError, json.JSONDecodeError):
            return  # being replaced right now: next poll
        if progress is None:
            return
        if progress != st.progress:
            st.progress = progress
            self.on_event("progress", st)

    def _finish(self, name: str, ref) -> None:
        st = self.states[name]
        assert st.run_id is not None  # set when the stage was submitted
        self._poll_notes()
        st.seconds = time.time() - st.started
        try:
            st.result = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, none lost
            st.error = error_message(exc)
            self._close_child(st.run_id, "FAILED", st.error)
            if any(m in st.error for m in TRANSIENT_BIND) and st.bind_retries < BIND_RETRIES:
                st.bind_retries += 1
                st.note = f"a port was taken while it started ({st.error}); trying again"
                self.on_event("warning", st)
                st.error = None
                self.set_state(st, "pending")  # execute() submits it again, as a new attempt
                return
            self.set_state(st, "failed")
            for other in dag.downstream(self.stages, {name}) - {name}:
                if other in self.states and self.states[other].state == "pending":
                    self.states[other].error = f"upstream {name} failed"
                    self.set_state(self.states[other], "skipped")
            return
        self._close_child(st.run_id, "FINISHED", None)
        self.set_state(st, "done")

    def _close_child(self, run_id: str, status: str, error: str | None) -> None:
        """Make sure a stage run is terminal (a dead worker leaves it RUNNING), and with a
        failed or stopped stage every run it opened below itself (finetune's per-tenant runs)."""
        run = self.client.get_run(run_id)
        if error and not run.data.tags.get(T.ERROR):
            self.client.set_tag(run_id, T.ERROR, error[:4000])
        if run.info.status in ("RUNNING", "SCHEDULED") or (
                status == "FAILED" and run.info.status == "FINISHED"):
            self.client.set_terminated(run_id, status)
        if status != "FINISHED":
            for nested in T.open_descendants(self.client, run.info.experiment_id, run_id):
                self.client.set_terminated(nested, status)

    def execute(self) -> None:
        running: dict = {}  # ObjectRef -> stage name
        released = 0.0
        while True:
            for name, st in self.states.items():
                if st.state == "pending" and all(
                        self.states[u].state in ("done", "reused") for u in self.stages[name].upstream):
                    running[self._submit(name)] = name
            if not running:
                break
            ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            self._poll_notes()
            if time.time() - released > RELEASE_EVERY_S:  # a lost node's Ray Train group's CPUs, back
                release_orphaned_placement_groups()
                released = time.time()
            for ref in ready:
                self._finish(running.pop(ref), ref)
        for st in self.states.values():  # unreachable: upstream never ran
            if st.state == "pending":
                self.set_state(st, "skipped")

    def publish(self) -> None:
        """The parent run's summary of every stage (outcome.publish_stages)."""
        publish_stages(self.client, self.parent_id, self.exp_id, self.states, self.estimated,
                       self.started)

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


RELEASE_EVERY_S = 5.0  # orphaned placement groups (execute.release_orphaned_placement_groups)


def _has_partial(out_dir: str) -> bool:
    if storage.is_uri(out_dir):
        return has_partial(out_dir)
    return Path(out_dir).is_dir()


def _duration(run) -> float | None:
    if run.info.end_time and run.info.start_time:
        return (run.info.end_time - run.info.start_time) / 1000.0
    return None


def run_pipeline(cfg: PipelineConfig, *, stages: Mapping[str, StageSpec] | None = None,
                 resume_run_id: str | None = None, targets=(), only=(), from_=(), rerun=(),
                 use_cache: bool = True, address: str | None = None,
                 on_event: Callable[[str, StageState], None] | None = None) -> Outcome:
    """Run (or resume) the pipeline; returns the outcome, never leaves runs RUNNING.

    Raises:
        UserError: bad selection or failed preflight — before any MLflow run exists.
    """
    if stages is None:
        stages = registry()
    stages = with_plugins(stages, cfg)
    for key, value in (("workdir", cfg.workdir), ("model.path", cfg.model.path)):
        storage.check_location(value, key)  # before `s3:/b` would be made an absolute local path
    cfg = absolutize(cfg)
    chosen = {"targets": list(targets), "only": list(only), "from": list(from_), "rerun": list(rerun)}
    if resume_run_id:  # the run's own --only/--from/--rerun carry on (a new --rerun adds to them)
        chosen = recorded_selection(cfg, resume_run_id, chosen)
    order, must_reuse, forced = select(stages, cfg, targets=chosen["targets"], only=chosen["only"],
                                       from_=chosen["from"], rerun=chosen["rerun"])
    preflight(cfg, stages, order)
    sub = {n: stages[n] for n in order}
    runner = Runner(cfg, sub, on_event=on_event)
    previous = runner.open_parent(resume_run_id)
    runner.resuming = bool(resume_run_id)
    if not resume_run_id and any(chosen.values()):
        runner.client.set_tag(runner.parent_id, SELECTION_TAG,
                              json.dumps({k: v for k, v in chosen.items() if v}))
    status, exit_code, termed = "FAILED", None, []
    old_term = signal.getsignal(signal.SIGTERM)

    def _term(signum, frame):
        termed.append(signum)
        raise _Interrupted()

    def _install() -> bool:
        try:
            signal.signal(signal.SIGTERM, _term)
            return True
        except ValueError:  # not the main thread
            return False

    if not _install():
        old_term = None
    try:
        runner.plan(order, must_reuse, forced, previous, use_cache)
        if not resume_run_id:  # a resumed run keeps the estimate its first attempt recorded
            runner.record_estimate()
            runner.started = time.time()
        with ray_session(cfg, address):
            if old_term is not None:
                _install()  # again: ray.init replaces it with Ray's own (a C++ stack dump, runs left RUNNING)
            runner.execute()
        ok = all(st.state in ("done", "reused") for st in runner.states.values())
        status = "FINISHED" if ok else "FAILED"
    except (KeyboardInterrupt, _Interrupted, SystemError) as exc:
        # a signal handler raising inside Ray's C++ wait comes back as a SystemError around it
        if isinstance(exc, SystemError) and not termed:
            raise
        runner.interrupt()
        status, exit_code = "KILLED", (128 + signal.SIGTERM if termed else None)
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
                   tracking_uri=runner.uri, exit_code=exit_code)


