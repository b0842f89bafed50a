"""What a pipeline stage is: a pure function plus the facts the runner needs.

A stage module in `tasks/` defines one `STAGE = StageSpec(...)`. Its `run`
function takes a `StageContext` (config, upstream result records, an output
directory, the MLflow run to log into) and returns a small JSON-able result
record (URIs, checksums, metrics) that downstream stages receive. Nothing
large crosses between stages: outputs go to `ctx.out_dir` and to MLflow.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal, overload

from moeflow.core.config import PipelineConfig
from moeflow.core.devices import gpus_per_worker
from tasks.records import (
    CalibrateRecord,
    ConvertRecord,
    FinetuneRecord,
    OperatorsRecord,
    PlanRecord,
    RegressRecord,
    ServingRecord,
)


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """A stage of the DAG.

    Args:
        name: stage name (CLI, MLflow tag `moeflow.stage`).
        run: pure function `StageContext -> dict` (JSON-able result record).
        upstream: stages whose result records this stage reads.
        after: optional upstream stages: when one is part of the pipeline (installed
            and enabled) it runs first and its record is an input; when it is not,
            the stage runs without it (reads it with `ctx.inputs.get(name, {})`).
        sections: config sections that feed the cache key and MLflow params.
        version: bump to invalidate cached results when behaviour changes
            without a source change in the stage module.
        num_cpus / num_gpus / memory / max_retries: Ray defaults, overridable
            per stage under `stages.resources.<name>`. `num_gpus` may be a function of the
            config, evaluated when the stage is submitted (e.g. `gpu_if_cluster_has_one`:
            a stage that computes in its own process takes a GPU when the cluster has one).
        preflight: cheap checks run before anything starts (raise UserError).
        cacheable: False for stages whose result is a live thing (a running
            endpoint) rather than files: they run every time.
        fingerprint: dotted config keys naming local files/dirs this stage reads;
            their size/mtime enter the cache key (default: model.path and the
            data files, where the stage reads those sections).
        resumable: the stage picks up its own partial output (verified files,
            training checkpoints): a Ray retry keeps the out dir, and `moeflow
            resume` hands a stage the out dir of its unfinished attempt with the
            same cache key instead of a new, empty one.
        needs_model: the stage reads the checkpoint at `model.path` (directly or through
            its upstream): a run whose stages all say False starts without it (the plan
            stage alone plans a model that is not downloaded yet from `plan.architecture`).
        model_by_ranges: with `model.path` in a store, the stage gets a sparse local copy
            (configs and shard headers) and fetches the tensor byte ranges it reads itself
            (convert); otherwise the whole checkpoint is fetched into the node's cache first.
    """

    name: str
    run: Callable[["StageContext"], dict]
    upstream: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()
    version: str = "1"
    num_cpus: float = 1
    num_gpus: float | Callable[[PipelineConfig], float] = 0
    memory: int | None = None
    max_retries: int = 1
    preflight: Callable[[PipelineConfig], None] | None = None
    cacheable: bool = True
    fingerprint: tuple[str, ...] | None = None
    description: str = ""
    resumable: bool = False
    needs_model: bool = True
    model_by_ranges: bool = False

    def fingerprint_keys(self) -> tuple[str, ...]:
        if self.fingerprint is not None:
            return self.fingerprint
        keys: tuple[str, ...] = ()
        if "model" in self.sections:
            keys += ("model.path",)
        if "data" in self.sections:
            keys += ("data.train_file", "data.eval_file")
        if "finetune" in self.sections:  # tenant adapters' data
            keys += ("finetune.adapters.*.train_file", "finetune.adapters.*.eval_file")
        return keys

    def code_version(self) -> str:
        """Hash of `version` and the source of every first-party module the stage can
        reach (see `code_files`), so editing library code the stage runs reruns it."""
        h = hashlib.sha256(f"{self.version}\n".encode())
        for name, path in self.code_files():
            h.update(f"{name}\n".encode())
            h.update(_file_digest(str(path), path.stat().st_mtime_ns).encode())
        return h.hexdigest()[:16]

    def code_files(self) -> list[tuple[str, Path]]:
        """(module, source file) of the stage module and every first-party module it
        imports, transitively, in name order.

        Imports are read statically (ast) from the whole module, so the lazy
        imports inside functions that stage modules use are seen too. First
        party: the packages `moeflow`, `tasks`, `workflows` and the stage
        module's own top-level package. Imports hidden in strings
        (`importlib.import_module(name)`) are not seen: bump `version` for those.
        """
        module = getattr(self.run, "__module__", None) or ""
        roots = FIRST_PARTY | {module.split(".")[0]}
        return sorted(_reachable(module, frozenset(roots)).items())

    def section_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {s: cfg.model_dump(mode="json")[s] for s in self.sections}


NOTES = "notes.log"  # StageContext.note's file in the out dir
PROGRESS = "progress.json"  # write_progress's file in the out dir: the runner shows a bar
FIRST_PARTY = frozenset({"moeflow", "tasks", "workflows"})


@lru_cache(maxsize=4096)
def _file_digest(path: str, mtime_ns: int) -> str:
    """sha256 of a source file (cached per path and mtime)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _source_path(name: str) -> Path | None:
    """The source file of module `name`, found on disk without importing it (a lazy
    import of torch-heavy library code must not run on the driver just to hash it);
    None for a name that is not a module (`from pkg.mod import function`)."""
    top, _, rest = name.partition(".")
    root = sys.modules.get(top)
    init = getattr(root, "__file__", None) if root else None
    if init is None:
        try:
            spec = importlib.util.find_spec(top)  # a top-level package: nothing imported
        except (ImportError, ValueError):
            return None
        init = spec.origin if spec and spec.has_location else None
    if not init:
        return None
    base = Path(init).parent if Path(init).name == "__init__.py" else None
    if not rest:
        return Path(init) if str(init).endswith(".py") else None
    if base is None:  # a top-level module, not a package: nothing below it
        return None
    path = base.joinpath(*rest.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=4096)
def _imports_of(path: str, mtime_ns: int, package: str) -> tuple[str, ...]:
    """Absolute names of every module imported anywhere in a source file.

    Args:
        package: the module's package, for relative imports.
    """
    tree = ast.parse(Path(path).read_text(), filename=path)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in (*parts, base) if p)
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names]  # `from pkg import module`
    return tuple(names)


def _reachable(start: str, roots: frozenset[str]) -> dict[str, Path]:
    """Module name -> source file of `start` and its first-party imports, transitively
    (parent packages' __init__ included: importing a.b runs a/__init__.py)."""
    found: dict[str, Path] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        if not name or name in found or name.split(".")[0] not in roots:
            continue
        path = _source_path(name)
        if path is None:  # `from pkg import function`: not a module
            continue
        found[name] = path
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        todo += _imports_of(str(path), path.stat().st_mtime_ns, package)
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return found


@dataclass
class StageContext:
    """Everything a stage function gets; built by the runner inside the Ray task."""

    stage: str
    config: PipelineConfig
    inputs: dict[str, dict]  # upstream stage name -> its result record
    out_dir: Path  # this execution's own, empty directory
    mlflow_run_id: str | None = None  # child run of this stage execution
    tracking_uri: str | None = None
    pipeline_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # where out_dir is published when the workdir is a store URI (None: out_dir is the output);
    # what must outlive this node goes there directly (Ray Train checkpoints)
    store_dir: str | None = None
    # local copies of store URIs this stage was handed -> those URIs (code that runs on other
    # nodes, e.g. Serve replicas, fetches from the URIs); empty with a local workdir
    stored: dict[str, str] = field(default_factory=dict)

    @overload
    def input(self, stage: Literal["convert"]) -> ConvertRecord: ...
    @overload
    def input(self, stage: Literal["plan"]) -> PlanRecord: ...
    @overload
    def input(self, stage: Literal["operators"]) -> OperatorsRecord: ...
    @overload
    def input(self, stage: Literal["calibrate"]) -> CalibrateRecord: ...
    @overload
    def input(self, stage: Literal["finetune"]) -> FinetuneRecord: ...
    @overload
    def input(self, stage: Literal["regress"]) -> RegressRecord: ...
    @overload
    def input(self, stage: Literal["serving"]) -> ServingRecord: ...
    @overload
    def input(self, stage: str) -> Any: ...  # a plugin stage's record

    def input(self, stage: str) -> Any:
        """Result record of an upstream stage, typed by tasks.records (KeyError names what
        exists)."""
        if stage not in self.inputs:
            raise KeyError(f"stage {self.stage} has no input from {stage!r}; "
                           f"it has {sorted(self.inputs)}")
        return self.inputs[stage]

    def uri_of(self, path: str | Path) -> str:
        """What another node (or a later command) can open for `path`: its store URI when it is
        under a local copy this stage was handed (`stored`) or under its own out dir with the
        workdir in a store; else `path` as is (a local workdir: paths are what everyone reads)."""
        value = str(path)
        pairs = dict(self.stored)
        if self.store_dir:
            pairs[str(self.out_dir)] = self.store_dir
        for local, uri in pairs.items():
            local = local.rstrip("/")
            if value == local or value.startswith(local + "/"):
                return uri.rstrip("/") + value[len(local):]
        return value

    def note(self, message: str) -> None:
        """A line for the user's terminal, printed by the driver as `<stage>: message`.

        Worker output does not reach the terminal at the default verbosity, so
        this is how a stage says something that matters (resuming from a
        checkpoint, a port that was taken). Appended to `out_dir/notes.log`,
        which the runner follows while the stage runs.
        """
        with open(self.out_dir / NOTES, "a", encoding="utf-8") as fh:
            fh.write(message.replace("\n", " ") + "\n")

    @property
    def progress_file(self) -> Path:
        """Where long work reports progress (`write_progress`); hand it to code that
        runs elsewhere (Ray Train workers) when the stage itself does not loop."""
        return self.out_dir / PROGRESS

    def progress(self, done: float, total: float, what: str = "") -> None:
        """Progress of long work; the driver shows it as a bar (a line per quarter in a log)."""
        write_progress(self.progress_file, done, total, what)

    def write_json(self, name: str, obj: Any) -> Path:
        """Write a JSON output atomically (temp file, then rename) under out_dir."""
        path = self.out_dir / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        tmp.replace(path)
        return path


def write_progress(path: str | Path, done: float, total: float, what: str = "") -> None:
    """Atomically record `done` of `total` units of `what` at `path` (a PROGRESS file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"done": done, "total": total, "what": what}))
    tmp.replace(path)


def gpu_if_cluster_has_one(cfg: "PipelineConfig") -> float:
    """`StageSpec.num_gpus` of a stage that computes in its own task: one GPU when the Ray
    cluster has GPUs (so it runs where the model will), none on a CPU cluster."""

    return gpus_per_worker("auto")


def refuse_kept_base(stage: str, why: str, cfg: "PipelineConfig | None" = None,
                     model_dir: str | None = None) -> None:
    """Refuse, in one line naming `convert.dtype`, a stage that cannot run on a quantised base
    convert kept as stored (`convert.dtype: keep` of an MXFP4 / compressed-tensors release;
    finetune, regress, serving and deploy load it packed, moeflow.model.models).

    Args:
        cfg: at preflight: the release at model.path will be kept (convert.dtype keep).
        model_dir: at run time: the checkpoint the stage got (convert's manifest says).
    """
    # lazy: loads torch, which importing this module does not
    from moeflow.checkpoint.formats import find_packed
    from moeflow.checkpoint.parse import read_checkpoint
    from moeflow.core.errors import UserError
    from moeflow.model.models import kept_formats

    kept: list[str] = []
    if model_dir is not None:
        kept = kept_formats(model_dir)
    elif cfg is not None and cfg.convert.dtype == "keep" and (Path(cfg.model.path) / "config.json").is_file():
        packed, _ = find_packed(read_checkpoint(cfg.model.path))
        kept = sorted({t.format for t in packed.values()})
    if kept:
        raise UserError(f"{stage}: convert.dtype keep keeps the base in its release format "
                        f"({', '.join(kept)}); {why}: convert with dtype bf16, or leave {stage} "
                        "out of stages.enabled")


def streams_layers(cfg: "PipelineConfig", setting: str, model_dir: str, dtype: str) -> bool:
    """Whether a stage runs its model layer-streamed (moeflow.quant.streamed): `setting`
    ("always" / "never"), or "auto": when the model in `dtype` exceeds one device of
    hardware.spec (what the plan sizes ranks to)."""
    # lazy: loads torch, which importing this module does not
    import torch

    from moeflow.core.hardware import load_hardware
    from moeflow.quant.streamed import chooses_streaming

    device = load_hardware(cfg.hardware.spec, cfg.hardware.nodes).memory_bytes
    return chooses_streaming(setting, model_dir, getattr(torch, dtype), device)
