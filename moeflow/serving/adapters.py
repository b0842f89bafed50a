"""LoRA adapters for serving: where they may come from, and which are resident.

Two layers, as in vLLM:
- `AdapterRegistry` — adapters that *may* be served (name -> PEFT dir). A
  runtime `load_lora_adapter` call may only name a directory under the
  configured adapter root, or an MLflow registry URI (`models:/name/version`);
  any other path is refused, so an API caller cannot make the server read
  arbitrary files.
- `LoraSlots` — adapters *resident* in the PEFT model, at most `max_loras`,
  least-recently-used evicted (never one a running sequence still uses, never a
  pinned one). adapter_tiers.py adds the host-memory tier below it.

An adapter directory may be local or in an object store (`s3://...`, any scheme
moeflow.core.storage speaks): a store adapter is read from the store when first used.
How runtime loads reach a replica's requests and the other replicas: adapter_sync.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from moeflow.core import storage
from moeflow.core.errors import UserError

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed-adapter batch
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class AdapterSpec:
    """One servable adapter."""

    name: str
    path: str  # local PEFT adapter dir (adapter_config.json + adapter_model.safetensors)
    source: str  # what the user named (path or models:/ URI)
    mixable: bool  # False: expert LoRA (target_parameters), PEFT cannot mix it per row
    rank: int


def check_name(name: str) -> str:
    """Validate an adapter name (it becomes a PEFT module key and a URL-visible id)."""
    if not isinstance(name, str) or not _NAME.match(name) or name == BASE or ":" in name:
        raise UserError(f"lora_name {name!r}: use 1-128 letters, digits, '.', '_' or '-'")
    return name


def _check_config(cfg_text: str, where: str) -> dict:
    """The adapter_config.json text at `where`, parsed and checked to be a LoRA adapter's."""
    try:
        cfg = json.loads(cfg_text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: invalid JSON at line {exc.lineno}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        got = cfg.get("peft_type") if isinstance(cfg, dict) else None
        raise UserError(f"{where}: peft_type is {got!r}, only LORA is served")
    return cfg


def read_adapter_dir(path: str | Path) -> dict:
    """Validate a PEFT LoRA adapter directory (local, or a store URI) and return its adapter_config.

    Raises:
        UserError: missing config/weights, pickle weights, or not a LoRA adapter.
    """
    if storage.is_uri(path):
        return _remote(str(path))[0]
    path = Path(path)
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        raise UserError(f"{path}: not a PEFT adapter (no adapter_config.json)")
    if not (path / "adapter_model.safetensors").is_file():
        pickled = (path / "adapter_model.bin").is_file()
        why = "pickle weights (adapter_model.bin) are refused" if pickled else "no adapter_model.safetensors"
        raise UserError(f"{path}: {why}")
    return _check_config(cfg_path.read_text(), str(cfg_path))


def _remote(uri: str) -> tuple[dict, str]:
    """(adapter_config, weights URI) of an adapter directory in an object store (moeflow.core.storage:
    its published outputs and plain prefixes alike), reading only the config."""
    cfg_uri, weights = storage.join(uri, "adapter_config.json"), storage.join(uri, "adapter_model.safetensors")
    try:
        text = storage.read_text(cfg_uri)
    except FileNotFoundError:
        raise UserError(f"{uri}: not a PEFT adapter (no adapter_config.json)") from None
    except OSError as exc:
        raise UserError(f"{uri}: cannot read the adapter from the store: {exc}") from None
    cfg = _check_config(text, cfg_uri)
    if not storage.exists(weights):
        pickled = storage.exists(storage.join(uri, "adapter_model.bin"))
        why = "pickle weights (adapter_model.bin) are refused" if pickled else "no adapter_model.safetensors"
        raise UserError(f"{uri}: {why}")
    return cfg, weights


def read_adapter_source(path: str) -> tuple[dict, dict, str]:
    """An adapter's config and tensors read into CPU memory from a local dir or a store URI.

    Returns:
        (adapter_config, {tensor name: CPU tensor}, the weights file's path or URI).
    """
    # lazy: safetensors: heavy, loaded only when this runs
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    if storage.is_uri(path):
        cfg, where = _remote(path)
        fs, inner = storage.filesystem(where)
        try:
            raw = fs.cat_file(inner)
        except OSError as exc:
            raise UserError(f"{where}: cannot read the adapter from the store: {exc}") from None
        reader = lambda: load(raw)  # noqa: E731 -- the bytes, parsed in memory (no local copy)
    else:
        cfg = read_adapter_dir(path)
        where = str(Path(path) / "adapter_model.safetensors")
        reader = lambda: load_file(where)  # noqa: E731
    try:
        tensors = reader()
    except (SafetensorError, ValueError, OSError) as exc:
        raise UserError(f"{where}: not a readable safetensors file: {exc}") from None
    return cfg, tensors, where


def make_spec(name: str, path: str | Path, source: str | None = None) -> AdapterSpec:
    """Build an AdapterSpec from a validated adapter directory (local, or a store URI: read
    from the store when first used)."""
    cfg = read_adapter_dir(path)
    where = str(path) if storage.is_uri(path) else str(Path(path).resolve())
    return AdapterSpec(name=check_name(name), path=where,
                       source=source or str(path), mixable=not cfg.get("target_parameters"),
                       rank=int(cfg.get("r", 0)))


def module_shapes(model) -> dict[str, tuple[int, int] | None]:
    """Every module of `model` by name, with its (in, out) features where it is a Linear (under
    PEFT's wrapper, its base layer's): what an adapter's tensors are checked against."""
    # lazy: torch: heavy, loaded only when this runs (`serve` reads adapter dirs before Ray starts)
    import torch

    out: dict[str, tuple[int, int] | None] = {}
    for name, module in model.named_modules():
        layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        out[name] = (layer.in_features, layer.out_features) if isinstance(layer, torch.nn.Linear) else None
    return out


def check_tensor(where: str, key: str, shape: list[int], get, shapes: Mapping) -> None:
    """Refuse one adapter tensor that does not fit the base (`shapes`: `module_shapes`).

    Args:
        where: the weights file (for the message).
        key: the tensor's name; only lora_A / lora_B tensors are checked.
        shape: its shape.
        get: callable returning the tensor (read only once the shape passed).

    Raises:
        UserError: it targets a module the base lacks, has the wrong shape, or holds NaN/inf
            (it would poison every request that uses the adapter).
    """
    # lazy: torch: heavy, loaded only when this runs
    import torch

    if ".lora_A." not in key and ".lora_B." not in key:
        return
    target = key.split(".lora_")[0].removeprefix("base_model.model.")
    while target.endswith(".base_layer"):
        target = target[: -len(".base_layer")]
    if target not in shapes:
        raise UserError(f"{where}: tensor {key} targets {target}, which the base model lacks")
    features = shapes[target]
    if features is not None:
        a = ".lora_A." in key
        want = features[0] if a else features[1]
        got = shape[1] if a else shape[0]
        if got != want:
            raise UserError(f"{where}: tensor {key} has shape {list(shape)}, "
                            f"but {target} has {want} {'in' if a else 'out'} features")
    tensor = get()
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise UserError(f"{where}: tensor {key} holds NaN or infinite values")


def check_compatible(path: str | Path, model) -> None:
    """Refuse an adapter whose tensors do not fit `model` before PEFT touches it.

    PEFT injects LoRA layers into the model first and loads weights second, so
    a mismatched adapter would leave half-built layers in a serving model.

    Raises:
        UserError: naming the first tensor that targets a missing module, has
            the wrong shape, or holds NaN/inf (`check_tensor`).
    """
    # lazy: safetensors: heavy, loaded only when this runs (`serve` reads adapter dirs
    # before Ray starts, in seconds)
    from safetensors import safe_open

    shapes = module_shapes(model)
    if storage.is_uri(path):  # a store adapter: its bytes read into memory, checked there
        _, tensors, where = read_adapter_source(str(path))
        for key, tensor in tensors.items():
            check_tensor(where, key, list(tensor.shape), lambda t=tensor: t, shapes)
        return
    weights = Path(path) / "adapter_model.safetensors"
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            # adapters are small: one tensor at a time
            check_tensor(str(weights), key, list(f.get_slice(key).get_shape()),
                         lambda key=key: f.get_tensor(key), shapes)


class AdapterRegistry:
    """Adapters that may be served: initial ones plus runtime-loaded ones.

    Args:
        root: directory runtime loads must come from (None: only models:/ URIs).
        download_dir: where `models:/` adapters are downloaded; None with `temp_downloads`: a
            temporary directory made at the first download and removed with the registry
            (`close`, or when the process exits); None without it: `models:/` is refused.
        tracking_uri: the MLflow store `models:/` URIs resolve against (the
            project's, else $MLFLOW_TRACKING_URI; never MLflow's default, which
            would create ./mlflow.db in the replica's working directory).
    """

    def __init__(self, root: str | Path | None = None, download_dir: str | Path | None = None,
                 tracking_uri: str | None = None, temp_downloads: bool = False):
        self.root = Path(root).resolve() if root else None
        self.download_dir = Path(download_dir) if download_dir else None
        self._temp_downloads = temp_downloads and self.download_dir is None
        self._remove_temp: weakref.finalize | None = None
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self._specs: dict[str, AdapterSpec] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Remove the temporary download directory, if one was made (a given one is the caller's)."""
        if self._remove_temp is not None:
            self._remove_temp()

    def add(self, spec: AdapterSpec) -> None:
        with self._lock:
            self._specs[spec.name] = spec

    def get(self, name: str) -> AdapterSpec | None:
        with self._lock:
            return self._specs.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._specs)

    def remove(self, name: str) -> AdapterSpec:
        with self._lock:
            if name not in self._specs:
                raise KeyError(name)
            return self._specs.pop(name)

    def resolve(self, lora_path: str) -> Path:
        """Map a user-supplied `lora_path` to a local adapter dir, refusing escapes.

        Args:
            lora_path: a path under the adapter root (absolute or relative to it),
                or `models:/<name>/<version>` from the MLflow model registry.

        Returns:
            The local directory.

        Raises:
            UserError: outside the root, no root configured, or download failure.
        """
        if not isinstance(lora_path, str) or not lora_path:
            raise UserError("lora_path: a non-empty string is required")
        if "\x00" in lora_path:
            raise UserError("lora_path: must not contain NUL bytes")
        if lora_path.startswith("models:/"):
            return self.download(lora_path)
        if self.root is None:
            raise UserError("lora_path: no adapter root is configured; only models:/ URIs can be loaded")
        candidate = Path(lora_path)
        if not candidate.is_absolute():
            candidate = self.root / candidate
        try:
            real = candidate.resolve()  # follows symlinks, so a link out of the root is caught too
            if real != self.root and self.root not in real.parents:
                raise UserError(f"lora_path {lora_path!r} is outside the adapter root {self.root}")
            if not real.is_dir():
                raise UserError(f"lora_path {lora_path!r}: no such adapter directory under {self.root}")
        except OSError as exc:  # name too long, permission denied, a loop of links
            raise UserError(f"lora_path {lora_path[:200]!r}: {exc.strerror}") from None
        return real

    def download(self, uri: str) -> Path:
        """Fetch a `models:/name/version` adapter from the MLflow registry (cached by URI)."""
        # lazy: mlflow: heavy, loaded only when this runs
        import mlflow

        if not self.tracking_uri:
            raise UserError(f"{uri}: no MLflow tracking URI configured (tracking.uri) to resolve it against")
        if self.download_dir is None and self._temp_downloads:
            with self._lock:
                if self.download_dir is None:  # made at the first download, so a replica that never
                    made = tempfile.mkdtemp(prefix="moeflow-adapters-")  # downloads leaves nothing
                    self._remove_temp = weakref.finalize(self, shutil.rmtree, made, True)
                    self.download_dir = Path(made)
        if self.download_dir is None:
            raise UserError(f"{uri}: no download directory configured for registry adapters")
        dest = self.download_dir / re.sub(r"[^A-Za-z0-9._-]", "_", uri[len("models:/"):])
        if not dest.is_dir():
            try:
                local = mlflow.artifacts.download_artifacts(artifact_uri=self._version_source(uri),
                                                            dst_path=str(dest), tracking_uri=self.tracking_uri)
            except UserError:
                raise
            except Exception as exc:  # MLflow raises many types; the message is what matters
                raise UserError(f"{uri}: cannot download from the MLflow registry: {exc}") from None
            dest = Path(local)
        for cand in [dest, *sorted(p.parent for p in dest.rglob("adapter_config.json"))]:
            if (cand / "adapter_config.json").is_file():
                return cand
        raise UserError(f"{uri}: the registered model holds no adapter_config.json")


    def _version_source(self, uri: str) -> str:
        """Where a `models:/NAME/VERSION` (or `models:/NAME@ALIAS`) version's files live.

        Resolved with a client bound to our store: MLflow's own models:/ resolution asks the
        process-global registry (the default ./mlflow.db) whatever tracking URI it is given.
        """
        # lazy: mlflow: heavy, loaded only when this runs
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        ref = uri[len("models:/"):]
        if "@" in ref:
            name, alias = ref.split("@", 1)
            version = client.get_model_version_by_alias(name, alias).version
        else:
            name, _, version = ref.rpartition("/")
            if not name or not version.isdigit():
                raise UserError(f"{uri}: use models:/NAME/VERSION or models:/NAME@ALIAS")
        return client.get_model_version_download_uri(name, version)


class LoraSlots:
    """Which adapters are resident in the PEFT model; LRU eviction at `max_loras`.

    Only the engine thread touches it (PEFT modules are not thread-safe).

    Args:
        max_loras: at most this many adapters resident at once.
        load: callable(spec) that loads an adapter into the model.
        unload: callable(name) that deletes it from the model.
        pinned: adapters never evicted (deploy.pinned_adapters).
    """

    def __init__(self, max_loras: int, load, unload, pinned=()):
        if max_loras < 1:
            raise UserError(f"max_loras must be >= 1 (got {max_loras})")
        self.max_loras = max_loras
        self.pinned: set[str] = set(pinned)
        self._load, self._unload = load, unload
        self._lru: OrderedDict[str, AdapterSpec] = OrderedDict()
        self.evictions = 0

    def resident(self) -> list[str]:
        return list(self._lru)

    def spec(self, name: str) -> AdapterSpec | None:
        return self._lru.get(name)

    def acquire(self, spec: AdapterSpec, busy: set[str]) -> bool:
        """Make `spec` resident (loading, evicting the LRU idle one if full).

        Args:
            spec: the adapter wanted.
            busy: adapters used by running sequences (never evicted, nor are pinned ones).

        Returns:
            True when resident; False when every slot is busy (caller waits).
        """
        if spec.name in self._lru:
            self._lru.move_to_end(spec.name)
            return True
        victim = None
        if len(self._lru) >= self.max_loras:
            victim = next((n for n in self._lru if n not in busy and n not in self.pinned), None)
            if victim is None:
                return False
        # load before evicting: a failed load leaves the resident set as it was
        self._load(spec)
        self._lru[spec.name] = spec
        if victim is not None:
            self.drop(victim)
            self.evictions += 1
        return True

    def drop(self, name: str) -> None:
        if name in self._lru:
            del self._lru[name]
            self._unload(name)
