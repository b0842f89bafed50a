"""`moeflow watch`: gate every new registered model version on the fixed suite.

    moeflow watch                        # every registered model, poll every 10 s, until Ctrl-C
    moeflow watch --model demo-adapter --once --webhook http://hooks.example/moeflow

A version is pending until it carries a verdict tag (moeflow.evaluation.verdict), so
the watcher keeps no state of its own: killed and restarted, it picks up
where it stopped (a version whose gate was cut short is gated again). A FAIL
for want of a usable `base_dir` tag is pending again once that tag changes;
`moeflow watch --regate models:/NAME/N` makes any version pending again.

What a version is gated against:
- an adapter (the version holds adapter_config.json) against its base (the
  version's `base_dir` tag, a dir or store URI, which the finetune stage sets): no task may
  regress, sample by sample (the paired gate);
- every version against its lineage's last PASS (the latest earlier version
  of the same registered model that passed, whoever gated it: this watcher or
  the pipeline's regress stage, both record the version's outputs): task
  metrics gated, and when it is the same model (same base and adapter
  checksums) its recorded outputs must be reproduced (greedy tokens, per-token
  KL). A reference whose recorded outputs are missing or from another suite is
  evaluated again here; one that cannot be is a FAIL naming it, never a
  comparison silently skipped;
- a lineage's first full checkpoint (merged, calibrated, a new base) has no
  reference yet: it passes on its own results, which become the reference.

Each verdict is an MLflow run (experiment `moeflow-watch`: the table, the
results, links to the version) and tags on the version; a FAIL also POSTs a
JSON notification to the webhook, when one is configured.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.core.storage import is_uri, localize
from moeflow.evaluation import verdict as V
from moeflow.evaluation.baseline import Agreement, check_comparable, compare, dir_checksum, model_fingerprint
from moeflow.evaluation.gate import Section, against_base, identity
from moeflow.evaluation.record import flat_metrics
from moeflow.evaluation.report import failure_summary, gate_table, render_text
from moeflow.evaluation.runners import evaluate
from moeflow.evaluation.suite import load_suite
from moeflow.evaluation.ties import TIE_MARGIN

log = logging.getLogger("moeflow.watch")
RESULTS = "verdict/results.json"


@dataclass
class WatchSettings:
    tracking_uri: str
    models: list[str] = field(default_factory=list)  # empty: every registered model
    suite: str | None = None  # None: the shipped golden suite
    experiment: str = "moeflow-watch"
    webhook: str | None = None
    dtype: str = "float32"
    batch_size: int = 16
    seed: int = 0
    max_kl: float = 1e-3
    min_token_agreement: float = 0.95
    tie_margin: float = TIE_MARGIN  # nats: a greedy flip that moved the log-odds less is a near tie


def pending(client, models: list[str]) -> list:
    """Versions without a verdict, and FAILs for want of a tag that has changed since, oldest first."""
    names = models or [m.name for m in client.search_registered_models()]
    out = []
    for name in names:
        out += [v for v in client.search_model_versions(f"name='{name}'")
                if V.VERDICT not in v.tags or V.wanted_tag_changed(v.tags)]
    return sorted(out, key=lambda v: (int(v.creation_timestamp or 0), v.name, int(v.version)))


def last_pass(client, name: str, version: int):
    """The latest earlier version of `name` whose verdict is PASS (None: none)."""
    passed = [v for v in client.search_model_versions(f"name='{name}'")
              if int(v.version) < version and v.tags.get(V.VERDICT) == "PASS" and v.tags.get(V.RUN)]
    return max(passed, key=lambda v: int(v.version), default=None)


def _download(settings: WatchSettings, mv, dest: Path) -> Path:
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dest),
                                                        tracking_uri=settings.tracking_uri))
    except MlflowException:
        raise  # the store: transient, retried at the next poll
    except Exception as exc:  # noqa: BLE001 - artifacts that are not there: this version's fault
        raise UserError(f"cannot download {mv.source}: {_line(exc)}") from None


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def evaluate_version(settings: WatchSettings, suite, mv, local: Path) -> dict:
    """{"kind", "result", "base", "identity"} of one version (base evaluated for adapters)."""

    def run(model: str, adapters: list[str | None]) -> list[dict]:
        return evaluate(suite, model, adapters, dtype=settings.dtype, batch_size=settings.batch_size,
                        seed=settings.seed)

    if (local / "adapter_config.json").is_file():
        base = _base_dir(mv)
        base_res, res = run(base, [None, str(local)])
        return {"kind": "adapter", "result": res, "base": base_res,
                "identity": identity(model_fingerprint(base), dir_checksum(local))}
    if (local / "config.json").is_file():
        return {"kind": "checkpoint", "result": run(str(local), [None])[0], "base": None,
                "identity": identity(model_fingerprint(local))}
    raise UserError(f"{mv.source}: neither a PEFT adapter (adapter_config.json) nor a checkpoint (config.json)")


class MissingTag(UserError):
    """A version that cannot be gated for want of a tag (`wants`: `tag=value` it had)."""

    def __init__(self, message: str, tag: str, value: str):
        super().__init__(message)
        self.wants = f"{tag}={value}"


def _base_dir(mv) -> str:
    """The local base checkpoint of an adapter version: its `base_dir` tag (a dir, or a store
    URI fetched into this node's cache)."""
    base = mv.tags.get("base_dir", "")
    hint = ("set the version's base_dir tag to the base checkpoint it was trained on (a dir or "
            "store URI) and the watcher gates it again")
    if not base:
        raise MissingTag(f"no base_dir tag, nothing to gate the adapter on: {hint}", "base_dir", base)
    try:
        local = localize(base) if is_uri(base) else base
    except UserError as exc:
        raise MissingTag(f"base_dir {base}: {exc}; {hint}", "base_dir", base) from None
    if not Path(local, "config.json").is_file():
        raise MissingTag(f"base_dir {base}: no config.json there; {hint}", "base_dir", base)
    return local


def _sections(client, settings: WatchSettings, suite, mv, got: dict) -> tuple[list, str]:
    """The candidate against its base (adapters) and its lineage's last PASS; (sections, the
    references named: both, always)."""
    sections, refs = [], []
    if got["base"] is not None:
        sections += against_base(got["base"], {"candidate": got["result"]}, {}, Agreement("report", 1, 0))
        refs.append("base")
    prev = last_pass(client, mv.name, int(mv.version))
    if prev is None:
        refs.append("no earlier PASS (first of its lineage)")
        return sections, ", ".join(refs)
    recorded = _reference(client, settings, suite, prev, got)
    same = recorded.get("identity") == got["identity"]
    rule = Agreement("gate" if same else "report", settings.max_kl, settings.min_token_agreement,
                     settings.tie_margin)
    label = f"version {prev.version} ({'same model' if same else 'changed'})"
    sections.append(Section("candidate", label, compare(recorded["result"], got["result"],
                                                        label=f"version {prev.version}", agreement=rule)))
    refs.append(label)
    return sections, ", ".join(refs)


def _reference(client, settings: WatchSettings, suite, prev, got: dict) -> dict:
    """{"identity", "result"} of the lineage's last PASS: the outputs its verdict run recorded
    (this watcher's or the regress stage's), else -- none recorded, or on another suite --
    the version evaluated again now.

    Raises:
        UserError: it can be neither read nor evaluated (naming the version).
    """
    label = f"version {prev.version}"
    recorded = _recorded(client, prev)
    if recorded is not None:
        try:
            check_comparable(recorded["result"], got["result"], label)
            return recorded
        except UserError:
            log.info("%s's recorded outputs are from another suite: evaluating it again", label)
    with tempfile.TemporaryDirectory(prefix="moeflow-watch-") as tmp:
        try:
            again = evaluate_version(settings, suite, prev, _download(settings, prev, Path(tmp)))
        except UserError as exc:
            raise UserError(f"cannot compare with {label}, the lineage's last PASS: {exc}") from None
    return {"identity": again["identity"], "result": again["result"]}


def _recorded(client, mv) -> dict | None:
    """The outputs a version's verdict run recorded (None: none, e.g. a verdict of an older
    regress stage): the artifact its RESULTS tag names, else a watcher run's RESULTS."""
    with tempfile.TemporaryDirectory(prefix="moeflow-watch-") as tmp:
        try:
            path = client.download_artifacts(mv.tags[V.RUN], mv.tags.get(V.RESULTS, RESULTS), tmp)
            return json.loads(Path(path).read_text())
        except Exception:  # noqa: BLE001 - absent artifact: no outputs recorded
            return None


def gate(client, settings: WatchSettings, suite, mv) -> dict:
    """Gate one version; write its verdict run and tags. Returns the verdict record (its
    `failures`: one short line per failed check, for a terminal; `table`: all of them)."""
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException

    t0 = time.monotonic()
    got, reference, wants = None, "none", None
    sections: list[Section] = []
    with tempfile.TemporaryDirectory(prefix="moeflow-watch-") as tmp:
        try:
            local = _download(settings, mv, Path(tmp))
            got = evaluate_version(settings, suite, mv, local)
            sections, reference = _sections(client, settings, suite, mv, got)
            failed = [s for s in sections if s.failed]
            passed = not failed
            reason = "; ".join(f"{s.title}: {failure_summary(s.rows, s.reference)}" for s in failed) \
                or f"no regression vs {reference}"
        except UserError as exc:
            got, passed, reason, wants = None, False, str(exc), getattr(exc, "wants", None)
        except MlflowException:
            raise  # the store, not the version: the loop retries it at the next poll
        except Exception as exc:  # noqa: BLE001 - e.g. PEFT refusing the adapter: the version fails
            got, passed = None, False
            reason = f"evaluation failed: {type(exc).__name__}: {_line(exc)}"
    table = render_text(gate_table(sections, f"models:/{mv.name}/{mv.version} on suite {suite.name} "
                                             f"({suite.sha256[:12]})"), width=220) if sections else ""
    run_id = _verdict_run(client, settings, mv, passed, reason, reference, table, got)
    V.set_verdict(client, mv.name, mv.version, passed, run_id, reason, reference,
                  results=RESULTS if got is not None else None, wants=wants)
    record = {"model": mv.name, "version": str(mv.version), "verdict": "PASS" if passed else "FAIL",
              "reason": reason, "reference": reference, "run_id": run_id, "table": table,
              "failures": failure_lines(sections), "seconds": round(time.monotonic() - t0, 2)}
    if not passed and settings.webhook:
        notify_webhook(settings.webhook, record)
    return record


def failure_lines(sections) -> list[str]:
    """One short line per failed check: `<model> vs <reference>: task/metric a -> b (...)`."""
    def num(v) -> str:
        return "-" if v is None else f"{v:.4g}"

    return [f"{s.title}: {r.task}/{r.metric} {num(r.reference)} -> {num(r.candidate)} "
            f"(threshold {num(r.threshold)})" for s in sections for r in s.rows if r.failed]


def _verdict_run(client, settings: WatchSettings, mv, passed: bool, reason: str, reference: str,
                 table: str, got: dict | None) -> str:
    # lazy: loads mlflow, which importing this module does not
    from moeflow.core.tracking import artifact_root_for, experiment_id

    exp = experiment_id(client, settings.experiment, artifact_root_for(settings.tracking_uri))
    run = client.create_run(exp, run_name=f"verdict-{mv.name}-v{mv.version}", tags={
        "moeflow.kind": "verdict", "moeflow.model_name": mv.name, "moeflow.model_version": str(mv.version),
        "moeflow.model_uri": f"models:/{mv.name}/{mv.version}", V.VERDICT: "PASS" if passed else "FAIL",
        "mlflow.note.content": reason[:4000]})
    rid = run.info.run_id
    client.log_param(rid, "reference", reference[:500])
    if got is not None:
        for key, value in flat_metrics(got["result"]).items():
            client.log_metric(rid, key, value)
        client.log_dict(rid, {"identity": got["identity"], "kind": got["kind"], "result": got["result"]}, RESULTS)
    client.log_text(rid, table or reason, "verdict/comparison.txt")
    client.set_terminated(rid, "FINISHED")
    return rid


def notify_webhook(url: str, record: dict) -> None:
    """POST the verdict as JSON; a webhook that fails is logged, never fatal to the watcher."""
    # lazy: httpx: heavy, loaded only when this runs
    import httpx

    try:
        httpx.post(url, json={"text": f"moeflow gate FAIL: models:/{record['model']}/{record['version']}: "
                                      f"{record['reason']}", **record}, timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("webhook %s failed: %s", url, exc)


def watch(settings: WatchSettings, *, once: bool = False, interval_s: float = 10.0, on_verdict=print,
          stop=None) -> list[dict]:
    """Gate pending versions until stopped (`once`: one pass). Returns the verdicts made."""
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient


    client = MlflowClient(tracking_uri=settings.tracking_uri)
    suite = load_suite(settings.suite)
    done = []
    while True:
        try:
            for mv in pending(client, settings.models):
                record = gate(client, settings, suite, mv)
                done.append(record)
                on_verdict(record)
        except MlflowException as exc:  # the store went away: say so, try again at the next poll
            if once:
                raise UserError(f"MLflow ({settings.tracking_uri}): {_line(exc)}") from None
            log.warning("MLflow store unavailable, retrying in %.0f s: %s", interval_s, _line(exc))
        if once or (stop is not None and stop.is_set()):
            return done
        if stop is not None:
            stop.wait(interval_s)
        else:
            time.sleep(interval_s)
