"""What a pipeline stage is: a pure function plus the facts the runner needs.

A stage module in `tasks/` defines one `STAGE = StageSpec(...)`. Its `run`
function takes a `StageContext` (config, upstream result records, an output
directory, the MLflow run to log into) and returns a small JSON-able result
record (URIs, checksums, metrics) that downstream stages receive. Nothing
large crosses between stages: outputs go to `ctx.out_dir` and to MLflow.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moeflow.config import PipelineConfig


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """A stage of the DAG.

    Args:
        name: stage name (CLI, MLflow tag `moeflow.stage`).
        run: pure function `StageContext -> dict` (JSON-able result record).
        upstream: stages whose result records this stage reads.
        sections: config sections that feed the cache key and MLflow params.
        version: bump to invalidate cached results when behaviour changes
            without a source change in the stage module.
        num_cpus / num_gpus / memory / max_retries: Ray defaults, overridable
            per stage under `stages.resources.<name>`.
        preflight: cheap checks run before anything starts (raise UserError).
        cacheable: False for stages whose result is a live thing (a running
            endpoint) rather than files: they run every time.
        fingerprint: dotted config keys naming local files/dirs this stage reads;
            their size/mtime enter the cache key (default: model.path and the
            data files, where the stage reads those sections).
    """

    name: str
    run: Callable[["StageContext"], dict]
    upstream: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()
    version: str = "1"
    num_cpus: float = 1
    num_gpus: float = 0
    memory: int | None = None
    max_retries: int = 1
    preflight: Callable[[PipelineConfig], None] | None = None
    cacheable: bool = True
    fingerprint: tuple[str, ...] | None = None
    description: str = ""

    def fingerprint_keys(self) -> tuple[str, ...]:
        if self.fingerprint is not None:
            return self.fingerprint
        keys = ()
        if "model" in self.sections:
            keys += ("model.path",)
        if "data" in self.sections:
            keys += ("data.train_file", "data.eval_file")
        if "finetune" in self.sections:  # tenant adapters' data
            keys += ("finetune.adapters.*.train_file", "finetune.adapters.*.eval_file")
        return keys

    def code_version(self) -> str:
        """Hash of the stage module's source plus `version`."""
        module = inspect.getmodule(self.run)
        try:
            source = inspect.getsource(module) if module else ""
        except (OSError, TypeError):
            source = ""
        return hashlib.sha256(f"{self.version}\n{source}".encode()).hexdigest()[:16]

    def section_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        return {s: cfg.model_dump(mode="json")[s] for s in self.sections}


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

    def input(self, stage: str) -> dict:
        """Result record of an upstream stage (KeyError names what exists)."""
        if stage not in self.inputs:
            raise KeyError(f"stage {self.stage} has no input from {stage!r}; "
                           f"it has {sorted(self.inputs)}")
        return self.inputs[stage]

    def write_json(self, name: str, obj: Any) -> Path:
        """Write a JSON output atomically (temp file, then rename) under out_dir."""
        path = self.out_dir / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        tmp.replace(path)
        return path
