"""Stage outputs in a store: published whole with a manifest, fetched into a node-local cache.

An output is a directory tree under a URI. `publish` uploads its files (s3fs sends
files above its chunk size as multipart uploads, several files at once) and writes
`_manifest.json` (size and sha256 of every file) LAST: a reader that finds the
manifest finds every file it lists, and a crash mid-upload leaves no manifest, so
the output does not exist. `fetch` reads the manifest and downloads only the files
under the sub-path asked for into the node's cache, checking each file's sha256
before it is renamed into place; the cache is bounded (least recently used entries
go first) and keyed by the manifest's digest, so a republished output never serves
stale files.

Node-local scratch: `MOEFLOW_SCRATCH` (default `<tmp>/moeflow-scratch-<uid>`), the
cache under it (`MOEFLOW_CACHE_DIR` to move it, `MOEFLOW_CACHE_GB` bound, default 100).
Reading one tensor of a big file without the rest: `open_ranged` (ranged GETs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.core.storage.uri import filesystem, is_uri, join

MANIFEST = "_manifest.json"
CHUNK = 8 << 20


class NotPublished(UserError):
    """A URI inside no published output (unfinished, deleted, or a plain prefix)."""


class NotAnOutput(UserError):
    """No manifest at this URI (it may still lie inside a published output)."""


def scratch_root() -> Path:
    """This node's scratch directory (stage work dirs and the cache live here)."""
    root = os.environ.get("MOEFLOW_SCRATCH") or str(
        Path(tempfile.gettempdir()) / f"moeflow-scratch-{os.getuid()}")
    return Path(root)


def cache_root() -> Path:
    return Path(os.environ.get("MOEFLOW_CACHE_DIR") or scratch_root() / "cache")


def cache_limit_bytes() -> int:
    return int(float(os.environ.get("MOEFLOW_CACHE_GB", "100")) * 1e9)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _local_files(local: Path) -> list[str]:
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def publish(local: str | Path, uri: str) -> dict:
    """Upload the tree `local` to `uri`, the manifest last; returns the manifest.

    An earlier manifest at `uri` (a retried stage republishing) is removed first, so
    the output is absent, never mixed, while the new files go up.
    """
    local = Path(local)
    fs, root = filesystem(uri)
    rels = _local_files(local)
    files = {rel: {"size": (local / rel).stat().st_size, "sha256": sha256_file(local / rel)}
             for rel in rels}
    manifest_path = f"{root.rstrip('/')}/{MANIFEST}"
    if fs.exists(manifest_path):
        fs.rm(manifest_path)
    if rels:  # one call: s3fs uploads them concurrently, big ones in parts
        fs.put([str(local / r) for r in rels], [f"{root.rstrip('/')}/{r}" for r in rels],
               **_part_size(fs))
    manifest = {"version": 1, "created": time.time(), "files": files}
    fs.pipe_file(manifest_path, json.dumps(manifest, sort_keys=True).encode())
    return manifest


def _part_size(fs) -> dict:
    """s3fs sends a file of 2 parts or more as a multipart upload; MOEFLOW_MULTIPART_MB sets
    the part size (S3's minimum is 5; default s3fs's 50)."""
    mb = os.environ.get("MOEFLOW_MULTIPART_MB")
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return {"chunksize": int(float(mb) * 2**20)} if mb and "s3" in protocols else {}


def read_manifest(uri: str) -> tuple[dict, str]:
    """(manifest, its sha256) of the output at `uri`.

    Raises:
        UserError: no manifest (never published, or still being written).
    """
    fs, root = filesystem(uri)
    try:
        raw = fs.cat_file(f"{root.rstrip('/')}/{MANIFEST}")
    except FileNotFoundError:
        raise NotAnOutput(f"{uri}: not a published output (no {MANIFEST}; unfinished or "
                          "deleted)") from None
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def published(uri: str) -> bool:
    fs, root = filesystem(uri)
    return fs.exists(f"{root.rstrip('/')}/{MANIFEST}")


def _entry(digest: str) -> Path:
    return cache_root() / digest[:32]


def fetch(uri: str, sub: str = "", read: tuple[dict, str] | None = None) -> Path:
    """The local copy of `<uri>/<sub>` (a file or a directory of the output published at
    `uri`), downloading into the cache only files not there yet, each checked against
    the manifest's sha256. `read`: the output's (manifest, digest) when the caller has
    read it already (a stage localizing many paths of one upstream output).

    Raises:
        UserError: not published, or a file whose bytes do not match the manifest.
    """
    manifest, digest = read or read_manifest(uri)
    entry = _entry(digest)
    sub = sub.strip("/")
    wanted = {rel: meta for rel, meta in manifest["files"].items()
              if not sub or rel == sub or rel.startswith(sub + "/")}
    if sub and not wanted:
        raise UserError(f"{join(uri, sub)}: not in the output's {MANIFEST}")
    missing = [rel for rel, meta in wanted.items() if not _cached(entry / rel, meta["size"])]
    _mark(entry, uri, "fetched")
    if missing:  # only a download grows the cache
        _download(uri, entry, missing, manifest["files"])
        evict(keep=entry)
    return entry / sub if sub else entry


def _mark(entry: Path, uri: str, how: str) -> None:
    """Cache bookkeeping: when the entry was last used, which output it holds and whether it
    was published from this node or fetched from the store (`.origin`, for audits)."""
    entry.mkdir(parents=True, exist_ok=True)
    (entry / ".last_used").write_text(str(time.time()))
    origin = entry / ".origin"
    if not origin.exists():
        origin.write_text(json.dumps({"uri": uri, "how": how}))


def _cached(path: Path, size: int) -> bool:
    """A cache file is only ever renamed into place after its sha256 matched."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _download(uri: str, entry: Path, rels: list[str], files: dict) -> None:
    fs, root = filesystem(uri)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=_ensure(cache_root())))
    try:
        locals_ = [tmp / f"{i}.part" for i in range(len(rels))]
        fs.get([f"{root.rstrip('/')}/{r}" for r in rels], [str(p) for p in locals_])
        for rel, part in zip(rels, locals_):
            digest = sha256_file(part)
            if digest != files[rel]["sha256"]:
                raise UserError(f"{join(uri, rel)}: sha256 {digest[:12]}... does not match its "
                                f"manifest ({files[rel]['sha256'][:12]}...); the output is corrupt")
            dest = entry / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def adopt(local: str | Path, manifest: dict, uri: str = "") -> Path | None:
    """Move a just-published tree into the cache as the entry of its manifest, so stages on
    this node read it without downloading; None when the cache is on another filesystem."""
    raw = json.dumps(manifest, sort_keys=True).encode()
    entry = _entry(hashlib.sha256(raw).hexdigest())
    if entry.exists():
        return entry
    try:
        _ensure(entry.parent)
        os.rename(local, entry)
    except OSError:
        return None
    _mark(entry, uri, "published")
    evict(keep=entry)
    return entry


def _size(entry: Path) -> int:
    """Disk used by an entry: blocks, not apparent size (a sparse copy of a checkpoint
    read by ranges, storage/ranged.py, holds only what was fetched)."""
    return sum(min(s.st_size, s.st_blocks * 512) for p in entry.rglob("*") if p.is_file()
               for s in [p.stat()])


def evict(keep: Path | None = None, limit: int | None = None) -> list[Path]:
    """Delete least recently used cache entries until the cache fits its bound; returns
    what went. `keep` (the entry just used) always stays."""
    root = cache_root()
    if not root.is_dir():
        return []
    limit = cache_limit_bytes() if limit is None else limit
    entries = []
    for entry in root.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            stamp = entry / ".last_used"
            used = stamp.stat().st_mtime if stamp.exists() else entry.stat().st_mtime
            entries.append((used, entry, _size(entry)))
    total = sum(e[2] for e in entries)
    gone = []
    for _used, entry, size in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if keep is not None and entry == keep:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
        gone.append(entry)
    return gone


def localize(value: str) -> str:
    """A path a stage can open: a local path as is, a URI fetched into the cache.

    A URI inside a published output (`.../<output>/<sub>`) fetches that output's `sub`;
    a URI that is itself an output fetches all of it. Outputs are found by walking up to
    the nearest prefix with a manifest.
    """
    if not is_uri(value):
        return value
    base, sub = value.rstrip("/"), ""
    while True:
        try:
            read = read_manifest(base)  # one GET (an exists() check costs a HEAD and a LIST)
        except NotAnOutput:
            read = None
        if read is not None:
            return str(fetch(base, sub, read))
        head, _, tail = base.rpartition("/")
        if "://" not in head or head.endswith(":/"):
            raise NotPublished(f"{value}: no published output (no {MANIFEST}) contains it")
        base, sub = head, f"{tail}/{sub}".strip("/")


def open_ranged(uri: str, block_mb: float = 8):
    """A read-only file object on a store object that fetches only the byte ranges read
    (blocks of `block_mb`, no read-ahead of the whole object): safetensors headers and
    single tensors of a shard without downloading the shard."""
    fs, path = filesystem(uri)
    return fs.open(path, "rb", block_size=int(block_mb * 2**20), cache_type="bytes")
