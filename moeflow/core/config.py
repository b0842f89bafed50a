"""Typed pipeline configuration: YAML -> pydantic, with dotted `--set` overrides.

Every section forbids unknown keys; a typo names the key and the nearest valid
one. Stage-specific sections live in `moeflow/core/sections/<stage>.py`, owned by
the stage that reads them.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moeflow.core.errors import UserError
from moeflow.core.sections import ExistingPath, LocalPath, Section
from moeflow.core.sections.calibrate import CalibrateSection
from moeflow.core.sections.convert import ConvertSection
from moeflow.core.sections.deploy import DeploySection
from moeflow.core.sections.estimate import EstimateSection
from moeflow.core.sections.finetune import FinetuneSection
from moeflow.core.sections.operators import OperatorsSection
from moeflow.core.sections.plan import PlanSection
from moeflow.core.sections.regress import RegressSection
from moeflow.core.sections.serving import ServingSection

Degree = Union[int, Literal["auto"]]


class ModelSection(Section):
    path: LocalPath  # HF checkpoint dir (sharded safetensors + index + config.json)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    freeze_base: bool = True  # LoRA trains adapters only; the base never changes
    trust_remote_code: bool = False  # run the checkpoint's own modeling code (auto_map), sha256-pinned


class HardwareSection(Section):
    spec: ExistingPath = "cpu-local"  # name in cluster/hardware/ or a path to a YAML spec
    nodes: int | None = Field(default=None, ge=1)  # override the spec's node count

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value


class ParallelSection(Section):
    """Parallel degrees; `auto` (per degree, or `parallel: auto`) means "use the plan".

    Explicit degrees pin the plan stage's search; a combination that cannot run
    or does not fit the hardware fails the plan stage with the budget it breaks.
    """

    tensor_parallel: Degree = "auto"  # shards attention/dense matmuls inside a node
    pipeline_parallel: Degree = "auto"  # splits the layers into stages
    expert_parallel: Degree = "auto"  # splits the routed experts (divides their count)
    data_parallel: Degree = "auto"  # replicas, each on its own batch
    fsdp: Degree = "auto"  # of the data-parallel ranks, how many shard the weights (lora)
    # of the data-parallel ranks, how many split one sequence (lora; auto: only when it does not fit)
    context_parallel: Degree = "auto"

    @model_validator(mode="before")
    @classmethod
    def _all_auto(cls, value: Any) -> Any:
        return {} if value == "auto" else value

    @model_validator(mode="after")
    def _positive(self) -> "ParallelSection":
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{name} must be >= 1 or auto (got {value})")
        return self

    def degrees(self) -> dict[str, int | str]:
        return {name: getattr(self, name) for name in type(self).model_fields}


class LoraSection(Section):
    rank: int = Field(default=16, ge=1)  # higher: more capacity and memory
    alpha: float = Field(default=32, gt=0)  # scale = alpha / rank
    dropout: float = Field(default=0.05, ge=0, lt=1)
    # module names, or the per-family aliases: attention, experts, shared_experts, router
    target_modules: list[str] = Field(default_factory=lambda: ["attention"], min_length=1)


class DataSection(Section):
    train_file: LocalPath | None = None  # JSONL: prompt/completion or chat messages
    eval_file: LocalPath | None = None  # default: a held-out split of train_file
    seq_len: int = Field(default=2048, ge=8)
    eval_fraction: float = Field(default=0.1, ge=0, lt=1)
    on_bad_line: Literal["error", "skip"] = "error"


class OptimizerSection(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    max_grad_norm: float | None = 1.0  # gradient clipping; null disables


class StageResources(Section):
    num_cpus: float | None = Field(default=None, ge=0)  # None: the stage's own default
    num_gpus: float | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, ge=0)  # bytes reserved in the Ray scheduler
    max_retries: int | None = Field(default=None, ge=0)  # retries on worker/node loss
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources: places a stage on nodes


class StagesSection(Section):
    enabled: list[str] | None = None  # None: every registered stage
    plugins: list[str] = Field(default_factory=list)  # modules defining extra STAGE(S)
    resources: dict[str, StageResources] = Field(default_factory=dict)


class TrackingSection(Section):
    uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db
    artifact_root: str | None = None  # local store only; default mlruns/artifacts


class RaySection(Section):
    address: str | None = None  # default: $RAY_ADDRESS, else a local Ray in-process
    num_cpus: int | None = Field(default=None, ge=1)  # local Ray only
    temp_dir: str | None = None  # local Ray only; default $MOEFLOW_RAY_TEMP_DIR


class PipelineConfig(Section):
    name: str = "moeflow"
    experiment: str = "moeflow"
    workdir: LocalPath = "work"  # stage outputs: <workdir>/<pipeline run id>/<stage>-<run>
    seed: int = 0
    model: ModelSection
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    stages: StagesSection = Field(default_factory=StagesSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    ray: RaySection = Field(default_factory=RaySection)
    convert: ConvertSection = Field(default_factory=ConvertSection)
    plan: PlanSection = Field(default_factory=PlanSection)
    operators: OperatorsSection = Field(default_factory=OperatorsSection)
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    deploy: DeploySection = Field(default_factory=DeploySection)
    regress: RegressSection = Field(default_factory=RegressSection)
    calibrate: CalibrateSection = Field(default_factory=CalibrateSection)
    serving: ServingSection = Field(default_factory=ServingSection)
    estimate: EstimateSection = Field(default_factory=EstimateSection)  # --dry-run's assumptions

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# ---------------------------------------------------------------- loading


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a raw config dict."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, for example lora.rank=16")
        parts = key.strip().split(".")
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None or child == "auto" and parts[:i + 1] == ["parallel"]:
                child = {}
                node[part] = child
            if not isinstance(child, dict):
                raise UserError(f"--set {item!r}: {'.'.join(parts[:i + 1])} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            node[parts[-1]] = text
    return raw


def _fields_at(loc: tuple) -> list[str]:
    """Valid field names of the section addressed by `loc` (for typo hints)."""
    model: Any = PipelineConfig
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return []
        annotation = fields[part].annotation
        model = next((a for a in getattr(annotation, "__args__", (annotation,))
                      if isinstance(a, type) and issubclass(a, BaseModel)), annotation)
    return list(getattr(model, "model_fields", {}))


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f" (did you mean `{'.'.join(map(str, loc[:-1] + (near[0],)))}`?)" if near else ""
        return f"unknown key `{key}`{hint}; valid keys here: {', '.join(valid)}"
    if err["type"] == "missing":
        return f"missing required key `{key}`"
    return f"`{key}`: {err['msg']} (got {err.get('input')!r})"


def _field_loc(loc: tuple) -> tuple:
    """Drop pydantic's union-member tags (`int`, `literal['auto']`) from a location."""
    keep: list = []
    for part in loc:
        if isinstance(part, str) and keep and part not in _fields_at(tuple(keep)) and (
                _fields_at(tuple(keep)) or "[" in part or part in ("int", "float", "str", "bool")):
            break
        keep.append(part)
    return tuple(keep)


def validate(raw: dict, source: str = "<config>") -> PipelineConfig:
    """Validate a raw dict; errors become one UserError naming every bad key."""
    if not isinstance(raw, dict):
        raise UserError(f"{source}: the top level must be a mapping of sections")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        grouped: dict[tuple, list[dict]] = {}
        for err in exc.errors():
            loc = err["loc"] if err["type"] == "extra_forbidden" else _field_loc(err["loc"])
            grouped.setdefault(loc, []).append(dict(err, loc=loc))
        lines = []
        for loc, errs in grouped.items():
            if len(errs) == 1:
                lines.append(_describe(errs[0]))
            else:  # a union: every member failed
                key = ".".join(map(str, loc))
                msgs = " or ".join(e["msg"].replace("Input should be ", "") for e in errs)
                lines.append(f"`{key}`: expected {msgs} (got {errs[0].get('input')!r})")
        raise UserError(f"{source}: " + "; ".join(lines)) from None


def read_yaml(path: str | Path, what: str = "config file") -> dict:
    """Read a YAML file; missing file or bad YAML is a UserError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    return raw if raw is not None else {}


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Load a YAML config file, apply `--set` overrides, validate."""
    raw = apply_overrides(read_yaml(path), list(overrides or []))
    return validate(raw, source=str(path))


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Flatten nested dicts to dotted keys (MLflow params)."""
    out: dict[str, str] = {}
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    out[prefix.rstrip(".")] = "null" if value is None else str(value)
    return out


def to_yaml(cfg: PipelineConfig) -> str:
    """The keys the user set (and the runner resolved), defaults left to a reload: a run's
    config.yaml read back by `moeflow deploy --run` / `resume` still tells an explicit
    `deploy:` knob from a default, so the serving stage's serving.yaml applies under it.
    The full effective config is in the run's params."""
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=False)
