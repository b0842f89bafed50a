"""Gate verdicts on registered model versions (MLflow model registry tags).

A version's verdict is the tag `moeflow.verdict` (PASS | FAIL) with
`moeflow.verdict_run` (the MLflow run holding the comparison table and the
results), `moeflow.verdict_results` (the artifact of that run holding the
version's own outputs: what the next version of its lineage is compared with),
`moeflow.verdict_reason` (one line) and `moeflow.verdict_reference` (what it was
gated against). `moeflow watch` and the regress stage write them; `moeflow
deploy` / `serve` and a running server's `POST /v1/load_lora_adapter` refuse a
version without PASS unless started with `--force`.

A verdict that could not be reached for want of a tag (`moeflow.verdict_wants`
= `base_dir=<the value it had>`) is gated again once that tag changes; any
version is gated again by `moeflow watch --regate models:/NAME/VERSION`.
"""

from __future__ import annotations

import contextlib
import re

from moeflow.core.errors import UserError

VERDICT = "moeflow.verdict"
RUN = "moeflow.verdict_run"
REASON = "moeflow.verdict_reason"
REFERENCE = "moeflow.verdict_reference"
RESULTS = "moeflow.verdict_results"
WANTS = "moeflow.verdict_wants"
_URI = re.compile(r"^models:/([^/@]+)(?:/(\d+)|@([A-Za-z0-9_.-]+))$")


def set_verdict(client, name: str, version: str | int, passed: bool, run_id: str | None,
                reason: str, reference: str, results: str | None = None, wants: str | None = None) -> None:
    """Tag a version with its verdict (the verdict tag last: it marks the gate done).

    Args:
        results: artifact path, in `run_id`, of the version's recorded outputs.
        wants: `tag=value` a FAIL was for want of (gated again once the tag changes).
    """
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException

    version = str(version)
    client.set_model_version_tag(name, version, REASON, reason[:4000])
    client.set_model_version_tag(name, version, REFERENCE, reference)
    for key, value in ((RUN, run_id), (RESULTS, results), (WANTS, wants)):
        if value:
            client.set_model_version_tag(name, version, key, value)
        elif key in (RESULTS, WANTS) and key in client.get_model_version(name, version).tags:
            with contextlib.suppress(MlflowException):  # a re-gate: the earlier verdict's no longer holds
                client.delete_model_version_tag(name, version, key)
    client.set_model_version_tag(name, version, VERDICT, "PASS" if passed else "FAIL")


def clear_verdict(client, name: str, version: str | int) -> None:
    """Make a version pending again (`moeflow watch --regate`): its verdict tag removed."""
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException

    with contextlib.suppress(MlflowException):  # none yet: pending already
        client.delete_model_version_tag(name, str(version), VERDICT)


def wanted_tag_changed(tags: dict) -> bool:
    """True when a FAIL for want of a tag (WANTS `tag=value`) now has another value of that tag."""
    key, sep, value = tags.get(WANTS, "").partition("=")
    return bool(key and sep) and tags.get(VERDICT) == "FAIL" and tags.get(key, "") != value


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


def resolve_verdict(client, name: str, version: str) -> tuple[str, str | None, str]:
    """(version, PASS | FAIL | None, reason) of `name`/`version`, an alias (`@alias`) resolved to
    the version it points at now.

    Raises:
        UserError: no such registered model version in the client's store.
    """
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.exceptions import MlflowException

    try:
        if version.startswith("@"):
            version = str(client.get_model_version_by_alias(name, version[1:]).version)
        verdict, reason = verdict_of(client, name, version)
    except MlflowException:
        raise UserError(f"models:/{name}/{version}: no such registered model version in "
                        f"{client.tracking_uri}") from None
    return version, verdict, reason


def why_refused(verdict: str | None, reason: str) -> str:
    """Why a version without PASS is not served, naming its verdict."""
    if verdict == "FAIL":
        return f"its gate verdict is FAIL ({reason})"
    return "it has no gate verdict yet (run `moeflow watch --once`)"


def require_pass(tracking_uri: str, versions: list[tuple[str, str]], force: bool, notify=print) -> None:
    """Refuse (UserError, one line) a model version whose gate verdict is not PASS, unless force."""
    if not versions:
        return
    # lazy: mlflow: heavy, loaded only when this runs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for name, version in versions:
        version, verdict, reason = resolve_verdict(client, name, version)
        if verdict == "PASS":
            continue
        why = why_refused(verdict, reason)
        if force:
            notify(f"deploying models:/{name}/{version} although {why} (--force)")
            continue
        raise UserError(f"refusing to deploy models:/{name}/{version}: {why}; --force deploys it anyway")
