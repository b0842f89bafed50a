"""Before any stage starts: can this process write where the pipeline will write?

One small object is written and deleted under the location; a failure becomes one
line naming the URI and what is wrong (no credentials, no such bucket, access
denied, endpoint unreachable), which the CLI prints with exit status 2.
"""

from __future__ import annotations

import uuid

from moeflow.core.errors import UserError
from moeflow.core.storage.uri import check_location, filesystem, is_uri


def _reason(exc: BaseException) -> str:
    """What went wrong, from botocore's / fsspec's error (never the traceback)."""
    text = f"{type(exc).__name__}: {exc}"
    checks = (
        (("NoCredentialsError", "Unable to locate credentials", "InvalidAccessKeyId",
          "SignatureDoesNotMatch", "DefaultCredentialsError"), "no valid credentials "
         "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or an instance role)"),
        (("NoSuchBucket", "bucket does not exist", "The specified bucket"), "the bucket does not exist"),
        (("AccessDenied", "Forbidden", "403", "PermissionError"), "writing is denied"),
        (("EndpointConnectionError", "Could not connect", "ConnectTimeout", "Connection refused"),
         "the endpoint cannot be reached (AWS_ENDPOINT_URL?)"),
    )
    for needles, reason in checks:
        if any(n in text for n in needles):
            return reason
    return (text.splitlines() or [type(exc).__name__])[0]


def check_writable(location: str, key: str = "workdir") -> None:
    """Raise UserError (one line, naming `key` and the URI) unless `location` takes a write.

    A local path is left to the stages (they create it); a store URI is probed.
    """
    check_location(location, key)
    if not is_uri(location):
        return
    probe = f"{location.rstrip('/')}/.moeflow-preflight-{uuid.uuid4().hex[:12]}"
    try:
        fs, path = filesystem(probe, fresh=True)
        fs.pipe_file(path, b"moeflow preflight: safe to delete\n")
        fs.rm(path)
    except Exception as exc:  # noqa: BLE001 - every failure is the same one line to the user
        raise UserError(f"{key}: cannot write to {location}: {_reason(exc)}") from exc


def check_readable(location: str, key: str) -> None:
    """Raise UserError unless the store URI `location` exists and can be listed."""
    check_location(location, key)
    if not is_uri(location):
        return
    try:
        fs, path = filesystem(location, fresh=True)
        found = fs.exists(path)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"{key}: cannot read {location}: {_reason(exc)}") from exc
    if not found:
        raise UserError(f"{key}: {location} does not exist")
