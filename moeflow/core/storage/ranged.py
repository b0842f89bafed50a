"""A checkpoint directory in a store, read by byte ranges: a sparse node-local copy.

    local = sparse_copy("s3://bucket/models/m")    # small files whole, each shard's header
    fill({local / "x.safetensors": [(lo, hi), ...]})  # the tensors a task reads, nothing else

Converting a release reads every tensor it keeps once, and nothing it drops (an MTP
layer, a tensor transformers ignores) or already converted. Downloading whole shards
would hold bytes it never needs; instead each `.safetensors` file becomes a sparse file
of the object's size in the node's cache, with only the byte ranges asked for fetched
(ranged GETs, several at once, at most BATCH bytes in memory) and written in place. The
code that reads it (header parsing, `pread` of tensor rows) stays plain file code.

Which ranges a file holds is recorded beside it (`.ranges/<file>.json`), each range
only after its bytes are written: an interrupted fill refetches, never serves zeros it
did not fetch. Every file's mtime is set to its object's, so a converted-file key built
from source mtimes (convert's resume) is the same on every fill. The copy is keyed by
the prefix and every object's size and ETag: a replaced object makes a new copy. Files
other than shards (config, tokenizer) are small and fetched whole.

Not a general cache for weights: a range never fetched reads as zeros, so only code that
fills what it reads (moeflow.checkpoint.convert) may open these files; other stages
fetch whole outputs (store.fetch).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.core.storage.store import MANIFEST, _ensure, _mark, cache_root, evict, read_manifest, sha256_file
from moeflow.core.storage.uri import filesystem, is_uri

SHARD = ".safetensors"
HEAD = 256 << 10  # first read of a shard: its 8-byte length and (nearly always) the whole header
BATCH = 64 << 20  # bytes in flight (and in memory) per concurrent batch of ranged GETs
PIECE = 16 << 20  # a range longer than this is fetched in pieces of this size
SOURCE = ".source.json"
RANGES = ".ranges"


def _listing(uri: str) -> dict[str, dict]:
    fs, root = filesystem(uri)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except (FileNotFoundError, OSError) as exc:
        raise UserError(f"{uri}: cannot list the checkpoint ({exc})") from None
    files = {}
    for path, info in found.items():
        rel = path[len(root) + 1:]
        name = rel.rsplit("/", 1)[-1]
        if info.get("type", "file") != "file" or not rel or name.startswith(".") or rel == MANIFEST:
            continue
        modified = info.get("LastModified") or info.get("mtime") or 0
        files[rel] = {"size": int(info["size"]), "etag": str(info.get("ETag", "")).strip('"'),
                      "mtime": modified.timestamp() if hasattr(modified, "timestamp") else float(modified)}
    if not files:
        raise UserError(f"{uri}: no such checkpoint in the store (nothing under the prefix)")
    return files


def sparse_copy(uri: str) -> Path:
    """This node's sparse copy of the checkpoint directory at `uri`: every file but the
    shards fetched whole, every shard sized and holding its header. Idempotent."""
    if not is_uri(uri):
        raise ValueError(f"{uri}: not a store URI")
    files = _listing(uri)
    key = hashlib.sha256(json.dumps([uri.rstrip("/"), sorted(
        (r, f["size"], f["etag"]) for r, f in files.items())]).encode()).hexdigest()
    local = cache_root() / f"ranged-{key[:32]}"
    with _locked(local):
        source = {"uri": uri.rstrip("/"), "files": files}
        (local / SOURCE).write_text(json.dumps(source, sort_keys=True))
        whole = [r for r in files if not r.endswith(SHARD) and not _complete(local, r, files[r]["size"])]
        sums = _published_sums(uri)
        for rel in whole:
            _fill_file(local, source, rel, [(0, files[rel]["size"])])
            _check_sum(local, rel, sums.get(rel), uri)
        for rel in (r for r in files if r.endswith(SHARD)):
            _fill_file(local, source, rel, [(0, min(HEAD, files[rel]["size"]))])
            path = local / rel
            with open(path, "rb") as fh:
                raw = fh.read(8)
            (hlen,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
            if 8 + hlen > HEAD:  # a header larger than the first read: the rest of it
                _fill_file(local, source, rel, [(0, min(8 + hlen, files[rel]["size"]))])
    _mark(local, uri, "ranged")
    evict(keep=local)
    return local


def _published_sums(uri: str) -> dict[str, str]:
    """sha256 of each file when `uri` is a published output (store.publish), else {}."""
    try:
        manifest, _ = read_manifest(uri)
    except UserError:
        return {}
    return {rel: meta["sha256"] for rel, meta in manifest.get("files", {}).items()}


def _check_sum(local: Path, rel: str, want: str | None, uri: str) -> None:
    """A whole file of a published output must match its manifest; on a mismatch it
    leaves the copy (refetched next time) and the stage fails naming it."""
    if want is None:
        return
    got = sha256_file(local / rel)
    if got != want:
        (local / rel).unlink(missing_ok=True)
        (local / RANGES / f"{rel}.json").unlink(missing_ok=True)
        raise UserError(f"{uri.rstrip('/')}/{rel}: sha256 {got[:12]}... does not match its "
                        f"manifest ({want[:12]}...); the output is corrupt")


def fill(wanted: Mapping[str, list[tuple[int, int]]] | Mapping[Path, list[tuple[int, int]]]) -> int:
    """Fetch the byte ranges [lo, hi) of each file of a sparse copy that it does not hold yet;
    returns the bytes fetched. `wanted`: {local file: ranges}; files outside a sparse copy
    (a local checkpoint) are skipped."""
    by_copy: dict[Path, dict[str, list[tuple[int, int]]]] = {}
    for path, ranges in wanted.items():
        path = Path(path)
        local = next((p for p in path.parents if (p / SOURCE).is_file()), None)
        if local is None:
            continue
        by_copy.setdefault(local, {}).setdefault(path.relative_to(local).as_posix(), []).extend(ranges)
    got = 0
    for local, files in by_copy.items():
        with _locked(local):
            source = json.loads((local / SOURCE).read_text())
            for rel, ranges in files.items():
                got += _fill_file(local, source, rel, ranges)
        _mark(local, source["uri"], "ranged")
    return got


def held(local: str | Path) -> tuple[int, int]:
    """(bytes held, bytes in all) of the shards of a sparse copy."""
    local = Path(local)
    files = json.loads((local / SOURCE).read_text())["files"]
    shards = [r for r in files if r.endswith(SHARD)]
    return (sum(b - a for r in shards for a, b in _held(local, r)),
            sum(files[r]["size"] for r in shards))


def is_sparse_copy(path: str | Path) -> bool:
    return (Path(path) / SOURCE).is_file()


def source_uri(path: str | Path) -> str | None:
    """The store URI a sparse copy (or a file inside one) was made from; None otherwise."""
    path = Path(path)
    for p in (path, *path.parents):
        if (p / SOURCE).is_file():
            return json.loads((p / SOURCE).read_text())["uri"]
    return None


@contextlib.contextmanager
def _locked(local: Path):
    """One filler at a time per copy on this node (a convert and a preflight may share it)."""
    _ensure(local)
    with open(local.parent / f".{local.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _held(local: Path, rel: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in json.loads((local / RANGES / f"{rel}.json").read_text())]
    except (OSError, ValueError, TypeError):
        return []


def _complete(local: Path, rel: str, size: int) -> bool:
    return _missing(_held(local, rel), [(0, size)]) == [] and (local / rel).is_file()


def _missing(held: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of `ranges` not covered by `held` (both [lo, hi) lists), merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in _merge(ranges):
        for a, b in _merge(held):
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def _merge(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _fill_file(local: Path, source: dict, rel: str, ranges: list[tuple[int, int]]) -> int:
    meta = source["files"].get(rel)
    if meta is None:
        raise UserError(f"{source['uri']}/{rel}: not in the store")
    held = _held(local, rel)
    todo = _missing(held, [(max(0, a), min(b, meta["size"])) for a, b in ranges])
    path = local / rel
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            fh.truncate(meta["size"])  # sparse: unfetched ranges take no disk
    if not todo:
        return 0
    pieces = [(a, min(a + PIECE, hi)) for lo, hi in todo for a in range(lo, hi, PIECE)]
    batches: list[list[tuple[int, int]]] = [[]]
    for piece in pieces:
        if batches[-1] and sum(b - a for a, b in batches[-1]) + piece[1] - piece[0] > BATCH:
            batches.append([])
        batches[-1].append(piece)
    fs, root = filesystem(f"{source['uri']}/{rel}")
    fd = os.open(path, os.O_WRONLY)
    try:
        for batch in batches:
            _fetch_batch(fs, root, fd, batch, f"{source['uri']}/{rel}")
            held = _merge(held + batch)
            _record(local, rel, held)  # only after its bytes are written
    finally:
        os.close(fd)
    os.utime(path, (time.time(), meta["mtime"]))  # the object's: stable across fills and nodes
    return sum(b - a for a, b in pieces)


def _fetch_batch(fs, root: str, fd: int, batch: list[tuple[int, int]], uri: str) -> None:
    """Ranged GETs of one batch, concurrently, each written in place."""
    datas = fs.cat_ranges([root] * len(batch), [a for a, _ in batch], [b for _, b in batch],
                          on_error="return")
    for (a, b), data in zip(batch, datas):
        if isinstance(data, BaseException) or len(data) != b - a:
            why = data if isinstance(data, BaseException) else f"{len(data)} bytes"
            raise UserError(f"{uri}: ranged read of bytes {a}..{b} failed ({why})")
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], a + done)


def _record(local: Path, rel: str, held) -> None:
    path = local / RANGES / f"{rel}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([list(r) for r in held]))
    tmp.replace(path)
