"""A checkpoint's own modeling code (`auto_map` + `*.py` beside config.json), opt in only.

On release day the modeling code of a new architecture ships inside the
checkpoint, weeks before transformers has it. moeflow runs such code only
when the pipeline says `model.trust_remote_code: true`, and only the code it
was shown:

- `needs_code(dir)`: the config names classes in `auto_map` and transformers
  has no class of its own for it (by model_type or `architectures`);
- `refuse_untrusted(...)`: the run is refused before any stage, naming the key;
- convert records the sha256 of every code file in its manifest
  (`remote_code`); each stage records them too and every load checks them
  (`activate`): an edited, added or removed file is refused, naming it;
- `activate(dir)` imports the code from the bytes it hashed (never re-reading
  a file after the check, never writing `__pycache__` into the checkpoint) in
  a package named after the code's digest, and registers the classes with
  transformers' Auto classes — so every `AutoConfig` / `from_pretrained` in
  this process (stages, Ray Train workers, Serve replicas each call it) then
  loads the model as if transformers shipped it.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import sys
from pathlib import Path

from moeflow.core.errors import UserError

KEY = "model.trust_remote_code"
MANIFEST = "manifest.json"
REGISTERED: dict[str, tuple[type, type]] = {}  # model_type -> (model class, config class)
_ACTIVE: dict[tuple[str, str], dict[str, str]] = {}  # (dir, digest) -> file digests


def _config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def needs_code(model_dir: str | Path) -> bool:
    """True when the checkpoint loads only through its own code (see module doc)."""
    # lazy: transformers: heavy, loaded only when this runs
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    raw = _config(Path(model_dir))
    if not raw.get("auto_map"):
        return False
    if raw.get("model_type") in CONFIG_MAPPING_NAMES:  # transformers' own, not a registration
        return False
    return not any(isinstance(a, str) and hasattr(transformers, a) for a in raw.get("architectures") or [])


def code_files(model_dir: str | Path) -> list[str]:
    """The checkpoint's Python files (what its `auto_map` modules may import)."""
    return sorted(p.name for p in Path(model_dir).glob("*.py") if p.is_file())


def _read(model_dir: Path) -> dict[str, bytes]:
    return {name: (model_dir / name).read_bytes() for name in code_files(model_dir)}


def digests(model_dir: str | Path) -> dict[str, str]:
    """{file name: sha256} of every code file."""
    return {n: hashlib.sha256(b).hexdigest() for n, b in _read(Path(model_dir)).items()}


def refuse_untrusted(model_dir: str | Path, trusted: bool) -> None:
    """Preflight: a checkpoint that needs its own code without the opt-in is refused."""
    if needs_code(model_dir) and not trusted:
        auto = _config(Path(model_dir)).get("auto_map", {})
        files = ", ".join(code_files(model_dir)) or "its code"
        raise UserError(f"{model_dir} needs its own modeling code ({files}; auto_map "
                        f"{sorted(auto)}); set {KEY}: true (moeflow convert: --trust-remote-code) to run it")


def pinned(model_dir: str | Path) -> dict[str, str] | None:
    """The code digests convert recorded for this directory (None: not recorded)."""
    for name in (MANIFEST, PIN):  # quantised / merged copies carry the pin file only
        path = Path(model_dir) / name
        try:
            record = json.loads(path.read_text()) if path.is_file() else None
        except json.JSONDecodeError:
            raise UserError(f"{path}: invalid JSON (the remote code's sha256 record)") from None
        record = record.get("remote_code") if name == MANIFEST and record else record
        if isinstance(record, dict):
            return dict(record)
    return None


def verify(model_dir: str | Path, expected: dict[str, str], blobs: dict[str, bytes] | None = None) -> None:
    """Raise UserError naming the first code file that differs from `expected`."""
    model_dir = Path(model_dir)
    blobs = _read(model_dir) if blobs is None else blobs
    for name in sorted(set(expected) | set(blobs)):
        if name not in blobs:
            raise UserError(f"{model_dir / name}: remote code file recorded at convert is missing")
        if name not in expected:
            raise UserError(f"{model_dir / name}: remote code file was not there at convert "
                            "(its sha256 is not recorded); re-run convert to trust it")
        got = hashlib.sha256(blobs[name]).hexdigest()
        if got != expected[name]:
            raise UserError(f"{model_dir / name}: remote code changed since convert (sha256 "
                            f"{got[:12]}, recorded {expected[name][:12]}); re-run convert to trust it")


def activate(model_dir: str | Path, *, trust: bool = False, expected: dict[str, str] | None = None
             ) -> dict[str, str]:
    """Check and load a checkpoint's own code; {} when it needs none.

    Args:
        trust: the user opted in (`model.trust_remote_code`); needed for a
            directory without convert's record (the source checkpoint).
        expected: digests to hold the code to (default: the manifest's record).

    Returns:
        {file: sha256} of the code now registered with transformers.
    """
    model_dir = Path(model_dir).resolve()
    if not needs_code(model_dir):
        return {}
    blobs = _read(model_dir)
    files = {n: hashlib.sha256(b).hexdigest() for n, b in blobs.items()}
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    expected = expected if expected is not None else pinned(model_dir)
    if expected is not None:
        verify(model_dir, expected, blobs)
    elif not trust and (str(model_dir), digest) not in _ACTIVE:  # not trusted in this process yet
        refuse_untrusted(model_dir, False)
    if (str(model_dir), digest) not in _ACTIVE:
        _register(model_dir, _config(model_dir), blobs, digest)
        _ACTIVE[(str(model_dir), digest)] = files
    return files


# typeshed declares source_to_code differently in SourceLoader and InspectLoader (not overridden here)
class _Verified(importlib.abc.MetaPathFinder, importlib.abc.SourceLoader):  # type: ignore[misc]
    """Serves `<package>.<module>` from bytes already checked against their digests."""

    def __init__(self, package: str, model_dir: Path, blobs: dict[str, bytes]):
        self.package, self.dir = package, model_dir
        self.sources = {f"{package}.{Path(n).stem}": (model_dir / n, b) for n, b in blobs.items()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.package:
            spec = importlib.util.spec_from_loader(fullname, self, is_package=True)
            spec.submodule_search_locations = []
            return spec
        if fullname in self.sources:
            # a file location: transformers reads a module's source (inspect) to see what it supports
            return importlib.util.spec_from_file_location(fullname, self.sources[fullname][0], loader=self)
        return None

    def is_package(self, fullname):
        return fullname == self.package

    def get_filename(self, fullname):
        return str(self.sources[fullname][0]) if fullname in self.sources else str(self.dir / "__init__.py")

    def get_data(self, path):
        for file, blob in self.sources.values():
            if str(file) == str(path):
                return blob
        if str(path) == str(self.dir / "__init__.py"):
            return b""
        raise OSError(path)


def _register(model_dir: Path, raw: dict, blobs: dict[str, bytes], digest: str) -> None:
    # lazy: transformers: heavy, loaded only when this runs
    import transformers

    package = f"moeflow_remote_code_{digest}"
    if package not in sys.modules:
        sys.meta_path.insert(0, _Verified(package, model_dir, blobs))
    auto = raw.get("auto_map") or {}

    def load(ref: str):
        module, _, name = ref.rpartition(".")
        try:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        except Exception as exc:  # the checkpoint's code itself fails: say where
            raise UserError(f"{model_dir / (module + '.py')}: cannot load {name}: "
                            f"{type(exc).__name__}: {exc}") from None

    if "AutoConfig" not in auto:
        raise UserError(f"{model_dir / 'config.json'}: auto_map has no AutoConfig")
    config_cls = load(auto["AutoConfig"])
    transformers.AutoConfig.register(raw.get("model_type") or config_cls.model_type, config_cls, exist_ok=True)
    model_cls = None
    for auto_name, ref in auto.items():
        if auto_name.startswith("AutoModel") and hasattr(transformers, auto_name):
            cls = load(ref if isinstance(ref, str) else ref[0])
            getattr(transformers, auto_name).register(config_cls, cls, exist_ok=True)
            if model_cls is None or cls.__name__ in (raw.get("architectures") or []):
                model_cls = cls
    if model_cls is None:
        raise UserError(f"{model_dir / 'config.json'}: auto_map names no AutoModel class")
    REGISTERED[config_cls.model_type] = (model_cls, config_cls)


def stage_record(cfg, inputs: dict) -> dict[str, str]:
    """The code a stage runs with: checked against convert's record (edited code is
    refused here, before the stage's work) and loaded in this process; {} for a
    checkpoint that needs no code of its own."""
    if not needs_code(cfg.model.path):
        return {}
    converted = (inputs.get("convert") or {}).get("output_dir")
    if converted:
        return activate(converted)
    return activate(cfg.model.path, trust=bool(getattr(cfg.model, "trust_remote_code", False)))


PIN = "remote_code.json"  # beside the code: travels with it into quantised / merged copies


def pin(model_dir: str | Path) -> dict[str, str]:
    """Record the sha256 of the code files of a directory convert wrote (the
    manifest holds the same record); returns it."""
    files = digests(model_dir)
    (Path(model_dir) / PIN).write_text(json.dumps(files, indent=1, sort_keys=True))
    return files


def activate_task(task: dict) -> None:
    """In a convert / verify worker: load the source's code, held to the digests
    the stage checked (`task["remote_code"]`), before the family is built."""
    if task.get("remote_code"):
        first = next(iter(task["sources"].values()))
        activate(Path(first.file).parent, expected=task["remote_code"])


def model_class(name: str):
    """The model class named `name`: transformers' own, else one registered from a
    checkpoint's code in this process."""
    # lazy: transformers: heavy, loaded only when this runs
    import transformers

    if hasattr(transformers, name):
        return getattr(transformers, name)
    for model_cls, _ in REGISTERED.values():
        if model_cls.__name__ == name:
            return model_cls
    raise UserError(f"{name} is neither a transformers class nor a checkpoint's own (trusted) class")
