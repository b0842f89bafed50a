"""Store URIs (`s3://bucket/prefix`, `gs://`, `abfss://`, ...) and local paths, one API.

fsspec, not pyarrow's filesystems, is the layer: MLflow, Ray Data and Hugging Face
already speak it, one package per cloud adds the scheme (s3fs, gcsfs, adlfs) with the
same streaming (`open` with ranged block reads, multipart `put_file`), and Ray Train,
which wants a pyarrow filesystem, takes any fsspec one through pyarrow's
`FSSpecHandler` (`pyarrow_filesystem`). pyarrow's own S3/GCS filesystems cover fewer
stores (no abfss:// with a service principal, no local listings cache control) and
would still need fsspec beside them for MLflow and Hugging Face.

Endpoints and credentials come from the platform's usual environment
(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, instance roles, `GOOGLE_APPLICATION_CREDENTIALS`,
...): moeflow never forwards secrets itself.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from pathlib import Path

from moeflow.core.errors import UserError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$")
LOCAL_SCHEMES = {"file", "local"}


def is_uri(value: object) -> bool:
    """True for a store URI (`scheme://...` other than file://), False for a local path."""
    if not isinstance(value, str):
        return False
    m = _SCHEME.match(value)
    return bool(m and len(m.group(1)) > 1 and m.group(2) == "//"
                and m.group(1).lower() not in LOCAL_SCHEMES)


def check_location(value: str, key: str) -> None:
    """Refuse a location that looks like a URI but is not one (`s3:/bucket`, `s3:bucket`):
    taken as a local path it would write to a directory literally named `s3:`.

    Raises:
        UserError: naming `key` and the value.
    """
    m = _SCHEME.match(value or "")
    if not m or len(m.group(1)) == 1:  # a Windows drive letter is a path
        return
    if m.group(2) != "//" and m.group(1).lower() not in LOCAL_SCHEMES:
        raise UserError(f"{key}: {value!r} is not a URI (write {m.group(1)}://{m.group(3)}) "
                        "nor a local path")
    if is_uri(value):
        scheme = m.group(1).lower()
        try:
            # lazy: fsspec: optional dependency
            import fsspec

            fsspec.get_filesystem_class(scheme)
        except (ImportError, ValueError) as exc:
            first = (str(exc).splitlines() or [""])[0]
            raise UserError(f"{key}: {value}: no filesystem for {scheme}:// ({first})") from None
        if not m.group(3).strip("/"):
            raise UserError(f"{key}: {value}: the URI names no bucket")


def join(base: str, *parts: str) -> str:
    """`base` / parts, for a URI or a local path."""
    if is_uri(base):
        return posixpath.join(base.rstrip("/"), *[p.strip("/") for p in parts if p])
    return str(Path(base, *parts))


def filesystem(location: str, fresh: bool = False):
    """(fsspec filesystem, path inside it) of a URI or a local path.

    Directory listings are never cached: other nodes write the same prefixes. `fresh`: a
    new client, reading credentials and endpoint from the environment again.
    """
    # lazy: fsspec: heavy, loaded only when this runs
    import fsspec.core

    options = {"use_listings_cache": False} if is_uri(location) else {}
    if fresh:
        options["skip_instance_cache"] = True
    fs, path = fsspec.core.url_to_fs(location, **options)
    return fs, path


def pyarrow_filesystem(location: str):
    """(pyarrow filesystem, path) for Ray Train's `storage_filesystem`/`storage_path`."""
    # lazy: pyarrow: heavy, loaded only when this runs
    import pyarrow.fs

    fs, path = filesystem(location)
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)), path


def fingerprint(location: str) -> str:
    """Cheap identity of what a URI names, for cache keys: its output manifest's digest, else
    the object's ETag (or size and mtime); "" when it cannot be read."""

    fs, path = filesystem(location)
    try:
        return "manifest:" + hashlib.sha256(fs.cat_file(f"{path.rstrip('/')}/_manifest.json")).hexdigest()
    except (FileNotFoundError, OSError):
        pass
    try:
        info = fs.info(path)
    except (FileNotFoundError, OSError):
        return ""
    return str(info.get("ETag") or (info.get("size"), info.get("LastModified") or info.get("mtime")))


def exists(location: str) -> bool:
    fs, path = filesystem(location)
    return fs.exists(path)


def read_text(location: str) -> str:
    fs, path = filesystem(location)
    return fs.cat_file(path).decode("utf-8")


def write_text(location: str, text: str) -> None:
    """Write a small object whole (one PUT on a store: readers never see half of it)."""
    fs, path = filesystem(location)
    if not is_uri(location):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_name(Path(path).name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return
    fs.pipe_file(path, text.encode("utf-8"))


def remove(location: str) -> None:
    """Delete a file or a whole prefix; nothing there is fine."""
    fs, path = filesystem(location)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
