"""Gate verdicts on registered model versions (MLflow model registry tags).

A version's verdict is the tag `moeflow.verdict` (PASS | FAIL) with
`moeflow.verdict_run` (the MLflow run holding the comparison table and the
results), `moeflow.verdict_reason` (one line) and `moeflow.verdict_reference`
(what it was gated against). `moeflow watch` and the regress stage write them;
`moeflow deploy` / `serve` refuse a version without PASS unless `--force`.
"""

from __future__ import annotations

import re

from moeflow.errors import UserError

VERDICT = "moeflow.verdict"
RUN = "moeflow.verdict_run"
REASON = "moeflow.verdict_reason"
REFERENCE = "moeflow.verdict_reference"
_URI = re.compile(r"^models:/([^/@]+)(?:/(\d+)|@([A-Za-z0-9_.-]+))$")


def set_verdict(client, name: str, version: str | int, passed: bool, run_id: str | None,
                reason: str, reference: str) -> None:
    version = str(version)
    client.set_model_version_tag(name, version, REASON, reason[:4000])
    client.set_model_version_tag(name, version, REFERENCE, reference)
    if run_id:
        client.set_model_version_tag(name, version, RUN, run_id)
    client.set_model_version_tag(name, version, VERDICT, "PASS" if passed else "FAIL")  # last: it marks done


def verdict_of(client, name: str, version: str | int) -> tuple[str | None, str]:
    """(PASS | FAIL | None, reason) of a version."""
    tags = client.get_model_version(name, str(version)).tags
    return tags.get(VERDICT), tags.get(REASON, "")


def parse_uri(uri: str) -> tuple[str, str] | None:
    """(name, version) of `models:/name/version`, (name, "@alias") of `models:/name@alias`;
    None for anything else."""
    m = _URI.match(uri)
    if not m:
        return None
    return (m.group(1), m.group(2)) if m.group(2) else (m.group(1), "@" + m.group(3))


def require_pass(tracking_uri: str, versions: list[tuple[str, str]], force: bool, notify=print) -> None:
    """Refuse (UserError, one line) a model version whose gate verdict is not PASS, unless force."""
    if not versions:
        return
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for name, version in versions:
        try:
            if version.startswith("@"):  # an alias: the version it points at now
                version = client.get_model_version_by_alias(name, version[1:]).version
            verdict, reason = verdict_of(client, name, version)
        except MlflowException:
            raise UserError(f"models:/{name}/{version}: no such registered model version in {tracking_uri}") \
                from None
        if verdict == "PASS":
            continue
        why = f"its gate verdict is FAIL ({reason})" if verdict == "FAIL" else \
            "it has no gate verdict yet (run `moeflow watch --once`)"
        if force:
            notify(f"deploying models:/{name}/{version} although {why} (--force)")
            continue
        raise UserError(f"refusing to deploy models:/{name}/{version}: {why}; --force deploys it anyway")
