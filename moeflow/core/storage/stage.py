"""A stage execution whose out dir is a store URI (the runner's side of `workdir: s3://...`).

    io = StageIO(out_uri, workdir)
    local = io.open()                         # this node's scratch dir for the stage
    cfg, inputs = io.localize(cfg, inputs)    # URIs the stage reads -> cached local copies
    ... the stage runs on local paths ...
    result = io.to_record(result)             # URIs in the record, never a path on this node
    io.publish()                              # upload, the manifest last

Stages stay plain file code: they never see a URI they must open, and the records they
hand on name store URIs, never a path on this node. While the stage runs, its notes
and progress files are mirrored to `<out>/_live/` for the driver, which may be on
another node.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from moeflow.core.storage.ranged import sparse_copy
from moeflow.core.storage.store import (
    NotAnOutput,
    NotPublished,
    adopt,
    fetch,
    localize,
    publish,
    read_manifest,
    scratch_root,
)
from moeflow.core.storage.uri import filesystem, is_uri, join

LIVE = "_live"  # notes.log / progress.json of a running stage, for the driver
MIRROR_EVERY_S = 2.0


def scratch_dir(out_uri: str) -> Path:
    """The node-local dir of the stage execution stored at `out_uri` (its last two parts:
    pipeline run / stage-run), the same on a retry so a same-node retry keeps its files."""
    parts = out_uri.rstrip("/").split("/")
    return scratch_root() / "stages" / parts[-2] / parts[-1]


def _walk(value, fn):
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, fn) for v in value]
    return fn(value) if isinstance(value, str) else value


class StageIO:
    def __init__(self, out_uri: str, workdir: str, live_files: tuple[str, ...] = ()):
        self.uri = out_uri.rstrip("/")
        self.workdir = workdir.rstrip("/")
        self.local = scratch_dir(self.uri)
        self.live_files = live_files
        self.back: dict[str, str] = {}  # local copy -> the URI it came from
        self._manifests: dict[str, tuple[dict, str] | None] = {}  # output -> (manifest, digest)
        self._stop = threading.Event()
        self._mirror: threading.Thread | None = None
        self._sent: dict[str, float] = {}

    def open(self, keep: bool) -> Path:
        if self.local.exists() and not keep:
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True, exist_ok=True)
        if self.live_files:
            self._mirror = threading.Thread(target=self._mirror_loop, daemon=True,
                                            name="moeflow-live-mirror")
            self._mirror.start()
        return self.local

    # -- inputs
    def _fetch(self, value: str) -> str:
        if not is_uri(value) or not value.startswith(self.workdir + "/"):
            return value
        found = self._stage_output(value)
        try:
            local = str(fetch(found[0], found[1], self._manifests[found[0]])) if found else localize(value)
        except NotPublished:  # a prefix handed on as such (finetune's lora_uri): stays a URI
            return value
        self.back[local] = value
        return local

    def _stage_output(self, value: str) -> tuple[str, str] | None:
        """(output, sub-path) of a URI inside a stage's output `<workdir>/<run>/<stage dir>`,
        its manifest read once per output (an upstream record names many paths in it);
        None: not inside one (localize walks up to whatever published output holds it)."""
        parts = value[len(self.workdir) + 1:].split("/")
        if len(parts) < 2:
            return None
        base = f"{self.workdir}/{parts[0]}/{parts[1]}"
        if base not in self._manifests:
            try:
                self._manifests[base] = read_manifest(base)
            except NotAnOutput:
                self._manifests[base] = None
        return (base, "/".join(parts[2:])) if self._manifests[base] is not None else None

    def _fetch_any(self, value: str, by_ranges: bool = False) -> str:
        if not is_uri(value):
            return value
        local = str(sparse_copy(value)) if by_ranges else localize(value)
        self.back[local] = value
        return local

    def localize(self, cfg_json: dict, inputs: dict, model_by_ranges: bool = False) -> tuple[dict, dict]:
        """Upstream records' URIs under the workdir and the model / data URIs in the config,
        fetched (only the sub-paths named) into this node's cache. `model_by_ranges`: a store
        model.path becomes a sparse copy (config, tokenizer and shard headers; the stage
        fetches the tensor ranges it reads, storage/ranged.py), not a whole download."""
        cfg_json = dict(cfg_json)
        if isinstance(cfg_json.get("model"), dict) and cfg_json["model"].get("path"):
            cfg_json["model"] = dict(cfg_json["model"], path=self._fetch_any(
                cfg_json["model"]["path"], by_ranges=model_by_ranges))
        data = cfg_json.get("data")
        if isinstance(data, dict):
            cfg_json["data"] = {k: self._fetch_any(v) if k.endswith("_file") and isinstance(v, str)
                                else v for k, v in data.items()}
        tenants = (cfg_json.get("finetune") or {}).get("adapters") or {}
        if tenants:
            cfg_json["finetune"] = dict(cfg_json["finetune"], adapters={
                name: {k: self._fetch_any(v) if k.endswith("_file") and isinstance(v, str) else v
                       for k, v in spec.items()} for name, spec in tenants.items()})
        return cfg_json, _walk(inputs, self._fetch)

    # -- the record
    def to_uri(self, value: str) -> str:
        """A path on this node (the scratch dir, a fetched copy) -> its URI in the store."""
        local = str(self.local)
        if value == local or value.startswith(local + "/"):
            return self.uri + value[len(local):]
        for path, uri in self.back.items():
            if value == path or value.startswith(path + "/"):
                return uri + value[len(path):]
        return value

    def to_record(self, result: dict) -> dict:
        """The stage's record with every path on this node replaced by its URI."""
        return _walk(result, self.to_uri)

    def publish(self) -> None:
        """Publish the scratch dir (manifest last) and move it into the cache, so
        downstream stages on this node read it without a download."""
        self.stop_mirror()
        manifest = publish(self.local, self.uri)
        if adopt(self.local, manifest, self.uri) is None:
            shutil.rmtree(self.local, ignore_errors=True)

    # -- live notes/progress for the driver
    def stop_mirror(self) -> None:
        if self._mirror is not None:
            self._stop.set()
            self._mirror.join(timeout=30)
            self._mirror = None
            self._push_live()

    def _mirror_loop(self) -> None:
        while not self._stop.wait(MIRROR_EVERY_S):
            try:
                self._push_live()
            except Exception:  # noqa: BLE001 - the terminal lines are best effort
                pass

    def _push_live(self) -> None:
        fs, root = filesystem(join(self.uri, LIVE))
        for name in self.live_files:
            path = self.local / name
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if self._sent.get(name) == mtime:
                continue
            fs.pipe_file(f"{root}/{name}", path.read_bytes())
            self._sent[name] = mtime


def read_live(out_uri: str, name: str) -> bytes | None:
    """The driver's view of a running stage's notes/progress file (None: none yet)."""
    fs, root = filesystem(join(out_uri, LIVE, name))
    try:
        return fs.cat_file(root)
    except (FileNotFoundError, OSError):
        return None


def has_partial(out_uri: str) -> bool:
    """Anything stored under an unfinished attempt's out dir (Ray Train checkpoints)."""
    fs, root = filesystem(out_uri)
    try:
        return bool(fs.ls(root, detail=False))
    except (FileNotFoundError, OSError):
        return False
