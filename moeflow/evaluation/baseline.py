"""Baselines in MLflow and the regression gate.

A baseline is an MLflow run tagged `moeflow.baseline=NAME`: metrics
`eval/<task>/<metric>` (+ `_stderr`), params (model, adapter, seed, versions),
and the artifact `baseline/results.json` with per-sample outputs, dataset
hashes, model manifest and adapter checksums, config and library versions.
Loading a name takes its most recent run, across experiments.

The gate (per task, sample by sample; see paired.py): a metric fails when its
mean per-sample delta worsens by more than max(abs_tol, k_stderr x the paired
standard error); with an `Agreement` rule, the candidate must also reproduce
the reference's recorded outputs (greedy tokens, per-token KL / top-1; a near-tie
flip is excused, see ties.py).
Results recorded before per-sample pairing (format 1) fall back to the
unpaired rule (k_stderr x the reference's standard error).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.evaluation.paired import kl_topk, logprob_agreement, per_sample_delta, samples_note
from moeflow.evaluation.record import flat_metrics
from moeflow.evaluation.suite import sha256_file
from moeflow.evaluation.ties import TIE_MARGIN, generation_agreement, kl_mean

BASELINE_TAG = "moeflow.baseline"
# the base model's architecture (config.json `architectures[0]`) a pipeline's baseline was
# recorded on: an unnamed lookup takes the last baseline of the suite on the same kind of
# model, never another family's (its adapter's scores say nothing about this one)
BASE_ARCH_TAG = "moeflow.base_arch"
RESULTS_ARTIFACT = "baseline/results.json"
_BASELINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Row:
    """One line of a comparison table."""

    task: str
    metric: str
    reference: float | None
    candidate: float | None
    threshold: float | None
    verdict: str  # pass | FAIL | better | info | skipped | new
    note: str = ""
    rule: str = ""  # paired | unpaired | output agreement | target gain

    @property
    def delta(self) -> float | None:
        if self.reference is None or self.candidate is None:
            return None
        return self.candidate - self.reference

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"


def dir_checksum(path: str | Path) -> str:
    """SHA-256 over (relative name, content hash) of every file under a directory."""

    root = Path(path)
    items = [(str(p.relative_to(root)), sha256_file(p))
             for p in sorted(root.rglob("*")) if p.is_file()]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """Checksum naming a checkpoint without reading its weights.

    The convert stage's manifest (per-tensor checksums) when present; otherwise
    config.json, the shard index and each shard's name and size — cheap at any scale.
    """

    root = Path(model_dir)
    manifest = root / "manifest.json"
    if manifest.is_file():
        return sha256_file(manifest)
    parts: list[tuple[str, str | int]] = [(p.name, sha256_file(p)) for p in sorted(root.glob("*.json"))]
    parts += [(p.name, p.stat().st_size) for p in sorted(root.glob("*.safetensors"))]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


# ---------------------------------------------------------------- comparing


def check_comparable(reference: dict, candidate: dict, label: str) -> None:
    """Refuse comparisons across different data, task settings or missing tasks.

    Raises:
        UserError: names the task and the file that changed.
    """
    dropped = sorted(set(reference["tasks"]) - set(candidate["tasks"]))
    if dropped:  # comparing fewer tasks could hide a regression
        raise UserError(f"{label} has task(s) {', '.join(dropped)} that this suite lacks; "
                        f"evaluate the same suite or record a new baseline")
    for name, cand in candidate["tasks"].items():
        ref = reference["tasks"].get(name)
        if ref is None:
            raise UserError(f"{label} has no task {name!r} (it has "
                            f"{', '.join(sorted(reference['tasks']))}); record a new baseline")
        a, b = ref["dataset"], cand["dataset"]
        if a["sha256"] != b["sha256"]:
            changed = [f for f in sorted(set(a["files"]) | set(b["files"]))
                       if a["files"].get(f) != b["files"].get(f)]
            detail = ", ".join(f"{f} (sha256 {str(a['files'].get(f))[:12]} in {label}, "
                               f"{str(b['files'].get(f))[:12]} now)" for f in changed)
            raise UserError(f"task {name}: dataset differs from {label}: {detail}")
        keys = [k for k in a if k not in ("sha256", "files") and a[k] != b.get(k)]
        if keys:
            raise UserError(f"task {name}: settings differ from {label}: " + ", ".join(
                f"{k} {a[k]!r} -> {b.get(k)!r}" for k in keys))
        if "metrics" in ref and "metrics" not in cand:
            raise UserError(f"task {name} was evaluated in {label} but not now "
                            f"({cand.get('skipped', 'skipped')})")


@dataclass(frozen=True)
class Agreement:
    """Output-agreement rule of a comparison.

    mode: "gate" fails beyond the tolerances (the candidate should be the same
    model: an unchanged one, a quantised one with looser tolerances); "report"
    shows the numbers without gating (a meant change, e.g. a retrained adapter).
    """

    mode: str = "gate"  # gate | report
    max_kl: float = 1e-3  # mean per-token KL(reference || candidate), nats
    min_token_agreement: float = 0.95  # greedy / top-1 tokens equal to the reference's
    tie_margin: float = TIE_MARGIN  # nats: a flip that moved the log-odds less is a near tie


def compare(reference: dict, candidate: dict, *, label: str = "baseline",
            exclude: tuple[str, ...] = (), agreement: Agreement | None = None) -> list[Row]:
    """Gate `candidate` against `reference`, task by task, sample by sample.

    Args:
        reference, candidate: result dicts (record.assemble).
        label: what the reference is, for messages ("baseline 'v1'", "base").
        exclude: tasks left out (a fine-tune's own tasks, judged by `check_gain`).
        agreement: also compare recorded outputs (greedy tokens, per-token
            log-probs) under this rule; None: task metrics only.

    Returns:
        One `Row` per metric (rule `paired`, or `unpaired` where a side lacks
        per-sample scores) and per agreement check; `row.failed` marks regressions.
    """
    check_comparable(reference, candidate, label)
    rows = []
    for name, cand in candidate["tasks"].items():
        if name in exclude:
            continue
        ref = reference["tasks"][name]
        if "metrics" not in cand:
            rows.append(Row(name, "-", None, None, None, "skipped", cand.get("skipped", "")))
            continue
        tol = cand["tolerance"]
        for metric, c in cand["metrics"].items():
            r = ref.get("metrics", {}).get(metric)
            if r is None:
                rows.append(Row(name, metric, None, c["value"], None, "new", "not in reference"))
                continue
            rows.append(_gate(name, metric, r, c, tol, ref.get("samples"), cand.get("samples")))
        if agreement is not None:
            rows += _agreement_rows(name, ref.get("samples") or [], cand.get("samples") or [],
                                    agreement)
    return rows


def _gate(task: str, metric: str, ref: dict, cand: dict, tol: dict,
          ref_samples: list[dict] | None = None, cand_samples: list[dict] | None = None) -> Row:
    """One metric: paired delta vs max(abs_tol, k x paired stderr) when both sides
    hold per-sample scores, else the unpaired rule (k x the reference's stderr)."""
    if not cand["gate"]:
        return Row(task, metric, ref["value"], cand["value"], None, "info", "not gated")
    paired = per_sample_delta(metric, ref_samples or [], cand_samples or [])
    if paired is not None:
        delta, se, moved = paired
        rule, note = "paired", f"changed in {samples_note(moved, cand_samples or [])}" if moved else ""
    else:
        delta, se, rule, note = cand["value"] - ref["value"], ref["stderr"] or 0.0, "unpaired", ""
    threshold = max(tol["abs_tol"], tol["k_stderr"] * se)
    sign = 1.0 if cand["higher_is_better"] else -1.0
    change = sign * delta  # > 0: better
    verdict = "FAIL" if change < -threshold else "better" if change > threshold else "pass"
    if verdict == "FAIL" and note:
        note = note.replace("changed in", "worse in", 1)
    return Row(task, metric, ref["value"], cand["value"], threshold, verdict, note, rule)


def _agreement_rows(task: str, ref: list[dict], cand: list[dict], rule: Agreement) -> list[Row]:
    """Token-agreement and KL rows of one task (none when outputs are not recorded)."""
    fail = "FAIL" if rule.mode == "gate" else "info"
    gen = generation_agreement(ref, cand, rule.tie_margin, kl=kl_topk)
    if gen is not None:
        ok = gen["token_agreement"] >= rule.min_token_agreement
        note = samples_note(gen["changed"], cand)
        ties = _ties_note(len(gen["ties"]), rule)
        rows = [Row(task, "greedy_token_agreement", 1.0, gen["token_agreement"],
                    rule.min_token_agreement, "pass" if ok else fail,
                    "; ".join(x for x in (note and f"outputs differ: {note}", ties) if x),
                    "output agreement")]
        if gen["kl"]:  # per-step records: KL over the steps taken on the same context
            mean = kl_mean(gen["kl"])
            rows.append(Row(task, "kl_mean", 0.0, mean, rule.max_kl,
                            "pass" if mean <= rule.max_kl else fail,
                            f"max per-step KL {max(gen['kl']):.2e}", "output agreement"))
        return rows
    lp = logprob_agreement(ref, cand, rule.tie_margin)
    if lp is None:
        return []
    note = samples_note(lp["changed"], cand)
    detail = f"max per-token KL {lp['kl_max']:.2e}" + (f"; differ: {note}" if note else "")
    top1_note = "; ".join(x for x in (note and f"differ: {note}", _ties_note(lp["ties"], rule)) if x)
    return [Row(task, "top1_agreement", 1.0, lp["top1_agreement"], rule.min_token_agreement,
                "pass" if lp["top1_agreement"] >= rule.min_token_agreement else fail,
                top1_note, "output agreement"),
            Row(task, "kl_mean", 0.0, lp["kl_mean"], rule.max_kl,
                "pass" if lp["kl_mean"] <= rule.max_kl else fail, detail, "output agreement")]


def _ties_note(n: int, rule: Agreement) -> str:
    return f"{n} near-tie flip(s) excused (swing <= {rule.tie_margin:g} nats)" if n else ""


def check_gain(base: dict, adapter: dict, target_tasks: list[str],
               min_gain: float = 0.0) -> list[Row]:
    """The fine-tune must help on its own tasks (paired deltas, as `compare`).

    A target task passes when at least one gated metric improves by more than
    `min_gain` and none worsens beyond its threshold.

    Returns:
        One `Row` per gated metric of each target task (rule `target gain`).
    """
    rows = []
    for name in target_tasks:
        b, a = base["tasks"][name], adapter["tasks"][name]
        if "metrics" not in a or "metrics" not in b:
            raise UserError(f"target task {name} could not run on this model: "
                            f"{a.get('skipped', '')}")
        task_rows = []
        for metric, m in a["metrics"].items():
            if not m["gate"]:
                continue
            gated = _gate(name, metric, b["metrics"][metric], m, a["tolerance"],
                          b.get("samples"), a.get("samples"))
            sign = 1.0 if m["higher_is_better"] else -1.0
            gain = sign * (m["value"] - b["metrics"][metric]["value"])
            task_rows.append((gated, gain))
        helped = any(g > min_gain for _, g in task_rows)
        hurt = any(r.failed for r, _ in task_rows)
        for r, gain in task_rows:
            ok = helped and not hurt
            note = "fine-tune target: must improve" + ("" if ok else
                                                       " (no metric improved)" if not hurt
                                                       else f" ({r.note})" if r.failed else "")
            rows.append(Row(r.task, r.metric, r.reference, r.candidate, min_gain,
                            ("better" if gain > min_gain else "pass") if ok else "FAIL", note,
                            "target gain"))
    return rows


# ---------------------------------------------------------------- MLflow


def _client(tracking_uri: str | None):
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    uri = client.tracking_uri
    location = None
    if uri.startswith("sqlite:///"):  # artifacts beside a local db, never in the CWD
        location = (Path(uri[len("sqlite:///"):]).resolve().parent / "artifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def log_result(result: dict, *, tracking_uri: str | None, experiment: str = "moeflow",
               run_id: str | None = None, run_name: str | None = None,
               tags: dict[str, str] | None = None, extra: dict | None = None) -> str:
    """Log an evaluation result to MLflow: metrics, tags, params, results + samples.

    Args:
        result: result dict (record.assemble).
        tracking_uri: MLflow tracking store.
        experiment: experiment of a new run (ignored when `run_id` is given).
        run_id: log into this existing run (a pipeline stage's own run) and leave it open.
        run_name: name of a new run.
        tags: extra run tags.
        extra: stored in `baseline/results.json` beside the result (checksums, config, seed).

    Returns:
        The MLflow run id.
    """
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.entities import Metric, Param, RunTag

    client = _client(tracking_uri)
    owned = run_id is None
    if run_id is None:
        exp_id = _experiment_id(client, experiment)
        run_id = client.create_run(exp_id, run_name=run_name).info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in sorted(flat_metrics(result).items())]
    all_tags = {"moeflow.suite": result["suite"], "moeflow.suite_sha256": result["suite_sha256"],
                **(tags or {})}
    params = {"eval.model": result["model"], "eval.adapter": str(result["adapter"]),
              **{f"eval.{k}": str(v) for k, v in result["settings"].items()},
              **{f"eval.version.{k}": v for k, v in result["versions"].items()}}
    if not owned:  # a stage run already holds its config params; don't clash
        params = {}
    try:
        for i in range(0, max(len(metrics), 1), 1000):  # MLflow's log_batch limits
            client.log_batch(run_id, metrics=metrics[i:i + 1000],
                             params=[Param(k, v[:500]) for k, v in params.items()] if i == 0
                             else [])
        client.log_dict(run_id, dict(result, **(extra or {})), RESULTS_ARTIFACT)
        for task, data in result["tasks"].items():
            if data.get("samples"):
                client.log_table(run_id, _columns(data["samples"]),
                                 f"baseline/samples/{task}.json")
        # tags last: the tags are what `find_baseline` searches, so a run is only
        # found once its results artifact is complete
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in all_tags.items()])
    except BaseException:
        if owned:
            client.set_terminated(run_id, "FAILED")
        raise
    if owned:
        client.set_terminated(run_id)
    return run_id


def record_baseline(name: str, result: dict, **kwargs) -> str:
    """Record `result` as baseline `name` (tag `moeflow.baseline`); see `log_result`.

    Returns:
        The MLflow run id.
    """
    if not name or not _BASELINE_NAME.match(name):
        raise UserError(f"baseline name {name!r}: use letters, digits, '.', '_' or '-'")
    tags = dict(kwargs.pop("tags", None) or {}, **{BASELINE_TAG: name})
    kwargs.setdefault("run_name", f"baseline-{name}")
    kwargs["extra"] = dict(kwargs.get("extra") or {}, baseline=name)
    return log_result(result, tags=tags, **kwargs)


def _columns(samples: list[dict]) -> dict[str, list]:
    keys = list(samples[0])
    return {k: [json.dumps(s.get(k)) if isinstance(s.get(k), (list, dict)) else s.get(k)
                for s in samples] for k in keys}


def find_baseline(name: str | None, *, tracking_uri: str | None,
                  suite_sha256: str | None = None, base_arch: str | None = None) -> str | None:
    """Run id of the latest baseline `name` (or, with name None, the latest for this suite,
    recorded on a base of architecture `base_arch` when that is given)."""
    client = _client(tracking_uri)
    if name is not None and not _BASELINE_NAME.match(name):
        raise UserError(f"baseline name {name!r}: use letters, digits, '.', '_' or '-'")
    if name is not None:
        where = f"tags.`{BASELINE_TAG}` = '{name}'"
    else:
        where = f"tags.`moeflow.suite_sha256` = '{suite_sha256}'"
        if base_arch is not None:
            if not _BASELINE_NAME.match(base_arch):  # it goes into the filter string
                raise UserError(f"config.json architectures[0] {base_arch!r}: not a class name")
            where += f" and tags.`{BASE_ARCH_TAG}` = '{base_arch}'"
    # both conditions in the query: a post-filter over the latest N runs of the suite
    # missed a baseline older than N ordinary evaluation runs
    where += f" and tags.`{BASELINE_TAG}` LIKE '%' and attributes.status != 'FAILED'"
    runs = client.search_runs(_experiment_ids(client), filter_string=where,
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def _experiment_ids(client) -> list[str]:
    """Every active experiment's id (all pages)."""
    ids, token = [], None
    while True:
        page = client.search_experiments(page_token=token)
        ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            return ids


def load_baseline(name: str | None, *, tracking_uri: str | None,
                  suite_sha256: str | None = None, base_arch: str | None = None) -> tuple[str, dict] | None:
    """Load a recorded baseline.

    Args:
        name: baseline name; None: the latest baseline of the suite with this hash (and,
            with `base_arch`, recorded on a base of that architecture).
        tracking_uri: MLflow tracking store.

    Returns:
        (run id, result dict), or None when `name` is None and nothing is recorded.

    Raises:
        UserError: a named baseline does not exist.
    """
    # lazy: mlflow: heavy, loaded only when this runs
    import mlflow

    run_id = find_baseline(name, tracking_uri=tracking_uri, suite_sha256=suite_sha256,
                           base_arch=base_arch)
    if run_id is None:
        if name is None:
            return None
        raise UserError(f"no baseline named {name!r} in MLflow store {tracking_uri}; "
                        f"record one with `moeflow regress --record-baseline {name}`")
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="mf-baseline-") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=RESULTS_ARTIFACT, dst_path=tmp,
                tracking_uri=tracking_uri)
            return run_id, json.loads(Path(local).read_text())
        except (MlflowException, OSError, ValueError) as exc:  # ValueError: bad JSON
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"baseline {name or suite_sha256!r} (MLflow run {run_id}): cannot "
                            f"read its {RESULTS_ARTIFACT}: {first}") from None
